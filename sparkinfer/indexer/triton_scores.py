"""Triton indexer scoring over 132-byte indexer_fp8 records, on tensor cores.

One program scores GROUP consecutive query rows m (``GROUPS``: 4 for fp8 and bf16 q, 1 for fp32)
against SPAN consecutive positions of their list, BLOCK_T a chunk:

    S[t, m, h] = key_t . q[m, h, :]       tl.dot [BLOCK_T, 128] x [128, GROUP x BLOCK_H] (MMA)
    score_tm = sum_h w[m, h] * relu(S[t, m, h])   a fixed-shape tl.sum over each row's BLOCK_H heads

The chunk's keys are the MMA's M dimension and the rows' index heads, stacked, its N (GLM-5.2: 32
heads x 128 dims; fewer heads are zero-padded to BLOCK_H >= 16, and a zero head adds an exact 0), so
any number of query rows, one included, runs on tensor cores, and M = BLOCK_T = 64 makes it a wgmma
on sm_90 at every GROUP (``chunk_scores``: why the keys and not the heads are M). Rows
of one list (a request's) share every key chunk: loaded and converted once for the group. Rows of
different lists in a group (a batch's request boundary) take a pass each over the chunks, the
group's dot each time, each pass storing the rows of its list. The program loads and converts its
rows' q (the B operand) and weights once, then per chunk the keys' E4M3 codes, read as 32 words a record (4 codes a load),
converted by the target's cvt (``e4m3_operand``) into the A operand of one dot over the 128 dims;
each record's fp32 power-of-two scale multiplies the finished dots (``scaled``; compiled, the finished
head sums, ``chunk_scores``): scaling every
product and partial sum of a column by one power of two is exact, so this is the dot with the
dequantized keys bit for bit, without a multiply per key element or a bit-by-bit decode. The
operands' type follows q's dtype: a float8_e4m3fn q (vLLM's quantized q, read as its bytes:
``Q_CODES``, converted like the keys) and the codes are exact in f16 (4-bit significands, exponents
within f16's), so one pass of f16 MMAs forms exact products (``"f16"``: one cvt per two codes on
sm_89 and newer, where bf16 takes one more per code); bf16 q is exact in bf16, and so are the codes
(``"bf16"``); fp32 q takes Triton's 3-pass tf32 split (``"tf32x3"``, q kept to about 22 bits).
Accumulation is fp32 in the MMA, 16 dims an instruction in dim order. (Until 2026-12-07 the keys were
decoded bit by bit, scaled and fed to tf32 MMAs; then, until the chunk loop, a program scored 64
positions in a K loop of 32-dim slices, loading q and the codes a byte at a time per slice, with
fp8 q in bf16: the same exact products, the same MMA sequence per key but for the f16 operands;
until ``chunk_scores``, the rows' heads were M and the keys N.)

An output element depends only on its own row of q and its own key, by the same instruction
sequence in every program, so a position's score does not depend on which tile, shard or batch
scores it: every rank gets the same fp32 score, which the sharded-versus-replicated merge and the
tiled top-k (``tiled.py``) rely on.

Two outputs (constexpr KEYS):
* scores: float32 [M, T] for ``indexer_scores_triton`` (-inf where t > pos[m]);
* keys: one pass of the tiled top-k. Row m's positions j in [j0, j0 + TILE) of its list
  (``row_start[m] + j`` in token_slots / token_ids, j < row_len[m]) become int64 selection keys
  (``topk.pack_keys``: ordered score bits << 32 | 2**32 - 1 - token id; INT64_MIN where j is past
  the row's list or its token id > pos[m]) at ``out[m, col0 + j - j0]``.
Offsets that are a product of sizes (row * stride, slot * record stride, list start + j) are int64.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from sparkinfer.attention.triton_codes import load_f32
from sparkinfer.core.layouts import INDEX_DIM, INDEXER_FP8

BLOCK_T = 64
# warps a program, by the dot's precision: fp32 q's 3-pass split at 4 warps took 254-255 registers and,
# with the row groups' bookkeeping, a 16 B stack frame on sm_120 in the key pass (2026-12-07); 8 hold it
# in 166
WARPS = {"f16": 4, "bf16": 4, "tf32x3": 8}
NUM_STAGES = 1
MAX_GRID_Y = 65535
HEAD_BLOCKS = (16, 32, 64)  # BLOCK_H: the heads padded to an MMA M tile (GLM-5.2: 32)
_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")  # read once, at import (as Triton does)
# ``chunk_scores``' form: the keys as the dot's M where compiled; interpreted, ``row_scores``' (its bits on
# inexact inputs, the paged top-k's), and the compiled form where a test sets this (on exact inputs)
_KEYS_AS_M = tl.constexpr(not _INTERPRETED)
# positions a program scores, in chunks of BLOCK_T (its loop): a program loads and converts its rows'
# queries once for them, and a decode call of 4 fp8 rows at 128K context is 128 programs of 4 rows
# (512 of one row before GROUPS), not 8,192 of one row and one chunk each
SPAN = 1024
# query rows a program scores, by the dot's precision (grid axis 0: ceil(M / GROUP)), their heads stacked
# as the dot's N = GROUP x BLOCK_H: rows that share their list (a request's rows: all of the score
# matrix's, a decode request's 1 + drafts, a prefill chunk's) load and convert each key chunk once for
# all of them, where a row a program did it once per row; rows of different lists take a pass each.
# bf16 at 4 rows spilled on sm_120 with the heads as M (255 registers, 864 B) and takes 166-168 with
# the keys as M (``chunk_scores``); fp32 q's 3-pass split stages its operands in 96 KB of shared memory
# at one row already
GROUPS = {"f16": 4, "bf16": 4, "tf32x3": 1}
_PRECISION = {torch.float32: "tf32x3", torch.bfloat16: "bf16"}


@triton.jit
def _indexer_scores_kernel(
    q_ptr, w_ptr, rec_ptr, slot_ptr, id_ptr, pos_ptr, start_ptr, len_ptr, out_ptr,
    M, HI, T, L, j0, col0, rec_stride, s_q_m, s_q_h, s_w_m, s_w_h, s_out_m,
    HAS_SLOTS: tl.constexpr, HAS_IDS: tl.constexpr, HAS_POS: tl.constexpr, ROWS: tl.constexpr,
    KEYS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, SPAN: tl.constexpr,
    PRECISION: tl.constexpr, Q_CODES: tl.constexpr, GROUP: tl.constexpr,
):
    r0 = tl.program_id(0).to(tl.int64) * GROUP  # this program's rows: r0 .. r0 + GROUP - 1
    first = tl.program_id(1) * SPAN  # this program's positions: [first, first + SPAN) of the launch's L
    gl = tl.arange(0, GROUP)
    there = r0 + gl < M
    rows = tl.minimum(r0 + gl, M - 1)  # rows past M stand in for the last: scored, never stored
    if ROWS:
        starts = tl.load(start_ptr + rows).to(tl.int64)
        lens = tl.load(len_ptr + rows).to(tl.int32)
    else:
        starts = tl.zeros([GROUP], tl.int64)
        lens = tl.zeros([GROUP], tl.int32) + T
    if HAS_POS:
        p = tl.load(pos_ptr + rows).to(tl.int32)  # positions and token ids under 2**31
    # the rows' queries (the dot's B operand [128, GROUP x BLOCK_H], ``octets``) and weights, loaded and
    # converted once for the program's chunks
    qa = q_tile(q_ptr, r0, M, s_q_m, s_q_h, HI, GROUP, BLOCK_H, PRECISION, Q_CODES, True)
    qt = octets(tl.trans(qa), GROUP, BLOCK_H)
    wv = head_weights(w_ptr + rows[:, None] * s_w_m, s_w_h, HI, BLOCK_H)
    wt = tl.permute(tl.reshape(wv, [GROUP, BLOCK_H // 8, 8]), (1, 0, 2))  # ``octets``' order
    dst = out_ptr + rows[None, :] * s_out_m
    # a pass per list among the rows: one when they share it (a request's rows; the score matrix's rows share
    # one list always, so without ROWS the kernel has no pass loop to run)
    for i in range(GROUP if ROWS else 1):
        start = lane(starts, gl, i)
        n = lane(lens, gl, i)
        act = there & (starts == start) & (lens == n)
        if (r0 + i < M) & (tl.sum((act & (gl < i)).to(tl.int32), 0) == 0):
            for c in range(first, tl.minimum(first + SPAN, L), BLOCK_T):
                t = tl.arange(0, BLOCK_T)
                local = c + t
                j = j0 + local  # position in the rows' list
                # the chunk's list entries from one scalar offset (start + j0 + c) and t: a position's
                # address is the chunk's plus a constant in each thread (folded into its loads)
                tmask = t < n - (j0 + c)  # j < n
                at = start + (j0 + c)
                if HAS_SLOTS:
                    slot = tl.load((slot_ptr + at) + t, mask=tmask, other=0).to(tl.int32)
                else:
                    slot = tl.where(tmask, at + t, 0).to(tl.int32)
                # positions past the list read record 0 (a masked slot load's 0; ``_launch`` refuses an
                # empty cache), so a chunk's key words load without a mask
                rows_at = record_rows(rec_ptr, slot, rec_stride)
                score = chunk_scores(qa, qt, wv, wt, rows_at, tmask, GROUP, BLOCK_H, BLOCK_T, PRECISION, False)
                if HAS_IDS:
                    tid = tl.load((id_ptr + at) + t, mask=tmask, other=0).to(tl.int32)
                else:
                    tid = j
                if KEYS:
                    valid = tmask[:, None]  # and the row's list is this pass's (act): the stores' mask
                    if HAS_POS:
                        valid = valid & (tid[:, None] <= p[None, :])
                    tl.store(dst + col0 + local[:, None], selection_keys(score, tid[:, None], valid),
                             mask=act[None, :])
                else:  # positions past the list are not stored: the causal mask alone picks -inf (8 SEL fewer)
                    if HAS_POS:
                        score = tl.where(tid[:, None] <= p[None, :], score, float("-inf"))
                    tl.store(dst + j[:, None], score, mask=act[None, :] & tmask[:, None])


# The inline PTX of ``key_rows`` (a word's 4 E4M3 codes, byte i = element i, to f16 or bf16 elements 0..3:
# ``cvt.rn.f16x2.e4m3x2`` puts a 16-bit half's low byte in the low f16) and of ``record_rows`` (the slot's
# byte offset); checked on every code without a GPU by ``sparkinfer.testing.ptx`` (tests/attention/test_inline_ptx.py).
_E4M3X4_F16_PTX = tl.constexpr(
    "{ .reg .b16 l, h; .reg .b32 a, b; mov.b32 {l, h}, $4; cvt.rn.f16x2.e4m3x2 a, l; "
    "cvt.rn.f16x2.e4m3x2 b, h; mov.b32 {$0, $1}, a; mov.b32 {$2, $3}, b; }")
_E4M3X4_BF16_PTX = tl.constexpr(
    "{ .reg .b16 l, h, x0, x1, x2, x3; .reg .b32 a, b; .reg .f32 f0, f1, f2, f3; mov.b32 {l, h}, $4; "
    "cvt.rn.f16x2.e4m3x2 a, l; cvt.rn.f16x2.e4m3x2 b, h; mov.b32 {x0, x1}, a; mov.b32 {x2, x3}, b; "
    "cvt.f32.f16 f0, x0; cvt.f32.f16 f1, x1; cvt.f32.f16 f2, x2; cvt.f32.f16 f3, x3; "
    "cvt.rn.bf16x2.f32 a, f1, f0; cvt.rn.bf16x2.f32 b, f3, f2; mov.b32 {$0, $1}, a; mov.b32 {$2, $3}, b; }")
_MUL_WIDE_PTX = tl.constexpr("mul.wide.s32 $0, $1, $2;")


@triton.jit
def record_rows(rec_ptr, slot, rec_stride):
    """Byte pointers of the records ``slot`` (int32: under 2**31 records, ``_launch``) at stride ``rec_stride``.
    Compiled, a slot's byte offset is one 32 x 32 -> 64-bit multiply (``mul.wide.s32``, folded into the
    address add: one IMAD.WIDE), where Triton's int64 product of the two took 5 SASS instructions a
    record (LLVM does not see the stride's sign extension, hoisted out of the loop)."""
    if _INTERPRETED:
        off = slot.to(tl.int64) * rec_stride
    else:
        off = tl.inline_asm_elementwise(_MUL_WIDE_PTX, "=l,r,r", [slot, slot * 0 + rec_stride],
                                        dtype=tl.int64, is_pure=True, pack=1)
    return rec_ptr + off


@triton.jit
def lane(v, lanes, i):
    """Element i of the small vector ``v`` (``lanes`` its arange) as a scalar."""
    return tl.sum(tl.where(lanes == i, v, 0), 0)


@triton.jit
def row_scores(qa, wv, row_ptr, tmask, GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr,
               PRECISION: tl.constexpr):
    """fp32 scores [GROUP, BLOCK_T] of GROUP query rows (their heads stacked in the operand ``qa``,
    ``q_tile``; weights ``wv`` [GROUP, BLOCK_H], ``head_weights``) against the records at byte
    pointers ``row_ptr`` [BLOCK_T] (0 where not ``tmask``): the module docstring's MMA and
    relu-weighted head sum. Every caller scores a key with this one instruction sequence per row
    (``key_tile``, one ``head_dots`` over the 128 dims, ``scaled``, ``head_sum``), so a key's score
    is the same in every kernel, tile and rank."""
    s = head_dots(qa, key_tile(row_ptr, tmask, PRECISION), tl.zeros([GROUP * BLOCK_H, BLOCK_T], tl.float32),
                  BLOCK_H, PRECISION)
    return head_sum(wv, tl.reshape(scaled(s, row_ptr, tmask), [GROUP, BLOCK_H, BLOCK_T]))


@triton.jit
def octets(qt, GROUP: tl.constexpr, BLOCK_H: tl.constexpr):
    """The stacked heads' columns of ``qt`` [128, GROUP x BLOCK_H] (row g's head h at g x BLOCK_H + h,
    ``q_tile`` transposed) reordered octet-major: head h of row g at (h // 8) x 8 GROUP + 8 g + h % 8.
    An MMA accumulator's column bits 0-2 lie in a thread and its quad's lanes; Triton spreads the
    warps over bits 3-4 where it splits N (mma.sync at N 128 on sm_120): with the rows there, each
    row's heads stay in one warp and its head sum needs no trip through shared memory."""
    q4 = tl.permute(tl.reshape(qt, [128, GROUP, BLOCK_H // 8, 8]), (0, 2, 1, 3))
    return tl.reshape(q4, [128, GROUP * BLOCK_H])


@triton.jit
def chunk_scores(qa, qt, wv, wt, row_ptr, tmask, GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr,
                 PRECISION: tl.constexpr, MASKED: tl.constexpr = True):
    """fp32 scores [BLOCK_T, GROUP] of the records at ``row_ptr`` [BLOCK_T] against GROUP query rows
    (``qa`` [GROUP x BLOCK_H, 128]: ``q_tile``; ``qt`` [128, GROUP x BLOCK_H]: qa transposed, its columns
    in ``octets``' order; weights ``wv`` [GROUP, BLOCK_H] and ``wt`` [BLOCK_H // 8, GROUP, 8], the same in
    that order; the compiled kernel reads qt and wt, the interpreted one and fp32 q's qa and wv):
    ``row_scores`` transposed, the keys the dot's A operand (M = BLOCK_T) and the rows' heads its N.
    Each dot is the same: its products, and its sum over the dims in MMA steps of 16 in dim order,
    do not depend on which operand is A. The layout is what changes: a thread holds 8 heads of a row
    per position, so the head sum is 7 adds in a thread and 2 shuffles in a quad where the heads down
    the M dimension took a shuffle tree over the lanes and a trip through shared memory between the
    warps, and the q operand stays in shared memory (wgmma's B) where the A operand was reloaded
    every chunk. The head sum's fp32 order follows the layout (as ``head_sum``'s does), so on a GPU
    the scores may differ from ``row_scores``' (the paged top-k's) in the last bits on inexact inputs;
    on exact inputs they are the same numbers. Interpreted, it is ``row_scores`` transposed, bit for bit
    (``_KEYS_AS_M``), and so it is for fp32 q (not the engine's): its 3-pass split with the keys as M
    took 255 registers and an 8 B stack frame on sm_120 at 4 and at 8 warps."""
    if not _KEYS_AS_M or PRECISION == "tf32x3":
        return tl.trans(row_scores(qa, wv, row_ptr, tmask, GROUP, BLOCK_H, BLOCK_T, PRECISION))
    keys = key_rows(row_ptr, tmask, PRECISION, MASKED)
    scale = load_f32(row_ptr + 128, tmask)  # loaded with the codes (pipelined with them: one wait a chunk)
    if _INTERPRETED:  # fp32 operands, exact products (``head_dots``: the interpreter's bf16 and f16 dots)
        s = tl.dot(keys.to(tl.float32), qt.to(tl.float32))
    else:
        s = tl.dot(keys, qt, tl.zeros([BLOCK_T, GROUP * BLOCK_H], tl.float32))
    s = tl.maximum(tl.reshape(s, [BLOCK_T, BLOCK_H // 8, GROUP, 4, 2]), 0.0)
    s = tl.permute(s * tl.reshape(wt, [BLOCK_H // 8, GROUP, 4, 2])[None, :, :, :, :], (0, 2, 3, 1, 4))
    # the heads in a thread first, one after another, then across its quad
    s = tl.sum(_chain_add(tl.zeros([BLOCK_T, GROUP, 4], tl.float32), tl.reshape(s, [BLOCK_T, GROUP, 4, BLOCK_H // 4]),
                          BLOCK_H // 4), axis=2)
    # the record's scale, a positive power of two, after the head sum: relu, each weight's product and
    # every partial sum scale by it exactly (``scaled``), so this is the sum of the scaled dots, one
    # multiply a score where ``scaled`` took one a head
    return s * scale[:, None]


@triton.jit
def _chain_add(acc, x, N: tl.constexpr):
    """acc + the N elements of x [T, G, 4, N]'s last dimension, one add at a time."""
    if N == 1:
        return acc + tl.reshape(x, [x.shape[0], x.shape[1], x.shape[2]])
    else:
        lo, hi = tl.split(tl.reshape(x, [x.shape[0], x.shape[1], x.shape[2], N // 2, 2]))
        return _chain_add(_chain_add(acc, lo, N // 2), hi, N // 2)


@triton.jit
def e4m3_operand(codes, PRECISION: tl.constexpr):
    """float8_e4m3fn bytes as a dot operand, by the target's conversion (cvt from e4m3 on sm_89 and
    newer, two codes an instruction): f16 for the "f16" dot, bf16 for "bf16", fp32 otherwise. Exact
    for every finite code (an E4M3 value has a 4-bit significand and an exponent within f16's); the
    two NaN codes never occur (the quantizers clamp to +-448)."""
    return _operand(codes.to(tl.float8e4nv, bitcast=True), PRECISION)


@triton.jit
def _operand(v, PRECISION: tl.constexpr):
    """v as a dot operand: f16 for the "f16" dot, bf16 for "bf16", fp32 otherwise."""
    if PRECISION == "f16":
        v = v.to(tl.float16)
    elif PRECISION == "bf16":
        v = v.to(tl.bfloat16)
    else:
        v = v.to(tl.float32)
    return v


@triton.jit
def key_tile(row_ptr, tmask, PRECISION: tl.constexpr):
    """The keys' 128 E4M3 codes at ``row_ptr`` [BLOCK_T] as the dot's B operand [128, BLOCK_T]
    (``key_rows`` transposed)."""
    return tl.trans(key_rows(row_ptr, tmask, PRECISION))


@triton.jit
def key_rows(row_ptr, tmask, PRECISION: tl.constexpr, MASKED: tl.constexpr = True):
    """The keys' 128 E4M3 codes at ``row_ptr`` [BLOCK_T] as a dot operand [BLOCK_T, 128]
    (``e4m3_operand``; the records' scales multiply the dots after, ``scaled``). A record's codes are
    read as 32 words from its 4-byte aligned start (the wrappers check the strides): 4 codes a load,
    not one; byte i of word w is dim 4 w + i. Compiled for the "f16" and "bf16" dots, a word's two
    16-bit halves go to ``cvt.rn.f16x2.e4m3x2`` as they are (inline PTX: 2 cvt a word, for bf16 then
    4 cvt to f32 and 2 to bf16x2; the same values as ``e4m3_operand``'s), where Triton's byte split
    and re-pairing of the codes took some 5 more SASS instructions a word (bf16: 604 -> 540 SASS a
    chunk on sm_90, but 762 -> 797 on sm_120, whose own f16 -> bf16 path is cheaper); otherwise (and
    interpreted) the bytes are joined into the [BLOCK_T, 128] codes first and converted once, so a
    word's low pair needs no re-pairing."""
    w = tl.arange(0, 32)
    if MASKED:
        words = tl.load(row_ptr.to(tl.pointer_type(tl.int32))[:, None] + w[None, :], mask=tmask[:, None], other=0)
    else:  # every row_ptr a record's, those past tmask too (their keys are not used)
        words = tl.load(row_ptr.to(tl.pointer_type(tl.int32))[:, None] + w[None, :])
    if PRECISION == "f16" and not _INTERPRETED:
        c0, c1, c2, c3 = tl.inline_asm_elementwise(_E4M3X4_F16_PTX, "=h,=h,=h,=h,r", [words],
                                                   dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
                                                   is_pure=True, pack=1)
        return tl.reshape(tl.join(tl.join(c0, c2), tl.join(c1, c3)), [words.shape[0], 128])
    if PRECISION == "bf16" and not _INTERPRETED:  # f16x2, each f16 to f32, a pair to bf16x2: all exact
        c0, c1, c2, c3 = tl.inline_asm_elementwise(_E4M3X4_BF16_PTX, "=h,=h,=h,=h,r", [words],
                                                   dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16),
                                                   is_pure=True, pack=1)
        return tl.reshape(tl.join(tl.join(c0, c2), tl.join(c1, c3)), [words.shape[0], 128])
    b0 = words.to(tl.uint8)
    b1 = (words >> 8).to(tl.uint8)
    b2 = (words >> 16).to(tl.uint8)
    b3 = (words >> 24).to(tl.uint8)
    return e4m3_operand(tl.reshape(tl.join(tl.join(b0, b2), tl.join(b1, b3)), [words.shape[0], 128]), PRECISION)


@triton.jit
def scaled(s, row_ptr, tmask):
    """The heads' dots with the codes s [BLOCK_H, BLOCK_T] times each record's fp32 power-of-two scale:
    the dots with the dequantized keys, bit for bit (every product and partial sum of a column
    scales by the same power of two, exactly: no dot of finite records comes near fp32's range ends)."""
    return s * load_f32(row_ptr + 128, tmask)[None, :]


@triton.jit
def q_tile(q_ptr, r0, M, s_q_m, s_q_h, HI, GROUP: tl.constexpr, BLOCK_H: tl.constexpr, PRECISION: tl.constexpr,
           Q_CODES: tl.constexpr, WORDS: tl.constexpr = False):
    """The heads (stride ``s_q_h``, 128 unit-stride dims) of GROUP consecutive query rows from r0 (rows
    past M stand in for the last) stacked as the dot's A operand [GROUP x BLOCK_H, 128]: row
    r0 + g's head h at g x BLOCK_H + h (0 past HI), in the dot's precision (``_operand``). WORDS (fp8
    q): a head's codes read 4 a load and converted as a record's (``key_rows``; the tiled kernel,
    where it cut the f16 kernel's code outside its chunk loop on sm_90 from 1,318 to 515 SASS
    instructions; the paged top-k, which loads q per tile, spilled with it)."""
    i = tl.arange(0, GROUP * BLOCK_H)
    h = i % BLOCK_H
    row = tl.minimum(r0 + i // BLOCK_H, M - 1).to(tl.int64)
    if Q_CODES and WORDS:  # 4-byte aligned heads (``q_operand``)
        return key_rows(q_ptr + row * s_q_m + h * s_q_h, h < HI, PRECISION)
    d = tl.arange(0, 128)
    qv = tl.load(q_ptr + (row * s_q_m + h * s_q_h)[:, None] + d[None, :], mask=(h < HI)[:, None], other=0)
    if Q_CODES:  # float8_e4m3fn bytes (``e4m3_operand``)
        qv = qv.to(tl.float8e4nv, bitcast=True)
    return _operand(qv, PRECISION)


@triton.jit
def head_dots(q, k, s, BLOCK_H: tl.constexpr, PRECISION: tl.constexpr):
    """s + q [G x BLOCK_H, 128] x k [128, BLOCK_T] on tensor cores, fp32 accumulation (one dot: its MMAs
    step through the dims in order, k16 each; an element depends on its own row of q and column of k
    only). Under TRITON_INTERPRET=1 the operands go in as fp32 (Triton 3.9's interpreter multiplies
    bf16 as its raw uint16 bits, ``triton_decode._dot``, and numpy's f16 matmul rounds to f16: the same
    exact products) and as G dots of one row's BLOCK_H heads, batched: numpy's matmul sums a
    [64, 128] x [128, 64] product's elements in other orders than a [32, 128] one's, so a stacked dot
    would give a row other bits than the dot of its heads alone (the paged top-k's)."""
    if _INTERPRETED:
        G: tl.constexpr = q.shape[0] // BLOCK_H
        BT: tl.constexpr = k.shape[1]
        rows = tl.reshape(q.to(tl.float32), [G, BLOCK_H, 128])
        keys = tl.broadcast_to(tl.expand_dims(k.to(tl.float32), 0), [G, 128, BT])
        s = s + tl.reshape(tl.dot(rows, keys), [G * BLOCK_H, BT])
    elif PRECISION == "bf16" or PRECISION == "f16":
        s = tl.dot(q, k, s)
    else:
        s = tl.dot(q, k, s, input_precision=PRECISION)
    return s


@triton.jit
def head_weights(w_row, s_w_h, HI, BLOCK_H: tl.constexpr):
    """A row's head weights fp32 [BLOCK_H] (0 past HI), read as they come (fp32 or bf16); rows' [G,
    BLOCK_H] from their row pointers [G, 1]."""
    h = tl.arange(0, BLOCK_H)
    return tl.load(w_row + h * s_w_h, mask=h < HI, other=0.0).to(tl.float32)


@triton.jit
def head_sum(wv, s):
    """sum_h w[h] * relu(s[h, :]): a row's score from its heads' weights ``wv`` and dots s fp32
    [BLOCK_H, BLOCK_T] (rows': wv [G, BLOCK_H] and s [G, BLOCK_H, BLOCK_T] -> [G, BLOCK_T], each
    row's heads summed alike)."""
    return tl.sum(tl.expand_dims(wv, -1) * tl.maximum(s, 0.0), axis=-2)


@triton.jit
def selection_keys(score, tid, valid):
    """int64 selection keys (``topk.pack_keys``) of fp32 scores and token ids (int32 or int64, in
    [0, 2**31)); INT64_MIN where not ``valid``."""
    bits = (score + 0.0).to(tl.int32, bitcast=True)  # + 0.0 folds -0.0 into +0.0
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)
    # 2**32 - 1 - id, the key's low word: the id's 32 bits inverted (no 64-bit subtraction)
    key = (ordered << 32) | (tid.to(tl.int32) ^ -1).to(tl.uint32, bitcast=True).to(tl.int64)
    return tl.where(valid, key, -9223372036854775808)


def block_h(hi: int) -> int:
    """The MMA M tile for hi index heads."""
    for b in HEAD_BLOCKS:
        if hi <= b:
            return b
    raise ValueError(f"at most {HEAD_BLOCKS[-1]} index heads are supported, got {hi}")


def q_operand(q):
    """(q as the kernels read it, PRECISION, Q_CODES) for ``row_scores``: unit stride in the dims, a
    float8 q as its bytes (the module docstring's precision rule)."""
    q = q if q.stride(-1) == 1 else q.contiguous()
    codes = q.dtype == torch.float8_e4m3fn
    if codes and (q.stride(0) % 4 or q.stride(1) % 4 or q.data_ptr() % 4):  # q_tile reads a head's codes as words
        q = q.clone(memory_format=torch.contiguous_format)
    return (q.view(torch.uint8) if codes else q), ("f16" if codes else _PRECISION[q.dtype]), codes


def _launch(q, w, records, out, programs: int, *, slots, ids, pos, start, length, n_tokens, limit, j0, col0, keys):
    q, precision, codes = q_operand(q)
    if records.stride(0) % 4 or records.data_ptr() % 4:  # key_tile loads a record's codes 4 at a time
        raise ValueError(f"records must start 4-byte aligned with a row stride of a multiple of 4, got stride "
                         f"{records.stride(0)} at address {records.data_ptr()}")
    if not 0 < records.shape[0] < 2**31:  # record_rows: a slot is an int32; a masked position reads record 0
        raise ValueError(f"1 to 2**31 - 1 records are supported, got {records.shape[0]}")
    dummy = out  # never read where its HAS_* / ROWS flag is False
    _indexer_scores_kernel[(triton.cdiv(q.shape[0], GROUPS[precision]), programs)](
        q, w, records, dummy if slots is None else slots, dummy if ids is None else ids,
        dummy if pos is None else pos, dummy if start is None else start, dummy if length is None else length,
        out, q.shape[0], q.shape[1], n_tokens, limit, j0, col0, records.stride(0), q.stride(0), q.stride(1), w.stride(0),
        w.stride(1), out.stride(0),
        HAS_SLOTS=slots is not None, HAS_IDS=ids is not None, HAS_POS=pos is not None, ROWS=start is not None,
        KEYS=keys, BLOCK_H=block_h(q.shape[1]), BLOCK_T=BLOCK_T, SPAN=SPAN, PRECISION=precision,
        Q_CODES=codes, GROUP=GROUPS[precision], num_warps=WARPS[precision], num_stages=NUM_STAGES,
    )


def indexer_scores_triton(q, w, records, pos=None, token_slots=None) -> torch.Tensor:
    """float32 scores [M, T] for validated inputs (see validate.py); -inf for t > pos[m]."""
    m = q.shape[0]
    n_tokens = records.shape[0] if token_slots is None else token_slots.shape[0]
    out = torch.empty((m, n_tokens), dtype=torch.float32, device=q.device)
    if m == 0 or n_tokens == 0:
        return out
    slots = None if token_slots is None else token_slots.contiguous()
    pos = None if pos is None else pos.contiguous()
    for j0 in range(0, n_tokens, MAX_GRID_Y * SPAN):  # grid axis 1 holds at most 65,535 programs
        _launch(q, w, records, out, min(MAX_GRID_Y, triton.cdiv(n_tokens - j0, SPAN)), slots=slots,
                ids=None, pos=pos, start=None, length=None, n_tokens=n_tokens, limit=n_tokens - j0, j0=j0, col0=0,
                keys=False)
    return out


def score_keys_pass(q, w, records, pos, row_start, row_len, token_slots, token_ids, out, j0: int, col0: int,
                    tile: int) -> None:
    """One pass of the tiled top-k: int64 keys of list positions [j0, j0 + tile) of every row into
    ``out[:, col0 : col0 + tile]`` (out int64 [M, >= col0 + tile], unit column stride).

    q [M, Hi, 128], w [M, Hi], records uint8 [R, 132], pos int64 [M], row_start int64 [M],
    row_len int32/int64 [M], token_slots int64 [S] or None, token_ids int [S] or None (all on one
    device, validated by the caller); tile a multiple of BLOCK_T. One launch for all rows.
    """
    if tile % BLOCK_T or tile > MAX_GRID_Y * BLOCK_T:
        raise ValueError(f"tile must be a multiple of {BLOCK_T} up to {MAX_GRID_Y * BLOCK_T}, got {tile}")
    if q.shape[0] == 0:
        return
    flat = lambda t: None if t is None else t.contiguous()  # the kernel indexes them densely
    _launch(q, w, records, out, triton.cdiv(tile, SPAN), slots=flat(token_slots),
            ids=flat(token_ids), pos=flat(pos), start=flat(row_start), length=flat(row_len), n_tokens=0, limit=tile,
            j0=j0, col0=col0, keys=True)


def compile_specs() -> list[dict]:
    """The launch configurations ``indexer_scores_triton`` and ``score_keys_pass`` use in the engine,
    for GLM-5.2's 32 index heads (BLOCK_H 32), as kernel_report.py reads them: name, fn, signature,
    constexprs, num_warps, num_stages. The score matrix through token slots with a causal mask; the
    key pass of the tiled top-k with per-row lists, without token ids (replicated scoring) and with
    them (sharded scoring); each for fp32 and bf16 q, and the engine's key pass for fp8 q (its bytes).
    Pointer types are those of the batched call (fp32 w, int64 slots / positions / list starts, int32
    token ids / list lengths from plan_rows)."""
    specs = []
    for name, keys, ids, q_dtypes in (("indexer_scores", False, False, ("fp32", "bf16")),
                                      ("indexer_keys", True, False, ("fp32", "bf16", "u8")),
                                      ("indexer_keys_ids", True, True, ("fp32", "bf16"))):
        for q_dtype in q_dtypes:
            precision = {"fp32": "tf32x3", "bf16": "bf16", "u8": "f16"}[q_dtype]
            constexprs = {"HAS_SLOTS": True, "HAS_IDS": ids, "HAS_POS": True, "ROWS": keys, "KEYS": keys,
                          "BLOCK_H": 32, "BLOCK_T": BLOCK_T, "SPAN": SPAN, "PRECISION": precision,
                          "Q_CODES": q_dtype == "u8", "GROUP": GROUPS[precision]}
            ptrs = {"q_ptr": f"*{q_dtype}", "w_ptr": "*fp32", "rec_ptr": "*u8", "slot_ptr": "*i64",
                    "id_ptr": "*i32" if ids else "*fp32", "pos_ptr": "*i64",
                    "start_ptr": "*i64" if keys else "*fp32", "len_ptr": "*i32" if keys else "*fp32",
                    "out_ptr": "*i64" if keys else "*fp32"}
            sig = {n: ptrs[n] if n in ptrs else "i32" for n in _indexer_scores_kernel.arg_names
                   if n not in constexprs}
            sig.update({n: "constexpr" for n in constexprs})
            specs.append({"name": f"{name}[q_{'fp8' if q_dtype == 'u8' else q_dtype}]", "fn": _indexer_scores_kernel, "signature": sig,
                          "constexprs": constexprs, "num_warps": WARPS[precision], "num_stages": NUM_STAGES})
    return specs


assert INDEX_DIM == 128 and INDEXER_FP8.field("scale").offset == 128, "the kernel hard-codes the 132-byte layout"
