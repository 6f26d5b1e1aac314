"""Argument checks for sparse MLA decode (shared by the torch and Triton paths).

Shapes (M query rows, H heads, T records, K indices per row):
  q_nope  float32/bf16/fp16 [M, H, 512]   (absorbed query, latent part)
  q_rope  float32/bf16/fp16 [M, H, 64]
  records uint8 [T, fmt.record_bytes]    (rows 4-byte aligned, bytes contiguous)
  indices int32/int64 [M, K]             (record rows; -1 = skip)
"""

from __future__ import annotations

import math

import torch

from sparkinfer.core.layouts import LATENT_DIM, MAIN_LAYOUTS, ROPE_DIM, RecordLayout, layout

_Q_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def resolve_layout(fmt) -> RecordLayout:
    """The main record layout of a format object (``.name``) or a format name."""
    name = fmt if isinstance(fmt, str) else getattr(fmt, "name", None)
    if name is None:
        raise ValueError(f"fmt must be a record format (with .name) or a format name, got {fmt!r}")
    lay = layout(name)
    if lay not in MAIN_LAYOUTS:
        raise ValueError(f"{lay.name} is not a main MLA record format; expected one of "
                         f"{[m.name for m in MAIN_LAYOUTS]}")
    return lay


def check_decode_inputs(q_nope, q_rope, records, fmt, indices, scale, check_indices: bool) -> RecordLayout:
    lay = resolve_layout(fmt)
    if q_nope.dim() != 3 or q_nope.shape[2] != LATENT_DIM:
        raise ValueError(f"q_nope must be [M, H, {LATENT_DIM}], got {tuple(q_nope.shape)}")
    m, h = q_nope.shape[:2]
    if tuple(q_rope.shape) != (m, h, ROPE_DIM):
        raise ValueError(f"q_rope must be [M, H, {ROPE_DIM}] = {(m, h, ROPE_DIM)}, got {tuple(q_rope.shape)}")
    for name, q in (("q_nope", q_nope), ("q_rope", q_rope)):
        if q.dtype not in _Q_DTYPES:
            raise ValueError(f"{name} must be float32, bfloat16 or float16, got {q.dtype}")
    if records.dtype != torch.uint8 or records.dim() != 2:
        raise ValueError(f"records must be uint8 [T, {lay.record_bytes}], got {records.dtype} {tuple(records.shape)}")
    if records.shape[1] != lay.record_bytes:
        raise ValueError(f"records are {records.shape[1]} bytes wide but {lay.name} records are "
                         f"{lay.record_bytes} bytes")
    if records.stride(1) != 1 or records.stride(0) % 4 != 0 or records.data_ptr() % 4 != 0:
        raise ValueError("records rows must have contiguous bytes and start at 4-byte aligned addresses")
    if indices.dtype not in (torch.int32, torch.int64) or indices.dim() != 2 or indices.shape[0] != m:
        raise ValueError(f"indices must be int32 or int64 [M={m}, K], got {indices.dtype} {tuple(indices.shape)}")
    devices = {t.device for t in (q_nope, q_rope, records, indices)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite float, got {scale!r}")
    if check_indices and indices.numel() > 0:
        lo, hi = int(indices.min()), int(indices.max())
        if lo < -1 or hi >= records.shape[0]:
            raise ValueError(f"indices must lie in [-1, T={records.shape[0]}), got range [{lo}, {hi}]")
    return lay
