"""Triton sparse MLA decode on tensor cores, reading 368 / 432 / 656 byte records directly.

One kernel, one launch per call, without a host read: ``_sparse_mla_decode_kernel`` (grid M x
ceil(H / heads a program) x S: BLOCK_H = 16 heads, or WIDE_H = 32 over a paged view where a block may
hold the shared memory, sm_90: ``heads_per_program``). Program (m, hb, s):

1. compacts its split (``_compact_split``): it counts row m's valid indices (>= 0) among its K
   listed ones and stores those whose position in the compacted order falls in the s-th of S equal
   slices of the count (whole tiles of BLOCK_K, so the trip count is count-driven and no tile
   straddles two programs) at that position of the workspace row, int64. On the stock DCP path
   about 3/4 of a rank's top-k is -1 (tokens of other ranks), so the attention walks only this
   rank's records, in equal slices. The list is read from DRAM once; the row's other programs
   find it in L2. (A separate compaction kernel did this before: one more launch.) A list whose
   valid indices come first (all valid; or the paged path's, compacted by ``triton_paging.topk_rows``,
   which the caller says: ``compacted``) is counted and its slice copied, without the scan.
2. walks its slice of the compacted indices, gathers those records (copied into shared memory two tiles
   ahead: ``NUM_STAGES``) and decodes them into bf16 tiles: the latent in chunks (656: four of
   [BLOCK_K, 128]; NVFP4 four of [64, 128] at 64 keys a tile, else two of [32, 256]) and the rope
   [BLOCK_K, 64], with the packed decoders
   of ``triton_codes`` (on a GPU inline PTX, two codes per instruction; NVFP4 tiles hold value x group
   scale / NVFP4_SHIFT, a power of two that the per-key scale a_j below takes back) and their
   columns in the decoders' pair order (``_tile_order``: queries and outputs follow it). The decoded values
   are exact in bf16: an E2M1 value times its E4M3 group scale has at most 6 significant bits,
   an E4M3 value 4, a bf16 rope value is bf16. The remaining scales are per key
   (368: the fp32 outer scale s_t, the fp32 rope scale r; 656: one fp32 scale per 128-wide
   chunk) or per cache (432: S), so they multiply the fp32 scores and probabilities per key
   column instead of the tiles:

       s_j = scale * (sum_c a_cj * q_c . t_cj + b_j * q_rope . rope_j)
       acc_c += (p_j * a_cj) t_cj          (a_cj = s_t, S or the tile scale; b_j = r or 1)

   QK and PV are ``tl.dot`` on bf16 operands with an fp32 accumulator (mma.sync on sm_80..sm_120,
   sm_90 too since 16 heads are below a wgmma tile). With ``dot_precision="bf16x2"`` (default)
   fp32 queries and the fp32 probabilities are split into hi + lo bf16 halves (x = hi + lo to
   ~16 mantissa bits) and each product is two dots; "bf16" rounds them once (8 bits). The online
   softmax and the LSE are fp32 in base 2 and returned in natural log:

       m' = max(m, max_j s_j);  l' = l 2^(m - m') + sum_j 2^(s_j - m')

   out = acc / l, lse = (m + log2 l) ln 2, or 0 and -inf for a split that saw no valid index.
3. With one split the program writes out (fp32, or bf16 rounded to nearest even: ``_bf16_bits``)
   and lse. With S > 1 it writes its partial (out fp32 [S, M, H, 512], lse fp32 [S, M, H]), then
   takes a ticket from the (row, head block) counter (after a barrier, acq_rel at gpu scope); the
   program that draws the last of the S tickets resets the counter to 0 (so the launch can be
   replayed: CUDA graphs) and merges the S partials exactly (``_merge_partials``, the formula of
   ``merge_lse``) into out / lse. (A separate merge kernel did this before: one more launch.)

Workspace (``DecodeWorkspace``): compacted indices int64 [M, K] (each split writes and reads its
slice); with S > 1 the partials out fp32 [S, M, H, 512] and lse fp32 [S, M, H] and the tickets
int32 [M, ceil(H / 16)] (zero at allocation, left zero by every launch). A caller that owns one
(and the outputs) runs the whole decode without allocating.

Index widths: a record index is int64 from the caller's list to the address. The engine's indices
are rows of a strided cache's ``row_view`` (``decode.paged_sparse_mla``), 16 (or 4) bytes apart, so a
layer view spanning more than 32 (8) GiB has rows past 2^31; the address ``records + index * row
stride`` is int64 as well. Row offsets into the index buffers (``m * stride``) are int64 too. Positions within
a row's top-k (the ``ks`` below, a compacted position, the count) stay int32: bounded by K.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sparkinfer.core.attention_workspace import HEAD_BLOCK
from sparkinfer.core.layouts import FP8_DS_MLA, LATENT_DIM, NVFP4_368, NVFP4_432, RecordLayout

from .triton_codes import NVFP4_SHIFT, bf16x2_split, e2m1x8_to_bf16, e4m3x4_to_bf16

_FMT_ID = {NVFP4_368.name: 0, NVFP4_432.name: 1, FP8_DS_MLA.name: 2}
PRECISIONS = ("bf16x2", "bf16")

# Launch configuration (tests/attention/test_attention_compile.py compiles every one for sm_120 and sm_90
# and checks ptxas: no spills, mma present, shared memory within each arch's per-block limit).
# 16 heads fill the M = 16 of an mma.sync tile; BLOCK_K keys per tile (32 or 64, by launch below)
# give the QK dot N = BLOCK_K and the PV dot K = BLOCK_K.
BLOCK_H = HEAD_BLOCK  # 16: the attention arena counts its partials in these programs
# The record loads are pipelined (Triton's software pipeliner, num_stages): the tile loop's global loads
# become cp.async copies into shared memory, an iteration waits once, at its top, and what it waits for
# was requested a whole iteration earlier, so the copies fly while the previous tile is decoded and
# multiplied. Loaded synchronously (num_stages = 1), each 128-column chunk's words were requested
# only after the previous chunk was decoded and stored (the barrier between them): the 368 kernel's
# 64-key tile waited for 7 DRAM round trips in sequence (the index, four chunks, the rope, the per-key
# scales; benchmarks/kernel_report.py's ``load_waits``) with one CTA an SM to cover them. Every record
# load is 4 bytes or more, the size cp.async copies (the NVFP4 group scales load as words:
# ``_nvfp4_chunk``). The stage count: Triton 3.9 gives each load of the chain index -> records -> dot
# (num_stages - 1) // 2 stages of lead, and a load as many shared-memory buffers as its lead.
# - 2: the next tile's indices loaded synchronously just before its records were requested, a second
#   round trip an iteration.
# - 3 (and 4): the records one tile ahead in one buffer, so the next tile's copies could be issued only
#   after this tile's last read of it, at the iteration's end, and were waited for a few instructions later
#   at the next top: a round trip an iteration, exposed.
# - 5: the records two tiles ahead in two buffers, the indices four ahead: the copies of tile i + 1 are
#   issued at the end of iteration i - 1 and waited for at the top of i + 1, a whole iteration later
#   (``load_waits``: covered). The cost is the second buffer (64 x 368 B on sm_90, 32 x 368 on sm_120:
#   TILE64_SHARED, WIDE_SHARED) and 1-6% more instructions a tile (the pipeline's indices and predicates).
# Every format: the 656 kernel, which loads its whole tile before it decodes any of it, waited for 2 round
# trips a tile unpipelined (3 with fp32 queries); at 3 stages its 255 registers spilled into the tile loop
# on sm_90, at 5 they do not (its 32-key tiles in 95 KB of shared memory).
NUM_STAGES = 5
# Warps, a ptxas register ceiling (.maxnreg; None: ptxas's choice) and keys per tile by (format, split
# queries).
# bf16 queries (the engine's): 4 warps. The QK dot's N is the tile's 32 keys, four mma.sync n-tiles
# of 8: with 8 warps, warps 4-7 repeated warps 0-3's QK (and its shared-memory loads), so 4 warps
# issue fewer instructions per tile in all (benchmarks/kernel_report.py: the 368 kernel on sm_90,
# 8 x 768 against 4 x 1,169 instructions per tile, with the first packed decoders); with them (``triton_codes``) they
# fit 255 registers without a spill (allowed 255: ptxas's own choice for the 656 kernel on sm_120,
# 168, spilled 16 B). fp32 queries (hi + lo: twice the query registers): 8 warps,
# the 432 kernel with a ceiling of 200 (ptxas's own 128 spilled on sm_120), the 656 one with 255: plain
# ``ptxas -v`` spills nothing from 224 up (255 spilled 8 B, 200 56 B on sm_120 with one split before the
# record loads went unmasked), and with Triton's own options (``benchmarks/kernel_report.py``) 255 spills
# the least of 224 / 232 / 240 / 248 / 255 (48 / 8 B one split, 68 / 12 B S > 1, sm_120 / sm_90, against
# 104 / 96 and 116 / 108 at 224; 16 warps: 8-20 B, and plain ptxas spilled on sm_90).
# Keys per tile: the online softmax's per-tile work (the accumulator rescale: 64 FMUL a thread at 4
# warps, the row max and sum) and the queries' shared-memory loads (each warp reads all 576 query
# columns per tile: 36 LDSM) are per tile, the decode, the MMAs and the PV tile's loads per key, so 64
# keys issue fewer instructions per key (the 368 kernel on sm_90: 1,519 per 64 keys against 868 per
# 32). NVFP4 with bf16 queries fits it without a spill (its latent in four 128-column chunks, each
# decoded, stored and multiplied before the next); the 656 kernel spilled 56 B at 64 keys on sm_90 and
# the 432 one with fp32 queries 16 B (ceiling 200): 32 keys.
LAUNCH = {(NVFP4_368.name, False): (4, 255, 64), (NVFP4_432.name, False): (4, 255, 64),
          (FP8_DS_MLA.name, False): (4, 255, 32), (NVFP4_368.name, True): (8, None, 32),
          (NVFP4_432.name, True): (8, 200, 32), (FP8_DS_MLA.name, True): (8, 255, 32)}
# Shared memory a block needs for the 64-key tiles pipelined (NUM_STAGES; Triton 3.9, 16 heads a program:
# 368 140,288 B, 432 142,336): where a block may not hold it (sm_120's 99 KB; sm_90 may) those launches
# take 32-key tiles (``block_k``: 368 80,384 B, 432 79,872), which issue ~25% more instructions a key.
TILE64_SHARED = 139 * 1024
# Listed indices a program scans at a time when it compacts its split (``_compact_split``), per 4 warps:
# 256 are 2 a thread at 4 warps, and a program of more warps scans as many a thread (``compact_block``):
# the scan's cumulative sum and the count's sum cost per trip about as much at 1 index a thread as at 2.
COMPACT_BLOCK = 256
MAX_SPLITS = 64  # splits of a row's keys (a ticket's count)
# fp32 accumulators of the fused merge's pass over the output columns (``_merge_partials``): 16 heads x 512
MERGE_ELEMS = 16 * LATENT_DIM
_MERGE_ELEMS, _LATENT = tl.constexpr(MERGE_ELEMS), tl.constexpr(LATENT_DIM)  # the same in @triton.jit code
# Heads a program over a paged cache's row view (the stock path, 64 heads a rank under DCP4) on 8
# warps, where a block may hold WIDE_SHARED bytes of shared memory (sm_90: 227 KB; sm_120's 99 KB may
# not): each of a row's head blocks gathers and decodes the same records, so 32 heads a program halve
# that work, on twice the warps (the MMAs and the accumulator per warp as at 16 heads). sm_90 SASS a
# 64-key tile over the 4-byte view: 8 x 1,183 for 32 heads against 2 programs x 4 x 1,663; over the
# 16-byte view (vLLM's) 8 x 1,063 against 2 x 4 x 1,381 (the 368 kernel, the only one measured; its
# queries of 32 heads and four decoded chunks take 108 KB of shared memory, 156 KB with the pipelined
# records' two buffers: WIDE_SHARED).
WIDE_H, WIDE_WARPS, WIDE_SHARED = 32, 8, 159_744
# A split covers at least this many listed keys (two 64-key tiles), so that a grid far below a wave
# (batch 1: 4 rows, 16 heads) takes more, shorter splits. The merging program's path is then the
# split's tiles plus the merge of all S partials: per warp on sm_90 (benchmarks/kernel_report.py's
# critical path, every loop at its trips) ~1,420 instructions a 64-key tile against ~160 a split
# merged (``_merge_partials``: 16 16-byte loads and 64 FMAs a thread), and at batch 1 (K = 2,048) the
# report's sweep of every split count of one wave (``by_splits``) is least at 16 on both archs:
# 2 tiles + 16 merged, 4.24 us on the H200 against 4.57 at 11 (3 tiles), 5.03 at 8 and 4.81 at 32 (1
# tile, 32 merged). Fewer keys a split would only lengthen the merge. The partials (16 heads x 513
# fp32 = 33 KB a split, read back from L2) exceed the records a split gathers (128 x 368 B = 47 KB
# when all are valid, a quarter on the stock DCP4 path).
MIN_KEYS_PER_SPLIT = 128


@triton.jit
def _words(row_ptr, BYTE0: tl.constexpr, N: tl.constexpr):
    """N little-endian uint32 words of each record from byte BYTE0 (records are 4-byte aligned) -> [BK, N].
    Indexed as words (not bytes, then cast), so that Triton sees them contiguous: 16-byte loads where
    the records are 16-byte aligned (``REC_ALIGN``). Unmasked: a tile's keys past its split's end repeat
    its last key (``_sparse_mla_decode_kernel``)."""
    w = tl.arange(0, N)
    return tl.load(row_ptr.to(tl.pointer_type(tl.uint32))[:, None] + BYTE0 // 4 + w[None, :])


@triton.jit
def _key_f32(row_ptr, BYTE0: tl.constexpr):
    """The fp32 at byte BYTE0 of each record (a per-key scale) -> [BK]; unmasked as ``_words``."""
    return tl.load((row_ptr + BYTE0).to(tl.pointer_type(tl.float32)))


@triton.jit
def _key_f32x2(row_ptr, BYTE0: tl.constexpr):
    """The two fp32 at bytes BYTE0, BYTE0 + 4 of each record -> two [BK]: one 8-byte load a key in the
    layout of the tile's other record loads (``_words``)."""
    lo, hi = tl.split(_words(row_ptr, BYTE0, 2))
    return lo.to(tl.float32, bitcast=True), hi.to(tl.float32, bitcast=True)


