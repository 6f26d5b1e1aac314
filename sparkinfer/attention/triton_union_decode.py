"""Triton sparse MLA decode over a request's union: each record is gathered and decoded once for all
of the request's query rows.

With MTP a request verifies R = 1 + drafts query rows, each with its own top-k; the rows overlap
heavily (GLM-5.2 at top-2048, R = 4: ~3,584 distinct records of 8,192 listed). The per-row kernel
(``triton_decode``) gathers and decodes every listed record once per row and once per block of 16
heads. This kernel walks the request's union instead and puts all of its R rows x H heads in the
M dimension of the tensor-core dots, so a record is read and decoded once per (request, M block,
column half); a per-row membership mask keeps each row's softmax to its own top-k.

Inputs (B requests, R rows each, H heads, U union capacity, T records)::

    q_nope    fp32/bf16/fp16 [B*R, H, 512]  row r of request b is query row b*R + r
    q_rope    fp32/bf16/fp16 [B*R, H, 64]
    records   uint8 [T, record_bytes]       rows with contiguous bytes, any row stride (a strided
                                            view); with 16-byte aligned rows (Triton specializes
                                            the stride) NVFP4 codes load as 16-byte vectors
    union     int64 [B, U]                  record rows of request b's union, -1 = pad
    union_len int32 [B]                     entries of union[b] to walk (pads inside are skipped)
    row_mask  int32 [B, U]                  bit r set: row r's top-k holds union[b, u]
                                            (``sparkinfer.plan.union.union_row_masks``)

Output: out fp32/bf16 [B*R, H, 512] and lse fp32 [B*R, H], the same contract as
``sparse_mla_decode`` with indices = each row's top-k (natural-log LSE; a row with no valid record
gets out 0 and lse -inf). A row's top-k is a set: the mask cannot count a record twice.

Grid (B, 2 MB, S): program (b, 2 mb + c, s) takes M block mb (BLOCK_M consecutive (row, head)
pairs, m = r * H + h: R = 4 x H = 16 is one block of 64; H = 64 stock is four), half c of the 512
output columns and the s-th of S equal slices of the union (whole tiles of BLOCK_K). Per tile of
BLOCK_K union entries it loads the entries, their row bits and the records (masked to entries some
row wants), decodes them straight into bf16 dot operands and runs QK^T [BLOCK_M, BLOCK_K] over all
576 dims, the per-row mask (-inf where the row's bit is clear), the online softmax (base 2, as the
per-row kernel) and PV into fp32 accumulators of its 256 columns.

Why two column halves: at M = 64 the fp32 accumulators of all 512 columns are 128 registers a
thread at 8 warps, and with the decoded tiles, the scores and the probability operands the kernel
spilled on both targets. Half the columns per program halves them; the price is QK and the latent
decode done by both programs of a block (the MMA work grows by the QK's 576 / 1,600), and the
records gathered twice (the two programs are adjacent in the grid and walk the same records at
the same pace, so the second gather can hit L2).

Decoding without bit-by-bit arithmetic (the values are exact in bf16, as in ``triton_decode``):

* E4M3 bytes are bitcast to ``float8e4nv`` and converted (cvt on sm_89+).
* An E2M1 nibble (sign, e1 e0, m) becomes the fp16 with sign bit 15, exponent bits 11..10 = e1 e0
  and mantissa bit 9 = m: that fp16 is exactly value(code) * 2^-14, normal and subnormal codes
  alike (fp16's bias is 15, E2M1's 1), so two masks, two shifts and an or, then one cvt to fp32
  and one multiply by its group scale d_g * 2^14 (loaded once per group of 16, bitcast E4M3).
* The NVFP4 latent is never interleaved: the low nibbles (even elements) and the high nibbles
  (odd elements) are two [BLOCK_K, 256] tiles against the even and odd query columns. Half c's own
  tile (nibble c: c = 0 even, 1 odd columns) is decoded first and is the PV operand too, so no
  third tile is built (on sm_120 one more [64, 256] operand in shared memory passed its 99 KB); its
  QK adds the own tile's product first, and since the sum of two products is the same in either
  order the scores are those of the even-first order bit for bit. fp8_ds_mla's half c takes chunks
  2c, 2c + 1, decoded again (hardware cvt) from their bytes for PV after the QK.
* bf16 rope is loaded as bf16; per-key scales (368: s_t and r; 432: S; 656: one per 128-chunk)
  multiply the fp32 score and probability columns, as in ``triton_decode``.

Split-K merge, fused (``triton_decode._merge_partials``): with S > 1 each program writes its normalized partial (its 256 columns of
out [BLOCK_M, 512]; the first half the lse) to the workspace, then takes a ticket from the
(request, M block) counter, which both halves share; the program that draws the last of the 2 S
tickets resets the counter to 0 (so the launch can be replayed, CUDA graphs) and merges the S
partials exactly (``merge_lse``'s formula) into out / lse. S = 1 writes out directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sparkinfer.core.layouts import FP8_DS_MLA, LATENT_DIM, NVFP4_368, NVFP4_432, ROPE_DIM, RecordLayout

from .triton_codes import load_f32
from .triton_decode import (_FMT_ID, PRECISIONS, _finish, _load_q, _merge_partials, _pv, _qk, _sm_count,
                            _split_range, _start, _store_out)

# The M block: the rows x heads of a request in one dot (R = 4 x H = 16); smaller products use the
# next power of two (at least 16, an mma.sync tile's M). 64 keys per tile: with 32, Triton spreads the
# 8 warps of the mma.sync kernel (sm_120) along N, so each warp of the QK dot [64, 32] had 4 keys
# (an n8 tile: decoded twice); 64 keys cut the PTX per key x row by a third on sm_120 and by a
# sixth on sm_90. The tile also sets the online softmax's steps: another BLOCK_K rounds differently.
# Registers at M = 64 (Triton 3.9, ptxas -v, 8 warps; benchmarks/kernel_report.py): with all 512
# columns in one program the fp32 accumulators took 128 registers a thread and every format spilled
# 2.8-3.0 KB on sm_120 and 3.5-3.9 KB on sm_90. Half the columns per program: fp8_ds_mla no spill on
# sm_120, NVFP4 0.5-0.8 KB; sm_90 still 1.8-2.2 KB. There Triton lays a wgmma dot whose result feeds
# another dot (QK -> PV, the PV's hi -> lo) with all 8 warps along M, which at M = 64 computes the 64
# rows on both warpgroups; cutting the hi -> lo chain (acc - (-lo dot), no fold) gave -12% on 368 and
# +9% on 656 (not kept). 4 warps on sm_90 spill 13 KB (the accumulators again 128 registers a thread).
# Shared memory: 88 KB (80 KB for fp8_ds_mla) on sm_120 (limit 99 KB), 136-144 KB on sm_90.
MAX_BLOCK_M = 64
BLOCK_K = 64
NUM_WARPS = 8
NUM_STAGES = 1  # the record loads are data-dependent gathers: nothing for Triton to pipeline
MAX_ROWS = 32  # bits of the int32 row mask
MAX_SPLITS = 64
# A split covers at least this many union entries: its partial (64 rows x heads x 513 fp32 = 131 KB,
# written and read back by the merge) then stays below the records it gathers (1024 x 368 B = 377 KB).
MIN_KEYS_PER_SPLIT = 1024
_D = tl.constexpr(LATENT_DIM)  # a partial's row: the output width


@triton.jit
def _e4m3_bf16(byte):
    """E4M3 byte(s) -> bf16, exact (hardware cvt where the target has one)."""
    return byte.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)


@triton.jit
def _e2m1_x(nibble, scale):
    """E2M1 code (uint8, 0..15) x scale -> bf16, where scale = group scale x 2^14 (module docstring)."""
    c = nibble.to(tl.uint16)
    half = (((c & 8) << 12) | ((c & 7) << 9)).to(tl.float16, bitcast=True)
    return (half.to(tl.float32) * scale).to(tl.bfloat16)


@triton.jit
def _bytes(row_ptr, vm, BYTE0: tl.constexpr, N: tl.constexpr):
    """Bytes [BYTE0, BYTE0 + N) of each record -> uint8 [BK, N]."""
    return tl.load(row_ptr[:, None] + BYTE0 + tl.arange(0, N)[None, :], mask=vm, other=0)


@triton.jit
def _nvfp4_tiles(row_ptr, vm, sh, BK: tl.constexpr):
    """NVFP4 latent of BK records -> (own, other) bf16 [BK, 256]: own is the nibble at bit ``sh`` of each
    byte (0: the even elements, 4: the odd ones), other the remaining nibble; column c is element 2c
    or 2c + 1, both in group c // 8; codes viewed as [BK, 32 groups, 8 bytes], one scale byte per group."""
    g = tl.arange(0, 32)
    rp = row_ptr[:, None, None]
    vm3 = vm[:, :, None]
    # 2-D load (256 contiguous bytes a record: 16-byte vectors), then viewed as [BK, group, byte]
    codes = tl.reshape(_bytes(row_ptr, vm, 0, 256), [BK, 32, 8])
    gs = tl.load(rp + 256 + g[None, :, None], mask=vm3, other=0)
    scale = _e4m3_bf16(gs).to(tl.float32) * 16384.0
    mine = _e2m1_x((codes >> sh) & 15, scale)
    other = _e2m1_x((codes >> (4 - sh)) & 15, scale)
    return tl.reshape(mine, [BK, 256]), tl.reshape(other, [BK, 256])


