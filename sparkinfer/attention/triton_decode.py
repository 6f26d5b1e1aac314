"""Triton sparse MLA decode reading 368 / 432 / 656 byte records directly.

Grid: (M rows, ceil(H / BLOCK_H) head blocks, S splits). Program (m, hb, s)
walks the indices k in [s * k_per_split, (s+1) * k_per_split) of row m in
tiles of BLOCK_K, gathers those records, decodes them in registers to a
latent tile [BLOCK_K, 512] and a rope tile [BLOCK_K, 64] (bit-exact with the
torch codecs: E2M1 nibble * E4M3 group scale * outer scale; E4M3 rope * fp32
rope scale; bf16 rope; E4M3 * fp32 tile scale), and keeps an online softmax:

    m' = max(m, max_j s_j);  l' = l * e^(m - m') + sum_j e^(s_j - m')
    acc' = acc * e^(m - m') + sum_j e^(s_j - m') latent_j

At the end out = acc / l and lse = m + log l (natural log), or 0 and -inf
when the split saw no valid index. With S > 1 the S partials
(out float32 [S, M, H, 512], lse float32 [S, M, H]) are combined by
``merge_lse`` exactly like stock DCP combines per-rank partials, so one kernel
serves both a rank's local shard (return the partial + LSE) and a gathered
workspace (split for parallelism, merge locally).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparkinfer.core.layouts import FP8_DS_MLA, LATENT_DIM, NVFP4_368, NVFP4_432, RecordLayout

from .merge import merge_lse
from .triton_codes import e2m1_to_f32, e4m3_to_f32, load_bf16, load_f32

_FMT_ID = {NVFP4_368.name: 0, NVFP4_432.name: 1, FP8_DS_MLA.name: 2}

# Launch configuration. sm_120 gives a block at most 99 KB of shared memory; the
# fp32 dot operands need ~72 KB with 16 heads x 16 keys per tile and no software
# pipelining (the loads are data-dependent gathers, so extra stages only cost
# shared memory). tests/test_attention_compile.py compiles for sm_120 and checks.
BLOCK_H = 16
BLOCK_K = 16
NUM_STAGES = 1
NUM_WARPS = 4


@triton.jit
def _decode_tile(row_ptr, valid, FMT: tl.constexpr, OUTER_SCALE):
    """row_ptr [BK] byte pointers to records -> (latent fp32 [BK, 512], rope fp32 [BK, 64]); 0 where not valid."""
    d = tl.arange(0, 512)
    r = tl.arange(0, 64)
    vm = valid[:, None]
    if FMT == 2:
        # fp8_ds_mla: [0,512) E4M3 latent, [512,528) 4 fp32 tile scales, [528,656) bf16 rope.
        codes = tl.load(row_ptr[:, None] + d[None, :], mask=vm, other=0)
        tile_scale = load_f32(row_ptr[:, None] + 512 + (d[None, :] // 128) * 4, vm)
        latent = e4m3_to_f32(codes) * tile_scale
        rope = load_bf16(row_ptr[:, None] + 528 + r[None, :] * 2, vm)
    else:
        # NVFP4: [0,256) E2M1 pairs (element 2i low nibble), [256,288) E4M3 group scales (16 each).
        packed = tl.load(row_ptr[:, None] + d[None, :] // 2, mask=vm, other=0).to(tl.uint32)
        nibble = (packed >> ((d[None, :] % 2) * 4)) & 15
        group = e4m3_to_f32(tl.load(row_ptr[:, None] + 256 + d[None, :] // 16, mask=vm, other=0))
        if FMT == 0:
            outer = load_f32(row_ptr + 292, valid)
            latent = (e2m1_to_f32(nibble) * group) * outer[:, None]
            rope_scale = load_f32(row_ptr + 288, valid)
            rope = e4m3_to_f32(tl.load(row_ptr[:, None] + 304 + r[None, :], mask=vm, other=0)) * rope_scale[:, None]
        else:
            latent = (e2m1_to_f32(nibble) * group) * OUTER_SCALE
            rope = load_bf16(row_ptr[:, None] + 304 + r[None, :] * 2, vm)
    return latent, rope


@triton.jit
def _sparse_mla_decode_kernel(
    qn_ptr, qr_ptr, rec_ptr, idx_ptr, out_ptr, lse_ptr,
    H, K, k_per_split, rec_stride, scale, outer_scale,
    s_qn_m, s_qn_h, s_qr_m, s_qr_h, s_idx_m,
    s_out_s, s_out_m, s_out_h, s_lse_s, s_lse_m,
    FMT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    m = tl.program_id(0)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    d = tl.arange(0, 512)
    r = tl.arange(0, 64)
    qn = tl.load(qn_ptr + m * s_qn_m + heads[:, None] * s_qn_h + d[None, :], mask=hmask[:, None], other=0.0)
    qr = tl.load(qr_ptr + m * s_qr_m + heads[:, None] * s_qr_h + r[None, :], mask=hmask[:, None], other=0.0)
    qn = qn.to(tl.float32)
    qr = qr.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, 512], tl.float32)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        idx = tl.load(idx_ptr + m * s_idx_m + ks, mask=ks < k_hi, other=-1)
        valid = idx >= 0
        row_ptr = rec_ptr + tl.where(valid, idx, 0).to(tl.int64) * rec_stride
        latent, rope = _decode_tile(row_ptr, valid, FMT, outer_scale)
        s = tl.dot(qn, tl.trans(latent), input_precision=DOT_PRECISION)
        s += tl.dot(qr, tl.trans(rope), input_precision=DOT_PRECISION)
        s = tl.where(valid[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A finite anchor keeps rows that have seen no valid key at exactly 0 (no -inf - -inf).
        anchor = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - anchor)
        p = tl.exp(s - anchor[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, latent, input_precision=DOT_PRECISION)
        m_i = m_new

    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    tl.store(out_ptr + split * s_out_s + m * s_out_m + heads[:, None] * s_out_h + d[None, :], out,
             mask=hmask[:, None])
    tl.store(lse_ptr + split * s_lse_s + m * s_lse_m + heads, lse, mask=hmask)


def default_num_splits(m: int, head_blocks: int, k: int, block_k: int, device: torch.device) -> int:
    """Enough splits over K to give every SM about two programs (1 off-GPU: the interpreter is serial)."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = -(-2 * sms // max(1, m * head_blocks))
    return max(1, min(want, -(-k // block_k)))


def sparse_mla_decode_triton(q_nope, q_rope, records, lay: RecordLayout, indices, scale, *,
                             outer_scale: float = 1.0, num_splits: int | None = None,
                             dot_precision: str = "ieee"):
    """Launch the kernel on already-validated inputs; see ``sparse_mla_decode`` for the contract.

    outer_scale is the per-cache constant S of the 432 format (ignored by the others).
    """
    m, h = q_nope.shape[:2]
    k = indices.shape[1]
    head_blocks = triton.cdiv(h, BLOCK_H)
    splits = num_splits or default_num_splits(m, head_blocks, k, BLOCK_K, q_nope.device)
    # Splits cover whole tiles so a tile never straddles two programs.
    k_per_split = triton.cdiv(triton.cdiv(max(k, 1), splits), BLOCK_K) * BLOCK_K
    splits = max(1, triton.cdiv(k, k_per_split))
    q_nope = q_nope if q_nope.stride(-1) == 1 else q_nope.contiguous()
    q_rope = q_rope if q_rope.stride(-1) == 1 else q_rope.contiguous()
    indices = indices.contiguous()
    outs = torch.empty((splits, m, h, LATENT_DIM), dtype=torch.float32, device=q_nope.device)
    lses = torch.empty((splits, m, h), dtype=torch.float32, device=q_nope.device)
    if m > 0 and h > 0:
        _sparse_mla_decode_kernel[(m, head_blocks, splits)](
            q_nope, q_rope, records, indices, outs, lses,
            h, k, k_per_split, records.stride(0), float(scale), float(outer_scale),
            q_nope.stride(0), q_nope.stride(1), q_rope.stride(0), q_rope.stride(1), indices.stride(0),
            outs.stride(0), outs.stride(1), outs.stride(2), lses.stride(0), lses.stride(1),
            FMT=_FMT_ID[lay.name], BLOCK_H=BLOCK_H, BLOCK_K=BLOCK_K, DOT_PRECISION=dot_precision,
            num_warps=NUM_WARPS, num_stages=NUM_STAGES,
        )
    if splits == 1:
        return outs[0], lses[0]
    return merge_lse(outs, lses)



def compile_specs() -> list[dict]:
    """The launch configurations ``sparse_mla_decode_triton`` uses, for compiling without a GPU
    (benchmarks/kernel_report.py; contract in OWNERSHIP.md): one per record format, default
    ``dot_precision``."""
    ptrs = {"qn_ptr": "*bf16", "qr_ptr": "*bf16", "rec_ptr": "*u8", "idx_ptr": "*i32", "out_ptr": "*fp32",
            "lse_ptr": "*fp32"}
    fn = _sparse_mla_decode_kernel
    specs = []
    short = {NVFP4_368.name: "nvfp4_368", NVFP4_432.name: "nvfp4_432", FP8_DS_MLA.name: "fp8_ds_mla"}
    for layout_name, fmt in _FMT_ID.items():
        name = short[layout_name]
        constexprs = {"FMT": fmt, "BLOCK_H": BLOCK_H, "BLOCK_K": BLOCK_K, "DOT_PRECISION": "ieee"}
        sig = {n: ptrs.get(n) or ("fp32" if n in ("scale", "outer_scale") else "i32")
               for n in fn.arg_names if n not in constexprs}
        sig.update({n: "constexpr" for n in constexprs})
        specs.append({"name": f"sparse_mla_decode[{name}]", "fn": fn, "signature": sig, "constexprs": constexprs,
                      "num_warps": NUM_WARPS, "num_stages": NUM_STAGES})
    return specs
