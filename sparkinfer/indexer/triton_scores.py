"""Triton indexer scoring over 132-byte indexer_fp8 records.

Grid: ceil(T / BLOCK_T) programs. Program b loads the key bytes of tokens
[b*BLOCK_T, (b+1)*BLOCK_T) once (through token_slots when the cache is paged),
dequantizes them in registers (E4M3 code * fp32 power-of-two scale, bit-exact
with the torch codec), then for every query row m and index head h adds
w[m, h] * relu(q[m, h] . key_t) into an fp32 accumulator. Output: float32
scores [M, T], -inf for t > pos[m].

The dot product is an elementwise product and a fixed-shape ``tl.sum`` over
the 128 dims, so a token's score does not depend on which tile, shard or
batch it is computed in: the same token gives the same fp32 score on every
rank, which the sharded-versus-replicated check relies on. Top-k selection is
done afterwards with ``select_topk`` (torch.topk over packed int64 keys).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparkinfer.attention.triton_codes import e4m3_to_f32, load_f32
from sparkinfer.core.layouts import INDEX_DIM, INDEXER_FP8

BLOCK_T = 64
NUM_WARPS = 4


@triton.jit
def _indexer_scores_kernel(
    q_ptr, w_ptr, rec_ptr, slot_ptr, pos_ptr, out_ptr,
    M, HI, T, rec_stride, s_q_m, s_q_h, s_w_m, s_w_h, s_out_m,
    HAS_SLOTS: tl.constexpr, HAS_POS: tl.constexpr, BLOCK_T: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    d = tl.arange(0, 128)
    if HAS_SLOTS:
        slot = tl.load(slot_ptr + t, mask=tmask, other=0).to(tl.int64)
    else:
        slot = t.to(tl.int64)
    row_ptr = rec_ptr + slot * rec_stride
    codes = tl.load(row_ptr[:, None] + d[None, :], mask=tmask[:, None], other=0)
    key = e4m3_to_f32(codes) * load_f32(row_ptr + 128, tmask)[:, None]
    for m in range(M):
        acc = tl.zeros([BLOCK_T], tl.float32)
        for h in range(HI):
            qv = tl.load(q_ptr + m * s_q_m + h * s_q_h + d).to(tl.float32)
            wv = tl.load(w_ptr + m * s_w_m + h * s_w_h).to(tl.float32)
            acc += wv * tl.maximum(tl.sum(key * qv[None, :], axis=1), 0.0)
        if HAS_POS:
            acc = tl.where(t <= tl.load(pos_ptr + m), acc, float("-inf"))
        tl.store(out_ptr + m * s_out_m + t, acc, mask=tmask)


def indexer_scores_triton(q, w, records, pos=None, token_slots=None) -> torch.Tensor:
    """float32 scores [M, T] for validated inputs (see validate.py); -inf for t > pos[m]."""
    m, hi = q.shape[:2]
    n_tokens = records.shape[0] if token_slots is None else token_slots.shape[0]
    out = torch.empty((m, n_tokens), dtype=torch.float32, device=q.device)
    if m == 0 or n_tokens == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    dummy = out  # never read: HAS_SLOTS / HAS_POS are False
    _indexer_scores_kernel[(triton.cdiv(n_tokens, BLOCK_T),)](
        q, w, records,
        token_slots.contiguous() if token_slots is not None else dummy,
        pos.contiguous() if pos is not None else dummy,
        out, m, hi, n_tokens, records.stride(0), q.stride(0), q.stride(1), w.stride(0), w.stride(1), out.stride(0),
        HAS_SLOTS=token_slots is not None, HAS_POS=pos is not None, BLOCK_T=BLOCK_T, num_warps=NUM_WARPS,
    )
    return out


def compile_specs() -> list[dict]:
    """The launch configurations ``indexer_scores_triton`` uses, for compiling without a GPU
    (benchmarks/kernel_report.py; contract in OWNERSHIP.md): paged keys with positions (the engine's
    call) and a dense key array. num_stages is Triton's default (the wrapper passes none)."""
    fn = _indexer_scores_kernel
    specs = []
    for name, paged in (("paged", True), ("dense", False)):
        ptrs = {"rec_ptr": "*u8", "slot_ptr": "*i64" if paged else "*fp32", "pos_ptr": "*i64" if paged else "*fp32"}
        constexprs = {"HAS_SLOTS": paged, "HAS_POS": paged, "BLOCK_T": BLOCK_T}
        sig = {n: (ptrs.get(n, "*fp32") if n.endswith("_ptr") else "i32") for n in fn.arg_names if n not in constexprs}
        sig.update({n: "constexpr" for n in constexprs})
        specs.append({"name": f"indexer_scores[{name}]", "fn": fn, "signature": sig, "constexprs": constexprs,
                      "num_warps": NUM_WARPS, "num_stages": 3})
    return specs


assert INDEX_DIM == 128 and INDEXER_FP8.field("scale").offset == 128, "the kernel hard-codes the 132-byte layout"