@triton.jit
def _bf16_tile(row_ptr, vm, BYTE0: tl.constexpr, N: tl.constexpr):
    """N bf16 values of each record from BYTE0 -> bf16 [BK, N] (no decoding)."""
    p = (row_ptr[:, None] + BYTE0 + 2 * tl.arange(0, N)[None, :]).to(tl.pointer_type(tl.bfloat16))
    return tl.load(p, mask=vm, other=0.0)


@triton.jit
def _union_decode_kernel(
    qn_ptr, qr_ptr, rec_ptr, union_ptr, len_ptr, mask_ptr, out_ptr, lse_ptr, po_ptr, pl_ptr, cnt_ptr,
    R, H, num_splits, rec_stride, qk_scale, outer_scale,
    s_qn_m, s_qn_h, s_qr_m, s_qr_h, s_un_b, s_mask_b, s_out_m, s_out_h, s_lse_m, s_po_s, s_po_b, s_pl_s, s_pl_b,
    FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    Q_SPLIT: tl.constexpr, P_SPLIT: tl.constexpr, F32_DOT: tl.constexpr, OUT_BF16: tl.constexpr,
):
    b = tl.program_id(0)
    mb = tl.program_id(1) // 2
    half = tl.program_id(1) % 2  # the half of the 512 output columns this program accumulates
    split = tl.program_id(2)
    num_mb = tl.num_programs(1) // 2
    mm = mb * BLOCK_M + tl.arange(0, BLOCK_M)  # m = row * H + head within the request
    mvalid = mm < R * H
    row = mm // H
    head = mm % H
    qrow = b * R + row
    NVFP4: tl.constexpr = FMT != 2
    CW: tl.constexpr = 256 if NVFP4 else 128  # NVFP4: even / odd columns; 656: four chunks of 128
    cw = tl.arange(0, CW)
    qn_row = qn_ptr + qrow[:, None] * s_qn_m + head[:, None] * s_qn_h
    if NVFP4:
        q0h, q0l = _load_q(qn_row, 2 * cw + half, mvalid, Q_SPLIT)
        q1h, q1l = _load_q(qn_row, 2 * cw + 1 - half, mvalid, Q_SPLIT)
    else:
        q0h, q0l = _load_q(qn_row, cw, mvalid, Q_SPLIT)
        q1h, q1l = _load_q(qn_row, 128 + cw, mvalid, Q_SPLIT)
        q2h, q2l = _load_q(qn_row, 256 + cw, mvalid, Q_SPLIT)
        q3h, q3l = _load_q(qn_row, 384 + cw, mvalid, Q_SPLIT)
    qrh, qrl = _load_q(qr_ptr + qrow[:, None] * s_qr_m + head[:, None] * s_qr_h, tl.arange(0, 64), mvalid, Q_SPLIT)

    m_i, l_i, acc0, acc1, _, _ = _start(BLOCK_M, CW)
    k_lo, k_hi = _split_range(tl.load(len_ptr + b), num_splits, split, BLOCK_K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        inside = ks < k_hi
        idx = tl.load(union_ptr + b * s_un_b + ks, mask=inside, other=-1)
        bits = tl.load(mask_ptr + b * s_mask_b + ks, mask=inside, other=0)
        valid = (idx >= 0) & (bits != 0)  # a record no row wants is not read
        bits = tl.where(valid, bits, 0)
        row_ptr = rec_ptr + tl.where(valid, idx, 0) * rec_stride
        vm = valid[:, None]
        zero_s = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
        if NVFP4:
            t0, t1 = _nvfp4_tiles(row_ptr, vm, 4 * half, BLOCK_K)
            t2, t3 = t0, t1  # unused: NVFP4 has two latent tiles
            s_lat = _qk(q1h, q1l, t1, _qk(q0h, q0l, t0, zero_s, Q_SPLIT, F32_DOT), Q_SPLIT, F32_DOT)
            if FMT == 0:
                a0 = load_f32(row_ptr + 292, valid)  # per-token outer scale s_t
                rs = load_f32(row_ptr + 288, valid)  # rope scale r
                s_rope = _qk(qrh, qrl, _e4m3_bf16(_bytes(row_ptr, vm, 304, 64)), zero_s, Q_SPLIT, F32_DOT)
                s = a0[None, :] * s_lat + rs[None, :] * s_rope
            else:
                a0 = tl.full([BLOCK_K], 1.0, tl.float32) * outer_scale
                s = a0[None, :] * s_lat + _qk(qrh, qrl, _bf16_tile(row_ptr, vm, 304, 64), zero_s, Q_SPLIT, F32_DOT)
            a1, a2, a3 = a0, a0, a0  # one per-key scale for both tiles
        else:
            t0, a0 = _e4m3_bf16(_bytes(row_ptr, vm, 0, 128)), load_f32(row_ptr + 512, valid)
            t1, a1 = _e4m3_bf16(_bytes(row_ptr, vm, 128, 128)), load_f32(row_ptr + 516, valid)
            t2, a2 = _e4m3_bf16(_bytes(row_ptr, vm, 256, 128)), load_f32(row_ptr + 520, valid)
            t3, a3 = _e4m3_bf16(_bytes(row_ptr, vm, 384, 128)), load_f32(row_ptr + 524, valid)
            s = _qk(qrh, qrl, _bf16_tile(row_ptr, vm, 528, 64), zero_s, Q_SPLIT, F32_DOT)
            s += a0[None, :] * _qk(q0h, q0l, t0, zero_s, Q_SPLIT, F32_DOT)
            s += a1[None, :] * _qk(q1h, q1l, t1, zero_s, Q_SPLIT, F32_DOT)
            s += a2[None, :] * _qk(q2h, q2l, t2, zero_s, Q_SPLIT, F32_DOT)
            s += a3[None, :] * _qk(q3h, q3l, t3, zero_s, Q_SPLIT, F32_DOT)
        # Row r of the request sees the entries whose bit r is set; base-2 scores (qk_scale = scale * log2 e).
        mine = ((bits[None, :] >> row[:, None]) & 1) != 0
        s = tl.where(mine, s * qk_scale, float("-inf"))
        # This program's half of the value columns: NVFP4 its own tile t0 (nibble ``half``), 656 chunks
        # 2 half and 2 half + 1 with their per-key scales, decoded again from their bytes (L1).
        if NVFP4:
            m_i, l_i, acc0, acc1 = _softmax_pv_half(s, m_i, l_i, acc0, acc1, t0, t0, a0, a0, False, P_SPLIT, F32_DOT)
        else:
            hp = row_ptr + 256 * half
            m_i, l_i, acc0, acc1 = _softmax_pv_half(s, m_i, l_i, acc0, acc1, _e4m3_bf16(_bytes(hp, vm, 0, 128)),
                                                    _e4m3_bf16(_bytes(hp, vm, 128, 128)),
                                                    load_f32(row_ptr + 512 + 8 * half, valid),
                                                    load_f32(row_ptr + 516 + 8 * half, valid), True, P_SPLIT, F32_DOT)

    inv_l, lse = _finish(m_i, l_i)
    # Output columns of this half: NVFP4 the even / odd elements 2c + half, 656 chunks 2 half (+1).
    STEP: tl.constexpr = 2 if NVFP4 else 1
    cols = STEP * cw + (half if NVFP4 else 256 * half)
    vmask = mvalid[:, None]
    lmask = mm < R * H * (1 - half)  # both halves hold the same LSE: the first writes it
    if num_splits == 1:
        o_row = out_ptr + qrow[:, None] * s_out_m + head[:, None] * s_out_h
        _store_out(o_row + cols, acc0 * inv_l[:, None], vmask, OUT_BF16, False)
        if not NVFP4:
            _store_out(o_row + cols + 128, acc1 * inv_l[:, None], vmask, OUT_BF16, False)
        tl.store(lse_ptr + qrow * s_lse_m + head, lse, mask=lmask)
    else:
        p_row = po_ptr + split * s_po_s + b * s_po_b + mm[:, None] * _D
        tl.store(p_row + cols, acc0 * inv_l[:, None], mask=vmask)
        if not NVFP4:
            tl.store(p_row + cols + 128, acc1 * inv_l[:, None], mask=vmask)
        tl.store(pl_ptr + split * s_pl_s + b * s_pl_b + mm, lse, mask=lmask)
        # Every thread's partial is written (barrier) before the ticket is released (acq_rel, gpu scope).
        # The 2 S programs of a (request, M block) share its counter: the last merges all 512 columns.
        tl.debug_barrier()
        ticket = tl.atomic_add(cnt_ptr + b * num_mb + mb, 1, sem="acq_rel")
        if ticket == 2 * num_splits - 1:
            tl.store(cnt_ptr + b * num_mb + mb, 0)  # the next launch starts from 0 again
            last = tl.minimum(mm, R * H - 1)  # rows past R x H read the last row's partial (not stored)
            _merge_partials(po_ptr + b * s_po_b + last * _D, pl_ptr + b * s_pl_b + last,
                            out_ptr + qrow * s_out_m + head * s_out_h, lse_ptr + qrow * s_lse_m + head, mvalid,
                            num_splits, s_po_s, s_pl_s, BLOCK_M, OUT_BF16, False)


@triton.jit
def _softmax_pv_half(s, m_i, l_i, acc0, acc1, t0, t1, a0, a1, TWO: tl.constexpr, P_SPLIT: tl.constexpr,
                     F32_DOT: tl.constexpr):
    """One online-softmax step over base-2 scores s [BM, BK] (``triton_decode._softmax_pv``'s, on one
    half of the value columns) and the PV update: acc0 += p a0 t0 (and with TWO acc1 += p a1 t1)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # A finite anchor keeps rows that have seen no valid key at exactly 0 (no -inf - -inf).
    anchor = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - anchor)
    p = tl.exp2(s - anchor[:, None])
    acc0 = _pv(p * a0[None, :], t0, acc0 * alpha[:, None], P_SPLIT, F32_DOT)
    if TWO:
        acc1 = _pv(p * a1[None, :], t1, acc1 * alpha[:, None], P_SPLIT, F32_DOT)
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc0, acc1


def block_m(rows: int, heads: int) -> int:
    """The M block for R rows x H heads: their product's next power of two in [16, MAX_BLOCK_M]."""
    return max(16, min(MAX_BLOCK_M, triton.next_power_of_2(rows * heads)))


def union_splits_for(b: int, m_blocks: int, union_width: int, sms: int) -> int:
    """Splits of each union: about one program per SM (one wave), each split covering at least
    MIN_KEYS_PER_SPLIT union entries, at most MAX_SPLITS."""
    want = -(-sms // max(1, 2 * b * m_blocks))
    return max(1, min(want, union_width // MIN_KEYS_PER_SPLIT, MAX_SPLITS))


@dataclass
class UnionWorkspace:
    """Device buffers of one union-decode shape (B requests, R*H rows x heads, S splits):
    partial_out fp32 [S, B, R*H, 512], partial_lse fp32 [S, B, R*H] and the merge counters int32
    [B, MB] (zero; the merging program puts its counter back to zero). None of them when S == 1."""

    partial_out: torch.Tensor | None
    partial_lse: torch.Tensor | None
    counters: torch.Tensor | None

    @classmethod
    def allocate(cls, b: int, rows: int, heads: int, num_splits: int, device) -> "UnionWorkspace":
        if not 1 <= num_splits <= MAX_SPLITS:
            raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
        if num_splits == 1:
            return cls(None, None, None)
        rh = rows * heads
        f32 = dict(dtype=torch.float32, device=device)
        return cls(torch.empty((num_splits, b, rh, LATENT_DIM), **f32), torch.empty((num_splits, b, rh), **f32),
                   torch.zeros((b, triton.cdiv(rh, block_m(rows, heads))), dtype=torch.int32, device=device))

    @property
    def num_splits(self) -> int:
        return 1 if self.partial_out is None else self.partial_out.shape[0]


def check_union_inputs(q_nope, q_rope, records, lay: RecordLayout, union, union_len, row_mask, rows: int) -> None:
    """Shapes, dtypes and devices (no value is read back: the forward's rule)."""
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"rows per request must be in [1, {MAX_ROWS}] (bits of the int32 row mask), got {rows}")
    if q_nope.dim() != 3 or q_nope.shape[2] != LATENT_DIM or q_nope.shape[0] % rows:
        raise ValueError(f"q_nope must be [B*R, H, {LATENT_DIM}] with R = {rows}, got {tuple(q_nope.shape)}")
    m, h = q_nope.shape[:2]
    b = m // rows
    if tuple(q_rope.shape) != (m, h, ROPE_DIM):
        raise ValueError(f"q_rope must be {(m, h, ROPE_DIM)}, got {tuple(q_rope.shape)}")
    if records.dtype != torch.uint8 or records.dim() != 2 or records.shape[1] != lay.record_bytes \
            or records.stride(1) != 1 or records.stride(0) % 4 or records.data_ptr() % 4:
        raise ValueError(f"records must be uint8 [T, {lay.record_bytes}] with contiguous bytes and 4-byte aligned "
                         f"rows, got {records.dtype} {tuple(records.shape)} strides {records.stride()}")
    if union.dtype != torch.int64 or union.dim() != 2 or union.shape[0] != b or union.stride(1) != 1:
        raise ValueError(f"union must be int64 [B={b}, U] with a contiguous last dim, got {union.dtype} "
                         f"{tuple(union.shape)}")
    if row_mask.dtype != torch.int32 or tuple(row_mask.shape) != tuple(union.shape) or row_mask.stride(1) != 1:
        raise ValueError(f"row_mask must be int32 {tuple(union.shape)} with a contiguous last dim, got "
                         f"{row_mask.dtype} {tuple(row_mask.shape)}")
    if union_len.dtype != torch.int32 or tuple(union_len.shape) != (b,):
        raise ValueError(f"union_len must be int32 [{b}], got {union_len.dtype} {tuple(union_len.shape)}")
    devices = {t.device for t in (q_nope, q_rope, records, union, union_len, row_mask)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")


def sparse_mla_union_decode(q_nope, q_rope, records, lay: RecordLayout, union, union_len, row_mask, rows: int,
                            scale: float, *, outer_scale: float = 1.0, num_splits: int | None = None,
                            dot_precision: str = "bf16x2", out=None, lse=None,
                            workspace: UnionWorkspace | None = None):
    """One launch of the union kernel (module docstring). out (fp32 or bf16 [B*R, H, 512]), lse (fp32
    [B*R, H]) and workspace (whose S wins over num_splits; default ``union_splits_for`` on a GPU, 1
    under the interpreter) are optional preallocated buffers."""
    check_union_inputs(q_nope, q_rope, records, lay, union, union_len, row_mask, rows)
    m, h = q_nope.shape[:2]
    b = m // rows
    dev = q_nope.device
    bm = block_m(rows, h)
    if workspace is None:
        if num_splits is None:
            num_splits = 1 if dev.type != "cuda" else \
                union_splits_for(b, triton.cdiv(rows * h, bm), union.shape[1], _sm_count(dev))
        workspace = UnionWorkspace.allocate(b, rows, h, num_splits, dev)
    out = torch.empty((m, h, LATENT_DIM), dtype=torch.float32, device=dev) if out is None else out
    lse = torch.empty((m, h), dtype=torch.float32, device=dev) if lse is None else lse
    if tuple(out.shape) != (m, h, LATENT_DIM) or out.dtype not in (torch.float32, torch.bfloat16) \
            or out.stride(-1) != 1 or tuple(lse.shape) != (m, h) or lse.dtype != torch.float32:
        raise ValueError(f"out must be fp32/bf16 {(m, h, LATENT_DIM)} (contiguous last dim), lse fp32 {(m, h)}")
    if b == 0 or h == 0:
        return out, lse
    q_nope = q_nope if q_nope.stride(-1) == 1 else q_nope.contiguous()
    q_rope = q_rope if q_rope.stride(-1) == 1 else q_rope.contiguous()
    splits = workspace.num_splits
    po, pl, cnt = (workspace.partial_out, workspace.partial_lse, workspace.counters) if splits > 1 \
        else (out, lse, union_len)  # unused with one split
    _union_decode_kernel[(b, 2 * triton.cdiv(rows * h, bm), splits)](
        q_nope, q_rope, records, union, union_len, row_mask, out, lse, po, pl, cnt,
        rows, h, splits, records.stride(0), float(scale) * 1.4426950408889634, float(outer_scale),
        q_nope.stride(0), q_nope.stride(1), q_rope.stride(0), q_rope.stride(1), union.stride(0), row_mask.stride(0),
        out.stride(0), out.stride(1), lse.stride(0),
        po.stride(0) if splits > 1 else 0, po.stride(1) if splits > 1 else 0,
        pl.stride(0) if splits > 1 else 0, pl.stride(1) if splits > 1 else 0,
        **union_constexprs(lay, q_nope.dtype, dot_precision, bm, dev.type != "cuda", out.dtype == torch.bfloat16),
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    return out, lse


def union_constexprs(lay: RecordLayout, q_dtype: torch.dtype, dot_precision: str, bm: int,
                     interpreted: bool = False, bf16_out: bool = False) -> dict:
    if dot_precision not in PRECISIONS:
        raise ValueError(f"dot_precision must be one of {PRECISIONS}, got {dot_precision!r}")
    split = dot_precision == "bf16x2"
    return dict(FMT=_FMT_ID[lay.name], BLOCK_M=bm, BLOCK_K=BLOCK_K, Q_SPLIT=split and q_dtype != torch.bfloat16,
                P_SPLIT=split, F32_DOT=interpreted, OUT_BF16=bf16_out)


_SIG = {"qn_ptr": "*bf16", "qr_ptr": "*bf16", "rec_ptr": "*u8", "union_ptr": "*i64", "len_ptr": "*i32",
        "mask_ptr": "*i32", "out_ptr": "*fp32", "lse_ptr": "*fp32", "po_ptr": "*fp32", "pl_ptr": "*fp32",
        "cnt_ptr": "*i32", "qk_scale": "fp32", "outer_scale": "fp32"}


def compile_specs() -> list[dict]:
    """The launch configurations for compiling without a GPU (benchmarks/kernel_report.py): each
    record format with bf16 queries (the engine's dtype) at R = 4 x H = 16 (one M block of 64),
    fp32 output. ``attrs``: the record stride and pointers 16-byte divisible, as a launch with a
    contiguous (or 16-byte strided) records view specializes them, so record loads vectorize."""
    specs = []
    for lay in (NVFP4_368, NVFP4_432, FP8_DS_MLA):
        c = union_constexprs(lay, torch.bfloat16, "bf16x2", block_m(4, 16))
        names = [n for n in _union_decode_kernel.arg_names if n not in c]
        sig = {n: _SIG.get(n, "i32") for n in names}
        sig.update({n: "constexpr" for n in c})
        div16 = [n for n in names if n.endswith("_ptr") or n == "rec_stride"]
        attrs = {(_union_decode_kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in div16}
        specs.append(dict(name=f"sparse_mla_union_decode[{lay.short}]", fn=_union_decode_kernel, signature=sig,
                          constexprs=c, attrs=attrs, num_warps=NUM_WARPS, num_stages=NUM_STAGES))
    return specs