@triton.jit
def _join4(a, b, c, d):
    """[BK, n] x 4 -> [BK, 4n] with column 4w + j = the j-th argument's column w."""
    return tl.reshape(tl.join(tl.join(a, c), tl.join(b, d)), [a.shape[0], 4 * a.shape[1]])


@triton.jit
def _join8(a0, a1, a2, a3, a4, a5, a6, a7):
    """[BK, n] x 8 -> [BK, 8n] with column 8w + j = the j-th argument's column w."""
    even = tl.join(tl.join(a0, a4), tl.join(a2, a6))
    odd = tl.join(tl.join(a1, a5), tl.join(a3, a7))
    return tl.reshape(tl.join(even, odd), [a0.shape[0], 8 * a0.shape[1]])


# The tiles' column order. A packed decoder turns a word of PER_WORD codes into bf16 pairs (element j,
# element j + PER_WORD / 2), and a pair is one 32-bit register: the tiles keep each pair side by side
# (column PER_WORD w + 2j + h holds element PER_WORD w + j + h PER_WORD / 2), so no pair is split to
# store a tile. The queries are moved into this order (``_tile_order``) and the outputs out of it
# (``_in_order``), which leaves every product and sum as it was.


@triton.jit
def _in_order(x, PER_WORD: tl.constexpr):
    """A [BH, n] in the tiles' column order (above) in record-element order: column PER_WORD w + 2j + h is
    element PER_WORD w + j + h PER_WORD / 2, so per group of PER_WORD columns (j, h) becomes (h, j).
    Moved in registers and shared memory, so that the store is contiguous (16-byte stores where a
    permuted pointer took one store a value: the partials 64 4-byte stores a thread at 16 heads)."""
    g = tl.reshape(x, [x.shape[0], x.shape[1] // PER_WORD, PER_WORD // 2, 2])
    return tl.reshape(tl.permute(g, (0, 1, 3, 2)), [x.shape[0], x.shape[1]])


@triton.jit
def _tile_order(x, PER_WORD: tl.constexpr):
    """A [BH, n] in record-element order in the tiles' column order (above; ``_in_order``'s inverse): per
    group of PER_WORD columns (h, j) becomes (j, h). PER_WORD 1: as it is."""
    if PER_WORD > 1:
        g = tl.reshape(x, [x.shape[0], x.shape[1] // PER_WORD, 2, PER_WORD // 2])
        x = tl.reshape(tl.permute(g, (0, 1, 3, 2)), [x.shape[0], x.shape[1]])
    return x


@triton.jit
def _nvfp4_chunk(row_ptr, B: tl.constexpr, CW: tl.constexpr, ASM: tl.constexpr):
    """Latent columns [CW B, CW (B+1)) of NVFP4 records -> bf16 [BK, CW]: E2M1 value x E4M3 group scale
    / NVFP4_SHIFT (``e2m1x8_to_bf16``; the caller multiplies its per-key scale by NVFP4_SHIFT).

    Word w of the chunk holds its elements 8w..8w+7 (low nibble first), all in group CW B / 16 + w // 2,
    whose E4M3 scale is byte (w // 2) % 4 of the chunk's scale word w // 8: the scales load as words, once
    each (a byte load is below what cp.async copies: ``NUM_STAGES``), and each code word takes its
    byte in registers.
    """
    words = _words(row_ptr, CW // 2 * B, CW // 8)
    w = tl.arange(0, CW // 8)
    sw = _words(row_ptr, 256 + CW // 16 * B, CW // 64)
    sw = tl.reshape(tl.broadcast_to(sw[:, :, None], [sw.shape[0], CW // 64, 8]), [sw.shape[0], CW // 8])
    byte = ((w[None, :] // 2) % 4).to(tl.uint32)
    e0, e1, e2, e3, e4, e5, e6, e7 = e2m1x8_to_bf16(words, sw, byte, ASM)
    return _join8(e0, e4, e1, e5, e2, e6, e3, e7)  # the decoder's pairs side by side: ``_tile_order``


@triton.jit
def _e4m3_tile(row_ptr, BYTE0: tl.constexpr, N: tl.constexpr, ASM: tl.constexpr):
    """4N E4M3 bytes of each record from BYTE0 -> bf16 [BK, 4N] (exact)."""
    b0, b1, b2, b3 = e4m3x4_to_bf16(_words(row_ptr, BYTE0, N), ASM)
    return _join4(b0, b2, b1, b3)  # the decoder's pairs side by side: ``_tile_order``


@triton.jit
def _bf16_rope(row_ptr, BYTE0: tl.constexpr):
    """64 bf16 rope values of each record from BYTE0 -> bf16 [BK, 64]."""
    words = _words(row_ptr, BYTE0, 32)
    lo, hi = bf16x2_split(words)
    return tl.reshape(tl.join(lo, hi), [words.shape[0], 64])


@triton.jit
def _load_q(ptr, cols, hmask, SPLIT: tl.constexpr):
    """Query columns [BH, n] -> (hi, lo) bf16 with q = hi + lo when SPLIT (fp32 / fp16 queries); without
    SPLIT (bf16 queries, exact in hi) lo is hi and unused. Rows outside ``hmask`` are 0; hmask None: every
    row is loaded (no zeroing before a masked load)."""
    if hmask is None:
        q = tl.load(ptr + cols[None, :])
    else:
        q = tl.load(ptr + cols[None, :], mask=hmask[:, None], other=0.0)
    return _split_q(q, SPLIT)


@triton.jit
def _load_q_tiled(ptr, cols, PER_WORD: tl.constexpr, SPLIT: tl.constexpr):
    """``_load_q`` of the contiguous columns ``cols`` of every row, in the tiles' order (``_tile_order``):
    the loads contiguous (16 bytes where the queries' pointer and strides are), the move in registers
    and shared memory, where a permuted pointer took one 2-byte load a value."""
    return _split_q(_tile_order(tl.load(ptr + cols[None, :]), PER_WORD), SPLIT)


@triton.jit
def _split_q(q, SPLIT: tl.constexpr):
    """(hi, lo) bf16 of queries q (``_load_q``)."""
    q = q.to(tl.float32)
    hi = q.to(tl.bfloat16)
    if SPLIT:
        lo = (q - hi.to(tl.float32)).to(tl.bfloat16)
    else:
        lo = hi
    return hi, lo


@triton.jit
def _dot(a, b, acc, F32_DOT: tl.constexpr):
    """acc + a @ b on bf16 operands, fp32 accumulation.

    F32_DOT (set under TRITON_INTERPRET=1 only): Triton 3.9's interpreter multiplies bf16 operands
    as their raw uint16 bit patterns, so there the exact bf16 values are widened to fp32 first
    (the same products: a bf16 x bf16 product is exact in fp32, as on the tensor cores).
    """
    if F32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


@triton.jit
def _qk(q_hi, q_lo, tile, acc, SPLIT: tl.constexpr, F32_DOT: tl.constexpr):
    """acc + q . tile^T with q = hi (+ lo): [BH, n] x [BK, n] -> fp32 [BH, BK]."""
    t = tl.trans(tile)
    acc = _dot(q_hi, t, acc, F32_DOT)
    if SPLIT:
        acc = _dot(q_lo, t, acc, F32_DOT)
    return acc


@triton.jit
def _pv(p, tile, acc, SPLIT: tl.constexpr, F32_DOT: tl.constexpr):
    """acc + p @ tile with fp32 p [BH, BK] rounded to bf16 (SPLIT: hi + lo, two dots)."""
    hi = p.to(tl.bfloat16)
    acc = _dot(hi, tile, acc, F32_DOT)
    if SPLIT:
        acc = _dot((p - hi.to(tl.float32)).to(tl.bfloat16), tile, acc, F32_DOT)
    return acc


@triton.jit
def _start(BM: tl.constexpr, CW: tl.constexpr):
    """The online softmax's initial state for BM rows: (m = -inf, l = 0, four fp32 [BM, CW] accumulators)."""
    acc = tl.zeros([BM, CW], tl.float32)
    return tl.full([BM], float("-inf"), tl.float32), tl.zeros([BM], tl.float32), acc, acc, acc, acc


@triton.jit
def _split_range(count, num_splits, split, BLOCK_K: tl.constexpr):
    """Keys [lo, hi) of split ``split`` of ``num_splits`` over ``count`` keys: equal slices of whole
    BLOCK_K tiles, so the trip count is count-driven and no tile straddles two splits."""
    per_split = tl.cdiv(tl.cdiv(count, num_splits), BLOCK_K) * BLOCK_K
    lo = split * per_split
    return lo, tl.minimum(lo + per_split, count)


@triton.jit
def _count_valid(row_ptr, s_k, c_lo, c_hi, BLOCK_C: tl.constexpr):
    """Valid indices (>= 0) among the listed ones [c_lo, c_hi)."""
    count = tl.zeros([], tl.int32)
    for c0 in range(c_lo, c_hi, BLOCK_C):
        ks = c0 + tl.arange(0, BLOCK_C)
        count += tl.sum((tl.load(row_ptr + ks * s_k, mask=ks < c_hi, other=-1) >= 0).to(tl.int32), axis=0)
    return count


@triton.jit
def _compact_split(row_ptr, s_k, K, crow_ptr, num_splits, split, prefix_count, BLOCK_K: tl.constexpr,
                   BLOCK_C: tl.constexpr):
    """This split's keys [lo, hi) of the row's valid indices, compacted: the row's K listed indices
    (int32/int64 at ``row_ptr``, stride ``s_k``; -1 = skip) are counted, and those whose position in
    the compacted order falls in the split's slice (``_split_range`` of the count) are stored, int64, at
    that position of the workspace row ``crow_ptr``. A valid index's compacted position is at most its
    listed one and at least that less the K - count invalid ones, so the slice comes from the listed
    [lo, hi + K - count): the scan that places them (a cumulative sum a block) starts at lo's block,
    after a count of the valid ones before it, and stops there. When all K are valid (the selected
    path's rows) the slice is the listed [lo, hi) itself: a copy instead (the scan's cumulative sum took
    113 sm_90 instructions a warp and block of 256, the copy ~20), and neither the scan nor that count runs;
    so too where the caller says its valid indices come first: a row with at least ``prefix_count`` valid
    ones lists them first, K (all valid) or 0 (the paged path's rows, ``triton_paging.topk_rows(compact=True)``;
    the caller's word, since finding it out in the count cost the selected path's rows ~15 instructions a
    warp, and one compare, as ``count == K`` was, where a flag took two).
    Every program of the row reads the list (from L2 after the first program) and writes only its
    slice (the head blocks of a split write the same values), then a barrier makes the slice visible
    to all of its threads.

    Positions are bounded by K: int32; the stored indices keep their width up to int64."""
    # the counts take 4 blocks a trip: a trip's sum over the block (a reduction, a barrier) is a fixed cost
    count = _count_valid(row_ptr, s_k, 0, K, 4 * BLOCK_C)
    lo, hi = _split_range(count, num_splits, split, BLOCK_K)
    all_valid = count >= prefix_count
    # the valid indices are the first count listed (all valid: the selected path's rows; compacted: the
    # paged path's): the slice is the listed [lo, hi), copied
    for c0 in range(lo, tl.where(all_valid, hi, lo), 4 * BLOCK_C):
        ks = c0 + tl.arange(0, 4 * BLOCK_C)
        tl.store(crow_ptr + ks, tl.load(row_ptr + ks * s_k, mask=ks < hi).to(tl.int64), mask=ks < hi)
    # else placed by a scan (a cumulative sum a block) from c_lo, after a count of the valid ones before it
    c_lo = tl.minimum(lo, count) // BLOCK_C * BLOCK_C  # an empty split (lo >= count) scans nothing
    pre = tl.where(all_valid, 0, c_lo)
    base = _count_valid(row_ptr, s_k, 0, pre, 4 * BLOCK_C) + (c_lo - pre)
    for c0 in range(c_lo, tl.where((lo < hi) & ~all_valid, tl.minimum(K, hi + K - count), c_lo), BLOCK_C):
        ks = c0 + tl.arange(0, BLOCK_C)
        idx = tl.load(row_ptr + ks * s_k, mask=ks < K, other=-1)
        flag = (idx >= 0).to(tl.int32)
        pos = base + tl.cumsum(flag, axis=0) - 1
        tl.store(crow_ptr + pos, idx.to(tl.int64), mask=(flag != 0) & (pos >= lo) & (pos < hi))
        base += tl.sum(flag, axis=0)
    tl.debug_barrier()
    return lo, hi


@triton.jit
def _softmax_pv(s, m_i, l_i, acc0, acc1, acc2, acc3, t0, t1, t2, t3, a0, a1, a2, a3,
                FOUR: tl.constexpr, P_SPLIT: tl.constexpr, F32_DOT: tl.constexpr):
    """One online-softmax step over base-2 scores s [BH, BK] (-inf: not a key of that row) and the PV
    update of the accumulators -> (m', l', acc0..acc3): chunk c is t_c with its per-key scale a_c (NVFP4:
    a0 for all); FOUR: four chunks, else two (t2, t3, acc2, acc3 unused)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # A finite anchor keeps rows that have seen no valid key at exactly 0 (no -inf - -inf).
    anchor = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - anchor)
    p = tl.exp2(s - anchor[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc0 = _pv(p * a0[None, :], t0, acc0 * alpha[:, None], P_SPLIT, F32_DOT)
    acc1 = _pv(p * a1[None, :], t1, acc1 * alpha[:, None], P_SPLIT, F32_DOT)
    if FOUR:
        acc2 = _pv(p * a2[None, :], t2, acc2 * alpha[:, None], P_SPLIT, F32_DOT)
        acc3 = _pv(p * a3[None, :], t3, acc3 * alpha[:, None], P_SPLIT, F32_DOT)
    return m_new, l_i, acc0, acc1, acc2, acc3


@triton.jit
def _finish(m_i, l_i):
    """(1 / l, natural-log LSE) of the online softmax; rows without a key: (1, -inf)."""
    seen = l_i > 0
    inv_l = 1.0 / tl.where(seen, l_i, 1.0)
    return inv_l, tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))


# fp32 pairs -> bf16 pairs rounded to nearest even (one cvt a pair), a NaN as 0x7FC0 (torch's): the cvt
# gives the canonical 0x7FFF, the only bf16 it writes above 0x7FC0 as a signed 16-bit integer (a finite
# value or an infinity is at most 0x7F80, negative ones are negative), so a signed min of each half
# with 0x7FC0 sets it and leaves every other value: ``_bf16_bits`` on a GPU
_BF16X2_PTX = tl.constexpr("""{
    .reg .b32 n;
    cvt.rn.bf16x2.f32 $0, $2, $1;
    mov.b32 n, 0x7FC07FC0;
    min.s16x2 $0, $0, n;
    }""")


@triton.jit
def _bf16_bits(x, ASM: tl.constexpr):
    """fp32 ``x`` rounded to bf16 (nearest, ties to even; NaN to the canonical 0x7FC0) as int16 bits,
    the same on a GPU (ASM: ``cvt.rn.bf16x2``, two values an instruction) and in the interpreter (whose
    fp32 -> bf16 cast truncates: on the bits, ~6 integer instructions a value)."""
    if ASM:
        return tl.inline_asm_elementwise(_BF16X2_PTX, "=r,r,r", [x], dtype=tl.int16, is_pure=True, pack=2)
    b = x.to(tl.uint32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    r = tl.where(x != x, 0x7FC0, r)
    return r.to(tl.uint16).to(tl.int16, bitcast=True)


# ``prefix_count`` not specialized: Triton would compile a value of 1 as a constant (and 0 as a multiple
# of 16), variants the compile specs (and the kernel report's counts) do not hold
@triton.jit(do_not_specialize=["prefix_count"])
def _sparse_mla_decode_kernel(
    qn_ptr, qr_ptr, rec_ptr, idx_ptr, cidx_ptr, out_ptr, lse_ptr, po_ptr, pl_ptr, tk_ptr,
    H, K, num_splits, prefix_count, rec_stride, qk_scale, outer_scale,
    s_qn_m, s_qn_h, s_qr_m, s_qr_h, s_idx_m, s_idx_k, s_cidx_m,
    s_out_m, s_out_h, s_lse_m, s_po_s, s_po_m, s_po_h, s_pl_s, s_pl_m,
    FMT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr,
    Q_SPLIT: tl.constexpr, P_SPLIT: tl.constexpr, F32_DOT: tl.constexpr, OUT_BF16: tl.constexpr,
    MERGE: tl.constexpr, ASM: tl.constexpr, REC_ALIGN: tl.constexpr,
):
    m = tl.program_id(0).to(tl.int64)  # every row offset below in int64 (module docstring)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    r = tl.arange(0, 64)
    NVFP4: tl.constexpr = FMT != 2
    # Latent chunks: 656 4 x 128 columns (one tile scale each); NVFP4 (one E4M3 group scale per 16
    # columns) 4 x 128 at 64 keys a tile (two decoded [64, 256] chunks live at once spilled), else 2 x 256
    # (four chunks spilled the 432 kernel over 4-byte aligned records on sm_120, 36 B).
    CW: tl.constexpr = 128 if FMT == 2 or BLOCK_K == 64 else 256
    FOUR: tl.constexpr = CW == 128
    cw = tl.arange(0, CW)
    # the tiles' column order (``_tile_order``): NVFP4 8 codes a word, E4M3 4; the bf16 rope is in order
    PW: tl.constexpr = 8 if NVFP4 else 4
    RPW: tl.constexpr = 4 if FMT == 0 else 1
    # the split's keys first: the compaction's scans run before the queries take their registers
    k_lo, k_hi = _compact_split(idx_ptr + m * s_idx_m, s_idx_k, K, cidx_ptr + m * s_cidx_m, num_splits, split,
                                prefix_count, BLOCK_K, BLOCK_C)
    # heads past H compute with head H - 1's queries (every load unmasked); their rows are not stored
    q_heads = tl.minimum(heads, H - 1)[:, None]
    qn_row = qn_ptr + m * s_qn_m + q_heads * s_qn_h
    q0h, q0l = _load_q_tiled(qn_row, cw, PW, Q_SPLIT)
    q1h, q1l = _load_q_tiled(qn_row + CW, cw, PW, Q_SPLIT)
    if FOUR:
        q2h, q2l = _load_q_tiled(qn_row + 2 * CW, cw, PW, Q_SPLIT)
        q3h, q3l = _load_q_tiled(qn_row + 3 * CW, cw, PW, Q_SPLIT)
    qrh, qrl = _load_q_tiled(qr_ptr + m * s_qr_m + q_heads * s_qr_h, r, RPW, Q_SPLIT)

    m_i, l_i, acc0, acc1, acc2, acc3 = _start(BLOCK_H, CW)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        valid = ks < k_hi
        # int64 (the workspace's). A tile's keys past the split's end repeat its last key (k_lo <= k_hi - 1
        # here), a record the encoders wrote: every record load goes unmasked (no zeroing, no predicate)
        # and decodes to finite values, and those keys' scores are -inf (below), so they weigh 0.
        idx = tl.load(cidx_ptr + m * s_cidx_m + tl.minimum(ks, k_hi - 1))
        # int64: idx * stride passes 2^31 (module docstring); aligned to REC_ALIGN bytes (the wrapper's word)
        row_ptr = tl.multiple_of(rec_ptr + idx * rec_stride, REC_ALIGN)
        zero_s = tl.zeros([BLOCK_H, BLOCK_K], tl.float32)
        if NVFP4:
            t0 = _nvfp4_chunk(row_ptr, 0, CW, ASM)
            if FOUR:  # each chunk decoded, stored and multiplied before the next is decoded (registers)
                s_lat = _qk(q0h, q0l, t0, zero_s, Q_SPLIT, F32_DOT)
                t1 = _nvfp4_chunk(row_ptr, 1, CW, ASM)
                s_lat = _qk(q1h, q1l, t1, s_lat, Q_SPLIT, F32_DOT)
                t2 = _nvfp4_chunk(row_ptr, 2, CW, ASM)
                s_lat = _qk(q2h, q2l, t2, s_lat, Q_SPLIT, F32_DOT)
                t3 = _nvfp4_chunk(row_ptr, 3, CW, ASM)
                s_lat = _qk(q3h, q3l, t3, s_lat, Q_SPLIT, F32_DOT)
            else:  # two, decoded before the QK (interleaved, the 368 kernel spilled 20 B over 4-byte records on sm_120)
                t1 = _nvfp4_chunk(row_ptr, 1, CW, ASM)
                t2, t3 = t0, t1  # unused
                s_lat = _qk(q1h, q1l, t1, _qk(q0h, q0l, t0, zero_s, Q_SPLIT, F32_DOT), Q_SPLIT, F32_DOT)
            if FMT == 0:
                b, a0 = _key_f32x2(row_ptr, 288)  # rope scale r, per-token outer scale s_t
                a0 = a0 * NVFP4_SHIFT  # (tiles: / NVFP4_SHIFT)
                s = a0[None, :] * s_lat + b[None, :] * _qk(qrh, qrl, _e4m3_tile(row_ptr, 304, 16, ASM), zero_s,
                                                           Q_SPLIT, F32_DOT)
            else:
                a0 = tl.full([BLOCK_K], NVFP4_SHIFT, tl.float32) * outer_scale
                s = a0[None, :] * s_lat + _qk(qrh, qrl, _bf16_rope(row_ptr, 304), zero_s, Q_SPLIT, F32_DOT)
            a1, a2, a3 = a0, a0, a0  # one per-key scale for every chunk
        else:
            t0, a0 = _e4m3_tile(row_ptr, 0, 32, ASM), _key_f32(row_ptr, 512)
            t1, a1 = _e4m3_tile(row_ptr, 128, 32, ASM), _key_f32(row_ptr, 516)
            t2, a2 = _e4m3_tile(row_ptr, 256, 32, ASM), _key_f32(row_ptr, 520)
            t3, a3 = _e4m3_tile(row_ptr, 384, 32, ASM), _key_f32(row_ptr, 524)
            s = _qk(qrh, qrl, _bf16_rope(row_ptr, 528), zero_s, Q_SPLIT, F32_DOT)
            s += a0[None, :] * _qk(q0h, q0l, t0, zero_s, Q_SPLIT, F32_DOT)
            s += a1[None, :] * _qk(q1h, q1l, t1, zero_s, Q_SPLIT, F32_DOT)
            s += a2[None, :] * _qk(q2h, q2l, t2, zero_s, Q_SPLIT, F32_DOT)
            s += a3[None, :] * _qk(q3h, q3l, t3, zero_s, Q_SPLIT, F32_DOT)
        # Base-2 scores: qk_scale = scale * log2(e).
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_i, l_i, acc0, acc1, acc2, acc3 = _softmax_pv(s, m_i, l_i, acc0, acc1, acc2, acc3, t0, t1, t2, t3,
                                                       a0, a1, a2, a3, FOUR, P_SPLIT, F32_DOT)

    inv_l, lse = _finish(m_i, l_i)
    # The partials and the one split's output are stored unmasked: a head past H computed head H - 1's
    # values (its queries, bit for bit) and stores them into head H - 1's row (the same bits twice; the
    # per-row masks took ~90 sm_90 instructions a warp). The merge's output stays masked (unmasked, ptxas
    # scheduled the 368 tile loop 6 instructions longer).
    last = tl.minimum(heads, H - 1)
    if not MERGE:  # one split (a constexpr: each variant compiles only its epilogue)
        o_row = out_ptr + m * s_out_m + last[:, None] * s_out_h
        _store_out(o_row + cw[None, :], _in_order(acc0 * inv_l[:, None], PW), None, OUT_BF16, ASM)
        _store_out(o_row + CW + cw[None, :], _in_order(acc1 * inv_l[:, None], PW), None, OUT_BF16, ASM)
        if FOUR:
            _store_out(o_row + 2 * CW + cw[None, :], _in_order(acc2 * inv_l[:, None], PW), None, OUT_BF16, ASM)
            _store_out(o_row + 3 * CW + cw[None, :], _in_order(acc3 * inv_l[:, None], PW), None, OUT_BF16, ASM)
        tl.store(lse_ptr + m * s_lse_m + last, lse)
    else:
        # the partials' and the merge's heads from the head block read again, after the loop (``_program_id_1_again``)
        heads = _program_id_1_again(hb, ASM) * BLOCK_H + tl.arange(0, BLOCK_H)
        last = tl.minimum(heads, H - 1)
        p_row = po_ptr + split * s_po_s + m * s_po_m + last[:, None] * s_po_h
        tl.store(p_row + cw[None, :], _in_order(acc0 * inv_l[:, None], PW))
        tl.store(p_row + CW + cw[None, :], _in_order(acc1 * inv_l[:, None], PW))
        if FOUR:
            tl.store(p_row + 2 * CW + cw[None, :], _in_order(acc2 * inv_l[:, None], PW))
            tl.store(p_row + 3 * CW + cw[None, :], _in_order(acc3 * inv_l[:, None], PW))
        tl.store(pl_ptr + split * s_pl_s + m * s_pl_m + last, lse)
        # Every thread's partial is written (barrier) before the ticket is taken (acq_rel, gpu scope);
        # the S programs of a (row, head block) share its ticket and the last one merges.
        tl.debug_barrier()
        tk = tk_ptr + m * tl.num_programs(1) + hb
        # the last ticket as ticket + 1 == S: num_splits - 1, which the split's range computes before the loop,
        # was kept across it (spilled)
        if tl.atomic_add(tk, 1, sem="acq_rel") + 1 == num_splits:
            tl.store(tk, 0)  # the next launch (a CUDA-graph replay) starts from 0 again
            # S > 1 here (MERGE), so the merge's loops over the splits all run: told so, ptxas drops the
            # paths past them for S = 0, with their own zeroed accumulators (sm_90: 40 instructions a warp)
            tl.assume(num_splits > 1)
            _merge_partials(po_ptr + m * s_po_m + last * s_po_h, pl_ptr + m * s_pl_m + last,
                            out_ptr + m * s_out_m + heads * s_out_h, lse_ptr + m * s_lse_m + heads, heads < H,
                            num_splits, s_po_s, s_pl_s, BLOCK_H, OUT_BF16, ASM)


@triton.jit
def _program_id_1_again(hb, ASM: tl.constexpr):
    """``tl.program_id(1)`` (``hb``) read again from %ctaid.y, on a GPU (ASM) as a volatile inline PTX read
    that the compiler cannot equate with the first: values derived from it after the tile loop are
    computed there, where the same values derived from ``hb`` before the loop were kept across it
    (255 registers: spilled, ``benchmarks/kernel_report.py``'s ptxas options). ``hb`` only gives the
    result its shape."""
    if ASM:
        return tl.inline_asm_elementwise("mov.u32 $0, %ctaid.y;", "=r,r", [hb], dtype=tl.int32, is_pure=False,
                                         pack=1)
    return hb


@triton.jit
def _store_out(ptr, x, mask, OUT_BF16: tl.constexpr, ASM: tl.constexpr):
    if OUT_BF16:  # rounded to nearest even (``_bf16_bits``: the interpreter's cast truncates)
        tl.store(ptr.to(tl.pointer_type(tl.int16)), _bf16_bits(x, ASM), mask=mask)
    else:
        tl.store(ptr, x, mask=mask)


@triton.jit
def _split_weight(lse_ptrs, anchor, inv):
    """A split's merge weights e^(lse_s - anchor) / total of BLOCK (row, head) pairs, [BLOCK, 1] (the
    partials' layout: ``_merge_partials``)."""
    return tl.exp(tl.load(lse_ptrs[:, None], cache_modifier=".cg") - anchor[:, None]) * inv[:, None]


@triton.jit
def _merge_cols(acc, w, ptrs):
    """acc + w x a split's partials at ``ptrs`` [BLOCK, 128] (rows of 128 contiguous fp32, 16-byte aligned;
    read from L2 with .cg)."""
    return acc + w * tl.load(ptrs, cache_modifier=".cg")


@triton.jit
def _merge_partials(po_rows, pl_rows, out_rows, lse_rows, mask, S, s_po_s, s_pl_s, BLOCK: tl.constexpr,
                    OUT_BF16: tl.constexpr, ASM: tl.constexpr):
    """merge_lse of the S partials of BLOCK (row, head) pairs: lse = ln sum_s e^lse_s, out = sum_s
    e^(lse_s - lse) out_s; no partial seen: out 0, lse -inf. po_rows, pl_rows, out_rows, lse_rows: [BLOCK]
    pointers to split 0's partial row (512 contiguous fp32, 16-byte aligned: a workspace's), its LSE, the
    output row (512 contiguous) and the LSE; split s is s_po_s / s_pl_s elements on (s_po_s a multiple
    of 512). ``mask``: the pairs to write. The partials and LSEs are read unmasked (a masked load
    zeroes its registers first: 32 instructions a split at 16 heads), so the caller points a masked-off
    pair at a partial it may read (clamped to the last pair): its lanes compute from that one, alone,
    and are not stored. Partials are read with .cg (from L2: other SMs wrote them), 16 bytes at a time; each split's
    weight is loaded in the partial's 2-D layout ([BLOCK, 1]), so the loop over the splits moves no
    data between layouts. Where BLOCK x 512 accumulators fit MERGE_ELEMS (16 heads: 64 fp32 a thread at 4
    warps) one loop over the splits updates all 512 columns (four [BLOCK, 128] accumulators: one
    [16, 512] lost the 16-byte loads), so a split's weight is computed once; else (the union kernel's
    64 rows) 128 columns a pass, the loop over the splits in each (``merge_chunks``). At 16 heads four
    passes took 216 of the merging program's ~300 sm_90 instructions a split (``benchmarks/
    kernel_report.py``'s critical path). Each output value sums its splits in order either way.""" 
    mx = tl.full([BLOCK], float("-inf"), tl.float32)
    pl_s = pl_rows
    for s in range(0, S):
        mx = tl.maximum(mx, tl.load(pl_s, cache_modifier=".cg"))
        pl_s += s_pl_s
    anchor = tl.where(mx == float("-inf"), 0.0, mx)
    total = tl.zeros([BLOCK], tl.float32)
    pl_s = pl_rows
    for s in range(0, S):
        total += tl.exp(tl.load(pl_s, cache_modifier=".cg") - anchor)
        pl_s += s_pl_s
    seen = total > 0
    inv = 1.0 / tl.where(seen, total, 1.0)
    d = tl.arange(0, 128)
    if BLOCK * _LATENT <= _MERGE_ELEMS:  # every column in one pass over the splits: four accumulators
        a0 = tl.zeros([BLOCK, 128], tl.float32)
        a1, a2, a3 = a0, a0, a0
        o_po, pl_s = s_po_s * 0, pl_rows  # split s's offset and LSE pointers, stepped
        # split 0's [BLOCK, 128] pointers, outside the loop: a split's are these + o_po, one 64-bit address a
        # row (the columns added to split s's row pointers in the loop took 4 more instructions a split)
        cols = po_rows[:, None] + d[None, :]
        for s in range(0, S):
            w = _split_weight(pl_s, anchor, inv)
            split_cols = cols + o_po
            a0 = _merge_cols(a0, w, split_cols)
            a1 = _merge_cols(a1, w, split_cols + 128)
            a2 = _merge_cols(a2, w, split_cols + 256)
            a3 = _merge_cols(a3, w, split_cols + 384)
            o_po += s_po_s
            pl_s += s_pl_s
        _store_out(out_rows[:, None] + d[None, :], a0, mask[:, None], OUT_BF16, ASM)
        _store_out(out_rows[:, None] + 128 + d[None, :], a1, mask[:, None], OUT_BF16, ASM)
        _store_out(out_rows[:, None] + 256 + d[None, :], a2, mask[:, None], OUT_BF16, ASM)
        _store_out(out_rows[:, None] + 384 + d[None, :], a3, mask[:, None], OUT_BF16, ASM)
    else:
        for c in range(0, 4):  # 128 output columns at a time (a loop, not unrolled: the code once)
            acc = tl.zeros([BLOCK, 128], tl.float32)
            for s in range(0, S):
                w = _split_weight(pl_rows + s * s_pl_s, anchor, inv)
                acc = _merge_cols(acc, w, tl.multiple_of(po_rows + s * s_po_s + 128 * c, 16)[:, None] + d[None, :])
            _store_out(out_rows[:, None] + 128 * c + d[None, :], acc, mask[:, None], OUT_BF16, ASM)
    tl.store(lse_rows, tl.where(seen, anchor + tl.log(tl.where(seen, total, 1.0)), float("-inf")), mask=mask)


def merge_chunks(block: int) -> int:
    """Passes of ``_merge_partials`` over the output's columns for BLOCK (row, head) pairs a program."""
    return 1 if block * LATENT_DIM <= MERGE_ELEMS else 4


_DEVICE: dict[int, tuple[int, int]] = {}


def _device_limits(device: torch.device) -> tuple[int, int]:
    """(multiprocessors, shared memory a block may opt in to, bytes) of a CUDA device, queried once per
    device index (a torch without the second property: 0, the 16-head programs)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _DEVICE:
        props = torch.cuda.get_device_properties(index)
        _DEVICE[index] = (props.multi_processor_count, getattr(props, "shared_memory_per_block_optin", 0))
    return _DEVICE[index]


def _sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (``_device_limits``)."""
    return _device_limits(device)[0]


def heads_per_program(lay: RecordLayout, q_dtype: torch.dtype, h: int, programs: int, sms: int,
                      shared_optin: int) -> int:
    """WIDE_H for the 368 kernel with bf16 queries of more than BLOCK_H heads (the stock path: its paged
    row view, 16- or 4-byte aligned, ``record_alignment``), when its ``programs`` of BLOCK_H heads (rows x
    head blocks x splits) are more than the ``sms`` hold in one wave, on a device whose blocks may hold
    WIDE_SHARED bytes of shared memory; else BLOCK_H. Within one wave a 16-head program has an SM to
    itself and 4 warps issue a tile in 1,381 instructions a scheduler against 2 x 1,063 for the 8 warps
    of a 32-head one (sm_90, 16-byte rows; 1,663 against 2 x 1,183 over 4-byte rows), which only wins
    where it takes the place of two 16-head programs on one SM. The split count stays that of 16-head
    programs (``num_splits_for``: the attention arena's partials are counted so)."""
    wide = lay.name == NVFP4_368.name and q_dtype == torch.bfloat16 and h > BLOCK_H
    return WIDE_H if wide and programs > sms and shared_optin >= WIDE_SHARED else BLOCK_H


def num_splits_for(m: int, h: int, k: int, sms: int) -> int:
    """Splits of each row's keys: as many as one wave holds (M x head blocks x S programs <= the SMs,
    one program per SM: the kernel's shared memory allows one on sm_120), each split covering at least
    MIN_KEYS_PER_SPLIT of the K listed keys, at most MAX_SPLITS. One wave rather than the next
    multiple: at 64 rows on 188 SMs, 3 splits were 192 programs, a second wave of 4 after the first
    (2 x 1/3 of a row's keys in time, where 2 splits take 1/2)."""
    want = sms // max(1, m * triton.cdiv(h, BLOCK_H))
    return max(1, min(want, k // MIN_KEYS_PER_SPLIT, MAX_SPLITS))


def default_num_splits(m: int, h: int, k: int, device: torch.device) -> int:
    """``num_splits_for`` on this device's SM count (1 off-GPU: the interpreter is serial)."""
    if device.type != "cuda":
        return 1
    return num_splits_for(m, h, k, _sm_count(device))


@dataclass
class DecodeWorkspace:
    """Device buffers of one decode shape (M rows, H heads, K indices per row, S splits).

    indices int64 [M, K] (each split's slice of the compacted indices, written and read by the
    kernel; record indices pass 2^31: the module docstring); with S > 1 (None otherwise: the kernel
    writes the outputs directly) partial_out fp32 [S, M, H, 512], partial_lse fp32 [S, M, H] and
    tickets int32 [M, ceil(H / BLOCK_H)], zero when allocated and left zero by every launch (the
    merging program resets its ticket), so a workspace serves any number of calls and CUDA-graph
    replays.
    """

    indices: torch.Tensor
    partial_out: torch.Tensor | None = None
    partial_lse: torch.Tensor | None = None
    tickets: torch.Tensor | None = None

    @classmethod
    def allocate(cls, m: int, h: int, k: int, num_splits: int, device) -> "DecodeWorkspace":
        if not 1 <= num_splits <= MAX_SPLITS:
            raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
        indices = torch.empty((m, k), dtype=torch.int64, device=device)
        if num_splits == 1:
            return cls(indices)
        f32 = dict(dtype=torch.float32, device=device)
        return cls(indices, torch.empty((num_splits, m, h, LATENT_DIM), **f32), torch.empty((num_splits, m, h), **f32),
                   torch.zeros((m, triton.cdiv(h, BLOCK_H)), dtype=torch.int32, device=device))

    @property
    def num_splits(self) -> int:
        return 1 if self.partial_out is None else self.partial_out.shape[0]

    def check(self, m: int, h: int, k: int, device) -> None:
        """Raise ValueError unless these buffers serve M rows, H heads and K indices on ``device``."""
        want = {"indices": ((m, k), torch.int64)}
        if self.partial_out is not None:
            s = self.partial_out.shape[0]
            if not 1 <= s <= MAX_SPLITS:
                raise ValueError(f"workspace has {s} splits; at most {MAX_SPLITS}")
            want.update(partial_out=((s, m, h, LATENT_DIM), torch.float32),
                        partial_lse=((s, m, h), torch.float32), tickets=((m, triton.cdiv(h, BLOCK_H)), torch.int32))
        for name, (shape, dtype) in want.items():
            t = getattr(self, name)
            if t is None or tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous() \
                    or t.device != device:
                got = None if t is None else (tuple(t.shape), t.dtype, str(t.device))
                raise ValueError(f"workspace.{name} must be a contiguous {dtype} {shape} tensor on {device}, "
                                 f"got {got}; build it with DecodeWorkspace.allocate(M, H, K, S, device)")


def _check_output(name: str, t, shape, device, dtypes=(torch.float32,)) -> torch.Tensor:
    if tuple(t.shape) != shape or t.dtype not in dtypes or t.device != device or t.stride(-1) != 1:
        kinds = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} must be {kinds} {shape} on {device} with a contiguous last dim, got "
                         f"{t.dtype} {tuple(t.shape)} on {t.device}")
    return t


def sparse_mla_decode_triton(q_nope, q_rope, records, lay: RecordLayout, indices, scale, *,
                             outer_scale: float = 1.0, num_splits: int | None = None,
                             dot_precision: str = "bf16x2", out=None, lse=None,
                             workspace: DecodeWorkspace | None = None, block_h: int | None = None,
                             keys: int | None = None, compacted: bool = False):
    """Launch the kernels on already-validated inputs; see ``sparse_mla_decode`` for the contract.

    outer_scale is the per-cache constant S of the 432 format (ignored by the others). out
    (float32 or bfloat16 [M, H, 512]: a bf16 model's attention needs no cast after it, the kernel
    rounds the output), lse (float32 [M, H]) and workspace (whose S wins over num_splits) are
    optional preallocated buffers. block_h: heads a program (BLOCK_H or WIDE_H; default
    ``heads_per_program`` on this device, BLOCK_H off-GPU: the tests set WIDE_H to run it interpreted).
    keys: keys a tile (32 or 64; default ``block_k`` on this device, the table's off-GPU: the tests set
    32 to run sm_120's tiles interpreted). compacted: each row's valid indices are its first ones, in
    order (``triton_paging.topk_rows(compact=True)``; the kernel then copies its split's slice instead of
    compacting the row: ``_compact_split``); a promise the kernel does not check (a -1 among them would
    be read as a record).
    """
    m, h = q_nope.shape[:2]
    k = indices.shape[1]
    dev = q_nope.device
    out = torch.empty((m, h, LATENT_DIM), dtype=torch.float32, device=dev) if out is None \
        else _check_output("out", out, (m, h, LATENT_DIM), dev, (torch.float32, torch.bfloat16))
    if workspace is None:
        workspace = DecodeWorkspace.allocate(m, h, k, num_splits or default_num_splits(m, h, k, dev), dev)
    else:
        workspace.check(m, h, k, dev)
    splits = workspace.num_splits
    lse = torch.empty((m, h), dtype=torch.float32, device=dev) if lse is None \
        else _check_output("lse", lse, (m, h), dev)
    if m == 0 or h == 0:
        return out, lse
    q_nope = q_nope if q_nope.stride(-1) == 1 else q_nope.contiguous()
    q_rope = q_rope if q_rope.stride(-1) == 1 else q_rope.contiguous()
    # one split: the partial buffers and tickets are not touched (the outputs stand in, strides 0)
    po, pl, tk = (workspace.partial_out, workspace.partial_lse, workspace.tickets) if splits > 1 \
        else (out, lse, lse)
    cidx = workspace.indices
    align = record_alignment(records)
    if block_h is None:
        block_h = BLOCK_H if dev.type != "cuda" else heads_per_program(
            lay, q_nope.dtype, h, m * triton.cdiv(h, BLOCK_H) * splits, *_device_limits(dev))
    if block_h not in (BLOCK_H, WIDE_H):
        raise ValueError(f"block_h must be {BLOCK_H} or {WIDE_H}, got {block_h}")
    if keys is None and dev.type == "cuda":
        keys = block_k(lay, q_nope.dtype, align, _device_limits(dev)[1])
    if keys not in (None, 32, 64):
        raise ValueError(f"keys must be 32 or 64, got {keys}")
    # tickets: [M, ceil(H / BLOCK_H)] hold the ceil(H / block_h) a row uses (program (m, hb)'s at m x blocks + hb)
    _sparse_mla_decode_kernel[(m, triton.cdiv(h, block_h), splits)](
        q_nope, q_rope, records, indices, cidx, out, lse, po, pl, tk,
        h, k, splits, 0 if compacted else k, records.stride(0), float(scale) * 1.4426950408889634, float(outer_scale),
        q_nope.stride(0), q_nope.stride(1), q_rope.stride(0), q_rope.stride(1), indices.stride(0), indices.stride(1),
        cidx.stride(0), out.stride(0), out.stride(1), lse.stride(0),
        *((po.stride(0), po.stride(1), po.stride(2), pl.stride(0), pl.stride(1)) if splits > 1 else (0,) * 5),
        **launch_constexprs(lay, q_nope.dtype, dot_precision, dev.type != "cuda", out.dtype == torch.bfloat16,
                            splits > 1, align, block_h, keys),
        num_stages=NUM_STAGES, **launch_options(lay, q_nope.dtype, block_h),
    )
    return out, lse


def launch_options(lay: RecordLayout, q_dtype: torch.dtype, block_h: int = BLOCK_H) -> dict:
    """num_warps and, where set, the ptxas register ceiling of a launch (``LAUNCH``; WIDE_H heads a
    program: WIDE_WARPS)."""
    warps, ceiling, _ = LAUNCH[(lay.name, q_dtype != torch.bfloat16)]
    warps = WIDE_WARPS if block_h == WIDE_H else warps
    return {"num_warps": warps} if ceiling is None else {"num_warps": warps, "maxnreg": ceiling}


def block_k(lay: RecordLayout, q_dtype: torch.dtype, rec_align: int = 16, shared_optin: int | None = None) -> int:
    """Keys per tile of a launch (``LAUNCH``); over records 4-byte aligned (``record_alignment``: the stock
    path's paged row view) 32, whose 4-byte loads take more registers, except for 368 (the stock
    format): with the record loads unmasked it fits 64 keys without a spill on both archs (16 B on sm_120
    before), 1,663 sm_90 instructions a 64-key tile against 2 x 1,032 (the 432 kernel spilled 4 B). On a
    device whose blocks may hold less than TILE64_SHARED (``shared_optin`` bytes: sm_120) 32 keys;
    ``shared_optin`` None (off-GPU): the table's."""
    bk = LAUNCH[(lay.name, q_dtype != torch.bfloat16)][2] if rec_align == 16 or lay.name == NVFP4_368.name else 32
    if bk == 64 and shared_optin is not None and shared_optin < TILE64_SHARED:
        return 32
    return bk


def compact_block(lay: RecordLayout, q_dtype: torch.dtype, block_h: int = BLOCK_H) -> int:
    """Listed indices a trip of the compaction's scan (``COMPACT_BLOCK`` per 4 warps of the launch; its
    counts and copy take 4 blocks a trip)."""
    return COMPACT_BLOCK * launch_options(lay, q_dtype, block_h)["num_warps"] // 4


def record_alignment(records: torch.Tensor) -> int:
    """16 when every record of ``records`` starts 16-byte aligned (its storage and its row stride in
    bytes: a contiguous array of 368 / 432 / 656-byte records, the selected path's workspace, or a
    paged cache's 16-byte row view, vLLM's: ``decode.paged_sparse_mla.row_align``), so its words load 16
    bytes at a time; else 4, what the ABI guarantees (a 4-byte row view: ``row_view``'s default)."""
    aligned = records.data_ptr() % 16 == 0 and records.stride(0) * records.element_size() % 16 == 0
    return 16 if aligned else 4


def launch_constexprs(lay: RecordLayout, q_dtype: torch.dtype, dot_precision: str, interpreted: bool = False,
                      bf16_out: bool = False, merge: bool = False, rec_align: int = 16, block_h: int = BLOCK_H,
                      keys: int | None = None) -> dict:
    """The decode kernel's constexprs for a format, query dtype, precision, output dtype, split
    count (merge: S > 1, partials and the fused merge; interpreted: under TRITON_INTERPRET=1, see
    ``_dot``), record alignment (``record_alignment``), heads a program and keys a tile (``block_k``;
    None: the table's)."""
    if dot_precision not in PRECISIONS:
        raise ValueError(f"dot_precision must be one of {PRECISIONS}, got {dot_precision!r}")
    split = dot_precision == "bf16x2"
    return dict(FMT=_FMT_ID[lay.name], BLOCK_H=block_h, BLOCK_K=keys or block_k(lay, q_dtype, rec_align),
                BLOCK_C=compact_block(lay, q_dtype, block_h),
                Q_SPLIT=split and q_dtype != torch.bfloat16, P_SPLIT=split, F32_DOT=interpreted, OUT_BF16=bf16_out,
                MERGE=merge, ASM=not interpreted, REC_ALIGN=rec_align)


# Shared memory a block may opt in to, per compiled arch (CUDA's arch tables): what ``compile_specs`` compiles
# each launch for, as the wrapper reads it from the device (``_device_limits``).
SHARED_OPTIN = {120: 99 * 1024, 90: 227 * 1024}

_DECODE_SIG = {
    "qn_ptr": "*bf16", "qr_ptr": "*bf16", "rec_ptr": "*u8", "idx_ptr": "*i64", "cidx_ptr": "*i64",
    "out_ptr": "*fp32", "lse_ptr": "*fp32", "po_ptr": "*fp32", "pl_ptr": "*fp32", "tk_ptr": "*i32",
    "qk_scale": "fp32", "outer_scale": "fp32",
}


def _spec_options(lay: RecordLayout, q_dtype: torch.dtype, block_h: int = BLOCK_H) -> dict:
    """``launch_options`` as a compile spec holds them: num_warps, the rest under options."""
    opts = launch_options(lay, q_dtype, block_h)
    return {"num_warps": opts.pop("num_warps"), "options": opts}


def compile_specs() -> list[dict]:
    """Every launch configuration the wrapper uses, for compiling without a GPU (benchmarks/kernel_report.py).

    The decode kernel per record format with bf16 queries into a bf16 output and int64 indices (the
    engine's dtypes; the paged path's cache rows) and with fp32 queries into fp32 and int32 indices
    (the CPU twin's and the tests'; the selected path's workspace slots), at the default precision,
    each with S > 1 (partials and the fused merge) and with one split (",s1": the output directly),
    over 16-byte aligned records, and the engine's also over a paged cache's 4-byte row view (",a4":
    ``record_alignment``), for 368 with one split also with WIDE_H heads a program (",h32"; ``archs``:
    compiled for sm_90 only, whose blocks may hold its shared memory: ``heads_per_program``). A launch
    of 64-key tiles compiles for sm_90, and for sm_120 as the 32-key tiles ``block_k`` gives it there
    (",k32").
    """
    specs = []
    for lay in (NVFP4_368, NVFP4_432, FP8_DS_MLA):
        for q_dtype, q_type, align in ((torch.bfloat16, "*bf16", 16), (torch.bfloat16, "*bf16", 4),
                                       (torch.float32, "*fp32", 16)):
            wide = heads_per_program(lay, q_dtype, WIDE_H, 2, 1, WIDE_SHARED) == WIDE_H
            for merge in (True, False):
                # WIDE_H: one split only (S > 1 leaves the 16-head programs within a wave: ``heads_per_program``)
                for block_h, keys in [(bh, k) for bh in ((BLOCK_H, WIDE_H) if wide and not merge else (BLOCK_H,))
                                      for k in sorted({block_k(lay, q_dtype, align, SHARED_OPTIN[a]) for a in
                                                       ((90,) if bh == WIDE_H else SHARED_OPTIN)})]:
                    engine = q_dtype == torch.bfloat16
                    c = launch_constexprs(lay, q_dtype, "bf16x2", bf16_out=engine, merge=merge, rec_align=align,
                                          block_h=block_h, keys=keys)
                    sig = {n: _DECODE_SIG.get(n, "i32") for n in _sparse_mla_decode_kernel.arg_names if n not in c}
                    sig.update(qn_ptr=q_type, qr_ptr=q_type, out_ptr="*bf16" if engine else "*fp32",
                               idx_ptr="*i64" if engine else "*i32", **{n: "constexpr" for n in c})
                    name = lay.short + ("" if engine else ",q_fp32") + ("" if align == 16 else ",a4") \
                        + ("" if block_h == BLOCK_H else f",h{block_h}") + ("" if merge else ",s1") \
                        + ("" if keys == block_k(lay, q_dtype, align) else f",k{keys}")
                    # what a launch specializes (Triton: a pointer or int divisible by 16): the workspace's
                    # and the outputs' pointers and strides, arena views (256-byte aligned, ``attention_workspace``)
                    # of contiguous [M, K] / [M, H, 512] / [M, H] / [S, M, H, 512] buffers at H = 16 or 64 and
                    # K = 2,048; the queries' as vLLM's q views are (q_nope and q_rope at elements 0 and 512 of
                    # [N, H, 576] bf16: 16-byte aligned, 1,152-byte head stride); the caller's records and
                    # indices are left unspecialized
                    div16 = [n for n in ("cidx_ptr", "out_ptr", "lse_ptr", "po_ptr", "pl_ptr", "tk_ptr", "s_cidx_m",
                                         "s_out_m", "s_out_h", "s_lse_m", "s_po_s", "s_po_m", "s_po_h", "s_pl_s",
                                         "s_pl_m", "qn_ptr", "qr_ptr", "s_qn_m", "s_qn_h", "s_qr_m", "s_qr_h")
                             if n in sig]
                    attrs = {(_sparse_mla_decode_kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in div16}
                    spec = dict(name=f"sparse_mla_decode[{name}]", fn=_sparse_mla_decode_kernel, signature=sig,
                                constexprs=c, attrs=attrs, num_stages=NUM_STAGES,
                                **_spec_options(lay, q_dtype, block_h))
                    archs = tuple(a for a, optin in SHARED_OPTIN.items() if block_k(lay, q_dtype, align, optin) == keys)
                    if block_h == WIDE_H:
                        archs = (90,)
                    if archs != tuple(SHARED_OPTIN):
                        spec["archs"] = archs
                    specs.append(spec)
    return specs
