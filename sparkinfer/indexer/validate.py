"""Argument checks for indexer scoring (shared by the torch and Triton paths).

Shapes (M query rows of one sequence, Hi index heads, T tokens, R cache rows):
  q            float32/bf16/fp8 [M, Hi, 128]  index queries (float8_e4m3fn: vLLM's quantized q,
                                            its scales folded into w)
  w            float32/bf16 [M, Hi]        per-row head weights
  records      uint8 [R, 132]              indexer_fp8 keys (rows contiguous)
  pos          int64/int32 [M]             row m may select tokens 0..pos[m]
  token_slots  int64/int32 [T] or None     cache row of token t (None: t itself, T = R)
"""

from __future__ import annotations

import torch

from sparkinfer.core.layouts import INDEX_DIM, INDEXER_FP8

_FLOATS = (torch.float32, torch.bfloat16)
_Q_DTYPES = _FLOATS + (torch.float8_e4m3fn,)
_INTS = (torch.int32, torch.int64)


def check_index_inputs(q, w, records, pos, token_slots, check_values: bool) -> int:
    """Validate; returns T, the number of tokens that can be scored."""
    if q.dim() != 3 or q.shape[2] != INDEX_DIM or q.dtype not in _Q_DTYPES:
        raise ValueError(f"q must be float32/bf16/float8_e4m3fn [M, Hi, {INDEX_DIM}], got {q.dtype} {tuple(q.shape)}")
    m, hi = q.shape[:2]
    if tuple(w.shape) != (m, hi) or w.dtype not in _FLOATS:
        raise ValueError(f"w must be float32/bf16 [M, Hi]={(m, hi)}, got {w.dtype} {tuple(w.shape)}")
    rb = INDEXER_FP8.record_bytes
    if records.dtype != torch.uint8 or records.dim() != 2 or records.shape[1] != rb:
        raise ValueError(f"records must be uint8 [R, {rb}] indexer_fp8 keys, got {records.dtype} "
                         f"{tuple(records.shape)}")
    if records.stride(1) != 1 or records.stride(0) % 4 != 0 or records.data_ptr() % 4 != 0:
        raise ValueError("records rows must have contiguous bytes and start at 4-byte aligned addresses")
    if pos is not None and (pos.dtype not in _INTS or tuple(pos.shape) != (m,)):
        raise ValueError(f"pos must be int64 [M={m}], got {pos.dtype} {tuple(pos.shape)}")
    if token_slots is not None and (token_slots.dtype not in _INTS or token_slots.dim() != 1):
        raise ValueError(f"token_slots must be int64 [T], got {token_slots.dtype} {tuple(token_slots.shape)}")
    tensors = [t for t in (q, w, records, pos, token_slots) if t is not None]
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted({str(t.device) for t in tensors})}")
    n_tokens = records.shape[0] if token_slots is None else token_slots.shape[0]
    if check_values:
        if not (bool(torch.isfinite(q.float()).all()) and bool(torch.isfinite(w).all())):
            raise ValueError("q and w must be finite (a NaN score has no place in a top-k)")
        if pos is not None and m > 0 and (int(pos.min()) < 0 or int(pos.max()) >= n_tokens):
            raise ValueError(f"pos must lie in [0, T={n_tokens}), got range [{int(pos.min())}, {int(pos.max())}]")
        if token_slots is not None and n_tokens > 0 and (
                int(token_slots.min()) < 0 or int(token_slots.max()) >= records.shape[0]):
            raise ValueError(f"token_slots must lie in [0, R={records.shape[0]})")
    return n_tokens
