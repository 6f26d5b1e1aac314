"""The indexer's top-k of every row straight from its request's pages: one launch that scores and
selects, shaped by the rows alone (what a CUDA graph replays).

Row m of a step is a query row of request ``row_req[m]`` at causal position ``pos[m]``: it scores
the tokens 0 .. pos[m] (scored sharded, the ones a DCP rank owns: ``DcpLayout.token_of`` of its
local ordinals 0 .. local_len(pos[m] + 1) - 1), whose keys are the records of the indexer cache
``uint8 [num_blocks, block_size, 132]`` that the request's block table row names: token t is
record ``t % block_size`` of block ``block_table[row_req[m], t // block_size]``. A program reads
its rows' positions, requests and block table entries from memory and loops to the rows' own
lengths, so nothing on the host follows the contexts: the grid is (ceil(M / ROWS), splits),
``splits`` fixed by M (``core.indexer_tiles.paged_splits``), and every scalar is the engine's.

Program (g, s) takes ROWS consecutive rows (``group_rows``: up to ``MAX_GROUP`` of a request's
rows, so a request's keys are read from memory and converted once for them, issue 33) in a pass
per request among them (one for a decode step's groups; a group that spans requests runs one pass
for each). In a pass the rows' queries are loaded and converted once a tile, and each chunk of 64
positions' keys once for all the rows, in one of two forms of the chunk's dot (``KEYS_AS_M``, by
the GPU: ``keys_as_m_on``). On sm_90 the tiled scorer's (``triton_scores.chunk_scores``): the
chunk's keys as the dot's M and the rows' heads stacked as its N ([64 positions, 128 dims] x [128
dims, ROWS x 32 heads], a wgmma whose q operand stays in shared memory), the record's scale on the
head sum. Elsewhere (sm_120) a dot per row ([32 heads, 128 dims] x [128 dims, 64 positions], an f16
mma.sync for the engine's fp8 q) on the keys as its B operand: ``triton_scores.row_scores``' steps
per row (``q_tile``, ``key_tile``, ``head_dots``, ``head_sum``, ``selection_keys``) but for the
records' scales, which multiply a position's head sum, not its 32 dots (``scaled``): a power-of-two
scale (the cache's) scales every product and partial sum of the sum exactly, as it does the dot's,
so either form gives the same fp32 scores and int64 keys as the tiled top-k whatever the grouping
under the interpreter (which runs ``row_scores`` for both). Compiled, the tiled scorer
(``chunk_scores`` over GROUPS rows, the heads in octet order) may add a score's head sums in another
fp32 order than either form (surely than the dot per row; not checked on a GPU for the stacked 2 rows
against its 4): the same bits on exact inputs, a top-k of the exact scores within fp32's error on any
(``test_gpu_paged_equals_tiled_at_decode_shapes``, not yet run on a GPU); the engine scores a step
with one of them on every rank. An unsharded call (``SHARDED`` false) takes a row's list ordinal as its token,
without DcpLayout.token_of's divisions per position, and with pages of a multiple of a chunk's 64
tokens (``PAGE_CHUNKS``: the engine's are 64 x DCP) finds a chunk's one page with one division and
one block-table entry, not one of each per token, and reads the chunk's records unmasked (those past
the list are still the page's; their keys are not valid). Each row keeps a running top-k of its share
(chunks s, s + splits, ... of 64 positions, ``tile`` positions a tile)
in its own work row int64 [k + tile] (``TopkWorkspace.take_paged``): a tile's keys go after the k
kept ones, then ``triton_topk.select_row`` keeps the k largest in the head, in place. The keys are
distinct (the token id is in them; only INT64_MIN, "nothing", repeats), so after the last tile the head is
the top-k of the program's share, and the top-k of the shares is the row's. With one split the
program sorts its head into the output; with more, each writes its head beside the others' and
counts itself done on the row's counter (an atomic, acquire-release), and the last to finish
merges the heads (``select_row`` sorted, the sharded merge's form) and sets the counter back to 0
for the next call: one launch either way. The row's top-k is written as the caller wants it: the
int64 keys, or the int32 token ids with their -1 padding (``triton_topk.key_ids``, the rule of
``topk.unpack_keys``), straight into the output, so the engine's top-k buffer needs no fill and no
conversion. The weights are read as they come (fp32 or bf16), and with a check word each row's
first split ORs in whether its weights hold a NaN or an infinity (the check a separate kernel made,
``device_checks``' "indexer_inputs", read a step later). The selection is the tiled top-k's
(``tiled.indexer_topk_rows``) bit for bit given the same scores: keys, order, INT64_MIN padding of a row with fewer than
k tokens, hence the ids and the tie rule (score descending, token id ascending).

Memory: ``core.indexer_tiles.paged_workspace_bytes``, fixed by M, k and the tile, whatever the
context, plus the split counters beside it (``paged_split_rows``, zeroed once, left at 0 by every call). No
allocation given a workspace, no host read.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from sparkinfer.attention.triton_codes import load_f32
from sparkinfer.core.indexer_tiles import paged_splits, paged_workspace_bytes
from sparkinfer.core.topology import DcpLayout

from .triton_scores import (BLOCK_T, block_h, chunk_scores, head_dots, head_sum, head_weights, key_tile,
                            lane, octets, q_operand, q_tile, selection_keys)
from .triton_topk import key_ids, select_row, sort_desc

_MIN = tl.constexpr(-9223372036854775808)  # INT64_MIN: "nothing" (topk._NONE)
# rows per program at most: a request's MTP3 rows in two programs. The kernel unrolls a dot per row
# (acc0, acc1); 4 rows (tried with acc0 .. acc3) compiled to 255 registers and spilled 8 to 104 bytes
# per thread on sm_120 / sm_90 (2026-12-07); 2 compile to 228-254 registers, none spilled
MAX_GROUP = 2
# keys a selection scan step loads (``select_row``'s BLOCK; any size selects the same keys): a quarter
# of the top-k kernel's, which leaves registers to the group's dots
BLOCK = 1024
# warps per program, by the chunk's dot (``KEYS_AS_M``): a dot per row (heads as M, mma.sync) at 4 warps
# spilled the tile's key words, addresses and the two rows' A operands held around the selection (56-152
# bytes, 2026-12-07), 8 hold fewer of a tile's elements each; the keys as M (sm_90's wgmma, q's operand in
# shared memory) take one warpgroup, every warp 16 of the chunk's positions (8 warps: two warpgroups, each
# converting all 64 keys)
WARPS = {False: 8, True: 4}
# pipeline stages of the chunk loop's loads. One CTA an SM waits for every DRAM round trip a chunk makes
# with nothing issued in between (``benchmarks/kernel_report.py``'s ``load_waits``): synchronously, the
# block-table entry, then the chunk's codes and their scales (one load a chunk, beside the codes: loaded a
# row at a time, after each row's dot, they were one more wait a row): 3 waits a chunk for the dot per row
# (sm_120), 2 for the keys as M (sm_90). Pipelined, the codes are copied ahead (cp.async) and the scales
# (4 bytes a record in a slice layout, feeding no dot) stay a synchronous load, from L2 by then (the
# codes' copy brought their lines in). At 3 stages the codes are copied one chunk ahead into one buffer,
# issued at the end of the chunk before and waited for at once at the top (exposed: 2 waits a chunk); at
# 5, two chunks ahead into two buffers, waited for a whole chunk after they were issued (covered: the
# scales' wait alone is exposed, 113-131 instructions after its load). SASS a chunk, 1 / 3 / 5 stages:
# sm_120 399 / 418 / 438, sm_90 271 / 310 / 321; shared memory 33 KB (sm_120) and 48 KB (sm_90) at 5.
STAGES = 5
# registers a thread may take (ptxas' .maxnreg): at 8 warps sm_120's ptxas otherwise capped the kernel at 128
# when q's pointer and strides are specialized divisible by 16 (the engine's launch, ``compile_specs``'
# attrs) and spilled 48 bytes (2026-12-07: 184 registers with it, no spill)
MAXNREG = 255


@triton.jit
def _row_keys(wv, acc, scale, t, j, n, act, dst):
    """A group row's selection keys of a chunk (its heads' weights ``wv`` and dots with the codes
    ``acc``, the records' scales ``scale``) at list positions ``j`` (tokens ``t``), stored at ``dst`` when
    the row is ``act``ive in this pass; the row's list has ``n`` positions (its tokens up to its own
    position: j < n is t <= pos)."""
    score = head_sum(wv, acc) * scale  # the record's scale on the head sum, not each dot
    keys = selection_keys(score, t.to(tl.int64), j < n)
    tl.store(dst, keys, mask=(tl.zeros_like(t) + act.to(tl.int32)) != 0)


@triton.jit
def _paged_topk_kernel(
    q_ptr, w_ptr, cache_ptr, table_ptr, req_ptr, pos_ptr, work_ptr, heads_ptr, count_ptr, top_ptr, out_ptr,
    flag_ptr, M, HI, K, S, RANK, INTERLEAVE, PERIOD, block_size, table_width,
    s_q_m, s_q_h, s_w_m, s_w_h, s_block, s_token, s_table, s_work, s_heads, s_top, s_out,
    TILE: tl.constexpr, SORTED: tl.constexpr, SORT: tl.constexpr, BLOCK: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_T: tl.constexpr, PRECISION: tl.constexpr, Q_CODES: tl.constexpr,
    IDS: tl.constexpr, CHECK: tl.constexpr, ROWS: tl.constexpr, SHARDED: tl.constexpr, PAGE_CHUNKS: tl.constexpr,
    PAGE_SHIFT: tl.constexpr, KEYS_AS_M: tl.constexpr, THREADS: tl.constexpr,
):
    g = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    r0 = g * ROWS
    gl = tl.arange(0, ROWS)
    there = r0 + gl < M
    reqs = tl.load(req_ptr + r0 + gl, mask=there, other=-1).to(tl.int64)
    posv = tl.load(pos_ptr + r0 + gl, mask=there, other=0).to(tl.int32)
    # each row's list: its RANK's share of tokens 0 .. pos (DcpLayout.local_len; all of them at PERIOD 1)
    nv = posv + 1
    lens = (nv // PERIOD) * INTERLEAVE + tl.minimum(tl.maximum(nv % PERIOD - RANK * INTERLEAVE, 0), INTERLEAVE)
    lanes = tl.arange(0, BLOCK)
    cols = tl.arange(0, BLOCK_T)
    at_col = cols * s_token  # a chunk's records' offsets from its first (PAGE_CHUNKS)
    # the group rows' scalars (rows past M stand in for the last: computed, never stored)
    row0 = tl.minimum(r0, M - 1)
    len0 = lane(lens, gl, 0)
    row1, len1 = row0, len0
    if ROWS > 1:
        row1, len1 = tl.minimum(r0 + 1, M - 1), lane(lens, gl, 1)
    wv0 = head_weights(w_ptr + row0 * s_w_m, s_w_h, HI, BLOCK_H)  # the rows' weights, read once
    wv1 = wv0
    if ROWS > 1:
        wv1 = head_weights(w_ptr + row1 * s_w_m, s_w_h, HI, BLOCK_H)
    # KEYS_AS_M: the rows' weights [ROWS, BLOCK_H] and the same in the dot's column order (``chunk_scores``),
    # and the rows' work rows past their heads (rows past M stand in for the last: scored, never stored)
    wv = head_weights(w_ptr + tl.minimum(r0 + gl, M - 1)[:, None] * s_w_m, s_w_h, HI, BLOCK_H)
    wt = tl.permute(tl.reshape(wv, [ROWS, BLOCK_H // 8, 8]), (1, 0, 2))
    dst = work_ptr + ((r0 + gl) * S + s)[None, :] * s_work + K
    for p in range(ROWS):  # a pass per request of the group (its first row's): its rows read its keys once
        req = lane(reqs, gl, p)
        act = there & (reqs == req)
        if (r0 + p < M) & (tl.sum((act & (gl < p)).to(tl.int32), 0) == 0):
            length = tl.max(tl.where(act, lens, 0), 0)
            table = table_ptr + req * s_table
            for i in range(ROWS):  # the pass's rows: their running heads start empty; weights checked
                if lane(act.to(tl.int32), gl, i) != 0:
                    m = r0 + i
                    work = work_ptr + (m * S + s) * s_work
                    for i0 in range(0, K, BLOCK):
                        tl.store(work + i0 + lanes, tl.full([BLOCK], _MIN, tl.int64), mask=i0 + lanes < K)
                    if CHECK:  # the row's weights finite (they carry q's scales): its first split ORs the verdict
                        if s == 0:
                            h = tl.arange(0, BLOCK_H)
                            wc = tl.load(w_ptr + m * s_w_m + h * s_w_h, mask=h < HI, other=0.0).to(tl.float32)
                            tl.atomic_or(flag_ptr, tl.max(((wc != wc) | (tl.abs(wc) == float("inf"))).to(tl.int32), 0))
            act0 = lane(act.to(tl.int32), gl, 0) != 0
            act1 = act0
            if ROWS > 1:
                act1 = lane(act.to(tl.int32), gl, 1) != 0
            # this split's chunks of the pass (to its longest row): chunks s, s + S, s + 2 S, ... of BLOCK_T
            # positions, TILE // BLOCK_T of them a tile, so every split has work from S chunks of context on
            # whatever the tile (contiguous tiles left splits idle below S tiles of context)
            mine = tl.cdiv(tl.maximum(tl.cdiv(length, BLOCK_T) - s, 0), S)
            for i0 in range(0, mine, TILE // BLOCK_T):
                span = tl.minimum(mine - i0, TILE // BLOCK_T)  # chunks in this tile
                # the rows' queries (the dots' operands), loaded and converted once for the tile's chunks; not
                # held across the selection below (held from the program's start they spilled, 2026-12-07)
                if KEYS_AS_M:  # the rows stacked, and their heads in the dot's column order (``octets``)
                    qa = q_tile(q_ptr, r0, M, s_q_m, s_q_h, HI, ROWS, BLOCK_H, PRECISION, Q_CODES)
                    qt = octets(tl.trans(qa), ROWS, BLOCK_H)
                else:
                    qa0 = q_tile(q_ptr, row0, M, s_q_m, s_q_h, HI, 1, BLOCK_H, PRECISION, Q_CODES)
                    qa1 = qa0
                    if ROWS > 1:
                        qa1 = q_tile(q_ptr, row1, M, s_q_m, s_q_h, HI, 1, BLOCK_H, PRECISION, Q_CODES)
                for c in range(0, span):
                    j0 = (s + (i0 + c) * S) * BLOCK_T  # the chunk's first list position
                    j = j0 + cols
                    tmask = j < length
                    if SHARDED:  # DcpLayout.token_of, then the token's page and place in it
                        t = (j // INTERLEAVE) * PERIOD + RANK * INTERLEAVE + j % INTERLEAVE
                        block = tl.load(table + tl.minimum(t // block_size, table_width - 1), mask=tmask, other=0)
                        rec = cache_ptr + block.to(tl.int64) * s_block + (t % block_size).to(tl.int64) * s_token
                    elif PAGE_CHUNKS:  # the chunk (64 tokens from a multiple of 64) lies in one page: one entry
                        t = j
                        if PAGE_SHIFT >= 0:  # pages of 2^PAGE_SHIFT tokens: a shift, not a division (~20 SASS)
                            page = j0 >> PAGE_SHIFT
                            place = j0 & ((1 << PAGE_SHIFT) - 1)
                        else:
                            page = j0 // block_size
                            place = j0 - page * block_size
                        block = tl.load(table + page).to(tl.int64)
                        rec = cache_ptr + (block * s_block + place * s_token) + at_col
                        # a chunk's records past the list are still its page's: read unmasked (their keys are not
                        # valid, j < n below), without a predicate per load
                        tmask = tl.full([BLOCK_T], True, tl.int1)
                    else:
                        t = j
                        block = tl.load(table + tl.minimum(t // block_size, table_width - 1), mask=tmask, other=0)
                        rec = cache_ptr + block.to(tl.int64) * s_block + (t % block_size).to(tl.int64) * s_token
                    if KEYS_AS_M:  # the tiled scorer's dot: the chunk's keys as M, the rows' heads as N
                        score = chunk_scores(qa, qt, wv, wt, rec, tmask, ROWS, BLOCK_H, BLOCK_T, PRECISION)
                        keys = selection_keys(score, t.to(tl.int64)[:, None], j[:, None] < lens[None, :])
                        tl.store(dst + (c * BLOCK_T + cols)[:, None], keys, mask=act[None, :])
                    else:  # row_scores' steps per row, the chunk's keys loaded and converted once
                        # for the group's rows (their dots share them as the MMA's B operand)
                        kb = key_tile(rec, tmask, PRECISION)
                        scale = load_f32(rec + 128, tmask)  # once for the rows, beside the codes
                        zero = tl.zeros([BLOCK_H, BLOCK_T], tl.float32)
                        col = K + c * BLOCK_T + cols
                        _row_keys(wv0, head_dots(qa0, kb, zero, BLOCK_H, PRECISION), scale, t, j, len0, act0,
                                  work_ptr + (r0 * S + s) * s_work + col)
                        if ROWS > 1:
                            _row_keys(wv1, head_dots(qa1, kb, zero, BLOCK_H, PRECISION), scale, t, j, len1,
                                      act1, work_ptr + ((r0 + 1) * S + s) * s_work + col)
                tl.debug_barrier()  # the tile's keys are visible to the whole CTA
                for i in range(ROWS):  # each row keeps its k best
                    if lane(act.to(tl.int32), gl, i) != 0:
                        work = work_ptr + ((r0 + i) * S + s) * s_work
                        select_row(work, K + span * BLOCK_T, K, K, work, work, BLOCK, 1, False,
                                   False, THREADS)
                tl.debug_barrier()  # the heads are kept before the next tile is written
            for i in range(ROWS):
                if lane(act.to(tl.int32), gl, i) != 0:
                    m = r0 + i
                    work = work_ptr + (m * S + s) * s_work
                    out = out_ptr + m * s_out
                    if SORTED:  # the only split: its head, sorted, is the row's top-k
                        o = tl.arange(0, SORT)
                        best = sort_desc(tl.load(work + o, mask=o < K, other=_MIN), THREADS)
                        if IDS:
                            tl.store(out + o, key_ids(best), mask=o < K)
                        else:
                            tl.store(out + o, best, mask=o < K)
                    else:  # the split's top-k beside the others'; the row's last split to finish merges them
                        heads = heads_ptr + m * s_heads
                        for i0 in range(0, K, BLOCK):
                            o = i0 + lanes
                            tl.store(heads + s * K + o, tl.load(work + o, mask=o < K), mask=o < K)
                        tl.debug_barrier()  # the whole head is stored before the count releases it
                        if tl.atomic_add(count_ptr + m, 1, sem="acq_rel") == S - 1:
                            select_row(heads, S * K, K, K, top_ptr + m * s_top, out, BLOCK, SORT, True, IDS, THREADS)
                            tl.store(count_ptr + m, 0)  # the next call's count starts at 0


def paged_topk_rows(q, w, kv_cache, block_table, row_req, pos, k: int, *, tile: int, out, workspace=None,
                    shard: tuple[int, DcpLayout] | None = None, as_keys: bool = False,
                    flag: torch.Tensor | None = None, rows_per_req: int = 1) -> torch.Tensor:
    """Every row's top-k (the module docstring) into ``out``: token ids int32 [M, k], -1 padded, or
    with ``as_keys`` the selected int64 keys [M, k] (``topk.pack_keys``, INT64_MIN padded), best
    first, written by the kernel itself (unit column stride). Returns ``out``.

    q float32/bf16/float8_e4m3fn [M, Hi, 128], w float32/bf16 [M, Hi] (read as it is: no widened
    copy), kv_cache uint8 [num_blocks, block_size, 132] (any strides that keep a record's 4-byte
    scale aligned), block_table int32/int64 [R, B], row_req int [M] (a row of block_table), pos int
    [M], all on one device; ``shard`` (rank, layout): score the positions ``rank`` owns, ids the
    tokens (a sharded step's candidates); tile a multiple of ``triton_scores.BLOCK_T``;
    ``workspace`` a ``tiled.TopkWorkspace`` holding ``paged_workspace_bytes(M, k, tile)`` (None: one
    of that size is made); ``flag`` an int32 [1] word (``DeviceChecks.word("indexer_inputs")``) the
    kernel ORs 1 into when a row's weights hold a NaN or an infinity (None: not checked);
    ``rows_per_req`` the rows a request has in the step (the engine's 1 + draft tokens): a program
    takes ``group_rows(rows_per_req)`` consecutive rows and reads each key once for those of one
    request (any grouping gives the same result). Shapes and strides are checked here, values not
    (no read).
    """
    m = q.shape[0]
    if tile % BLOCK_T or tile <= 0:
        raise ValueError(f"tile must be a positive multiple of {BLOCK_T}, got {tile}")
    if kv_cache.dim() != 3 or kv_cache.dtype != torch.uint8 or kv_cache.shape[-1] != 132 or kv_cache.stride(2) != 1:
        raise ValueError(f"kv_cache must be uint8 [num_blocks, block_size, 132] with unit record stride, got "
                         f"{kv_cache.dtype} {tuple(kv_cache.shape)} strides {kv_cache.stride()}")
    if kv_cache.stride(0) % 4 or kv_cache.stride(1) % 4 or kv_cache.data_ptr() % 4:
        raise ValueError(f"kv_cache strides {kv_cache.stride()} do not keep the records' scales 4-byte aligned")
    want = (torch.int64 if as_keys else torch.int32, (m, k))
    if (out.dtype, tuple(out.shape)) != want or (m and out.stride(1) != 1):
        raise ValueError(f"out must be {want[0]} {want[1]} with unit column stride, got {out.dtype} "
                         f"{tuple(out.shape)} strides {out.stride()}")
    if w.dtype not in (torch.float32, torch.bfloat16) or tuple(w.shape) != tuple(q.shape[:2]):
        raise ValueError(f"w must be float32 or bfloat16 [M, Hi]={tuple(q.shape[:2])}, got {w.dtype} {tuple(w.shape)}")
    for name, t in (("row_req", row_req), ("pos", pos)):
        if tuple(t.shape) != (m,) or t.device != kv_cache.device:
            raise ValueError(f"{name} must be [M={m}] on {kv_cache.device}, got {tuple(t.shape)} on {t.device}")
    from sparkinfer.attention.dispatch import pick_backend

    pick_backend("triton", q.is_cuda, "indexer")  # counted where a test reads which scorer ran
    if m == 0:
        return out
    splits = paged_splits(m)
    if workspace is None:
        from .tiled import TopkWorkspace

        workspace = TopkWorkspace(paged_workspace_bytes(m, k, tile), q.device)
    work, heads, top, counts = workspace.take_paged(m, splits, k, tile)
    top = out if as_keys else top  # the merge's candidates: the keys' output itself, else the workspace's
    rank, layout = (0, DcpLayout(1)) if shard is None else shard
    q, precision, codes = q_operand(q)
    one = heads is None  # one split: heads and counts are never read (work stands in)
    rows = group_rows(rows_per_req)
    keys_as_m = keys_as_m_on(q.device)
    _paged_topk_kernel[(triton.cdiv(m, rows), splits)](
        q, w, kv_cache, block_table, row_req, pos, work, work if one else heads, work if one else counts, top, out,
        work if flag is None else flag, m, q.shape[1], k, splits, rank, layout.interleave, layout.period,
        kv_cache.shape[1], block_table.shape[1], q.stride(0), q.stride(1), w.stride(0), w.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), block_table.stride(0), work.stride(0), 0 if one else heads.stride(0),
        top.stride(0), out.stride(0),
        TILE=tile, SORTED=one, SORT=triton.next_power_of_2(k), BLOCK=BLOCK, BLOCK_H=block_h(q.shape[1]),
        BLOCK_T=BLOCK_T, PRECISION=precision, Q_CODES=codes, IDS=not as_keys,
        CHECK=flag is not None, ROWS=rows, SHARDED=layout.period > 1,
        PAGE_CHUNKS=kv_cache.shape[1] % BLOCK_T == 0, PAGE_SHIFT=_log2(kv_cache.shape[1]), KEYS_AS_M=keys_as_m,
        THREADS=32 * WARPS[keys_as_m], num_warps=WARPS[keys_as_m], num_stages=STAGES, maxnreg=MAXNREG,
    )
    return out


def keys_as_m_on(device: torch.device) -> bool:
    """The chunk's dot on ``device`` (``KEYS_AS_M``): the keys as its M on sm_90, where that is a wgmma
    whose q operand stays in shared memory (a dot per row reloads q's A operand from shared memory
    every chunk); a dot per row elsewhere (sm_120's mma.sync with the keys as M converts each key
    once per warp that shares it). Interpreted (a CPU tensor) either form gives the same keys."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def _log2(n: int) -> int:
    """log2(n) for a power of two n, else -1 (``PAGE_SHIFT``: the page of a list position by a shift)."""
    return n.bit_length() - 1 if n > 0 and n & (n - 1) == 0 else -1


def group_rows(rows_per_req: int) -> int:
    """Rows per program: the request's rows (MTP3: 1 + 3), as a power of two up to ``MAX_GROUP``."""
    if rows_per_req < 1:
        raise ValueError(f"rows_per_req must be at least 1, got {rows_per_req}")
    return min(MAX_GROUP, 1 << (rows_per_req.bit_length() - 1))


def compile_specs(k: int = 2048) -> list[dict]:
    """The paged top-k's launches in the engine at GLM-5.2's shapes (32 index heads, fp8 q, k 2,048,
    the tile of a long context, a request's 4 MTP rows per program, ids into vLLM's buffer and the
    weights checked, unsharded, pages of 64 tokens or more), as the compile test reads them: name,
    fn, signature, constexprs, attrs, num_warps, num_stages and archs: each arch's form of the chunk's
    dot (``keys_as_m_on``). One split (it sorts its head into the output) and several (the heads side
    by side, merged by the row's last split). ``attrs``: what the engine's launch specializes (Triton:
    a pointer or int divisible by 16): vLLM's fp8 q [M, 32, 128], rows of a contiguous buffer, so its
    loads take 16 bytes each (unspecialized, a byte a load: sm_90's 4 warps held the 64 addresses of a
    thread's bytes through the selection and spilled 256 bytes); k 2,048; the workspace's work rows,
    heads and candidates (``TopkWorkspace.take_paged``: one allocation, rows of k + tile, S k and k
    keys) and vLLM's top-k buffer (int32 rows of k), so the selection's scans load and store 16 bytes
    at a time."""
    from .triton_scores import BLOCK_T as block_t
    from sparkinfer.core.indexer_tiles import PAGED_TILE

    specs = []
    div16 = ("q_ptr", "s_q_m", "s_q_h", "K", "work_ptr", "s_work", "heads_ptr", "s_heads", "top_ptr", "s_top", "out_ptr",
             "s_out")
    attrs = {(_paged_topk_kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in div16}
    for (name, is_sorted), (arch, keys_as_m) in itertools.product((("paged_topk", True), ("paged_topk_split", False)),
                                                                 ((90, True), (120, False))):
        constexprs = {"TILE": PAGED_TILE, "SORTED": is_sorted, "SORT": triton.next_power_of_2(k), "BLOCK": BLOCK,
                      "BLOCK_H": 32, "BLOCK_T": block_t, "PRECISION": "f16", "Q_CODES": True,
                      "IDS": True, "CHECK": True, "ROWS": MAX_GROUP, "SHARDED": False,
                      "PAGE_CHUNKS": True, "PAGE_SHIFT": _log2(64), "KEYS_AS_M": keys_as_m,
                      "THREADS": 32 * WARPS[keys_as_m]}
        ptrs = {"q_ptr": "*u8", "w_ptr": "*fp32", "cache_ptr": "*u8", "table_ptr": "*i32", "req_ptr": "*i64",
                "pos_ptr": "*i64", "work_ptr": "*i64", "heads_ptr": "*i64", "count_ptr": "*i32", "top_ptr": "*i64",
                "out_ptr": "*i32", "flag_ptr": "*i32"}
        sig = {n: ptrs.get(n, "i32") for n in _paged_topk_kernel.arg_names if n not in constexprs}
        sig.update({n: "constexpr" for n in constexprs})
        specs.append({"name": f"{name}[k{k}]", "fn": _paged_topk_kernel, "signature": sig, "constexprs": constexprs,
                      "attrs": attrs, "options": {"maxnreg": MAXNREG}, "num_warps": WARPS[keys_as_m],
                      "num_stages": STAGES, "archs": [arch]})
    return specs
