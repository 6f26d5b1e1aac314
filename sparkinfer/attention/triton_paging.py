"""Triton kernels of the paged-cache addressing a layer's forward does: one launch each, no temporaries.

The torch forms in ``paged_sparse_mla`` (``topk_to_slots`` + ``row_view``, ``scatter_rows``) are the
CPU twins: on a GPU each of their ~30 elementwise ops is a launch and a trip through the caching
allocator, per layer. These kernels do the same index arithmetic in registers and write only their
output; a check of device values ORs into its word of ``device_checks`` with an atomic, so the
forward stays free of host reads. ``tests/attention/test_triton_paging.py`` holds them to the torch forms bit
for bit (``TRITON_INTERPRET=1`` on CPU).

Index widths: positions, slots, cache rows and row numbers are int64 before they meet a stride (a
row of a strided layer view is 4 bytes, so past 8 GiB its rows pass 2^31). What stays int32 is
bounded far below 2^31: a position within a top-k row (``rk``, below K), ``max_blocks * block_size``
(the positions one request's block table covers on a rank, at most the model's context) and
``num_blocks * block_size`` (the slots of one layer's cache: 2^31 of even the 132-byte indexer
records would be a 283 GB layer).

* ``topk_rows``: topk int32/int64 [M, K] (logical positions of row m's request, -1 unused), token_req
  int [M], block_table int32 [R, B] -> out int64 [M, K]: the row of each kept position in the cache's
  row view (``row_view``: slot ``b * block_size + i`` is row ``b * row_s0 + i * row_s1``), -1 where
  unused, owned by another DCP rank, or beyond the request's blocks (flagged ``topk_position``, as is
  a position below -1). ``compact`` (the attention's paged path): each row's kept rows first, in their
  listed order, then -1, so the decode kernel copies its slice of them where each of its programs
  (two or four a row on the stock DCP path) compacted the row (``triton_decode._compact_split``).
* ``scatter_rows``: rows [N, W] -> kv_cache [num_blocks, block_size, W] (any strides, last dim
  contiguous) at slots int [N]; -1 skips; a slot in vLLM's null block or outside the cache is
  skipped and flagged ``cache_slots``.
* ``flag_nonfinite``: t [N, D] (fp32/bf16, last dim contiguous) -> ORs "a value is NaN or infinite"
  into a check's word (``DeviceChecks.flag_nonfinite``: one launch where its torch twin takes four).
* ``copy_rows``: dst [*, W] row ``dst_rows[i]`` (``i`` without them) <- src [*, W] row ``src_rows[i]``
  for every i with ``mask[i]`` (every i without one): the selected path's workspace patch (the step's
  own records, the replicas kept) touches only the rows it patches, not the whole workspace.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TOPK_BLOCK_M, TOPK_BLOCK_K, TOPK_WARPS = 4, 256, 4
TOPK_COMPACT_K = 2048  # positions a trip of ``topk_rows(compact=True)`` (``compact_launch``)
SCATTER_BLOCK_N, SCATTER_WARPS = 4, 4
COPY_BLOCK_N, COPY_WARPS = 4, 4
CHECK_BLOCK_N, CHECK_BLOCK_D, CHECK_WARPS = 4, 512, 4


@triton.jit
def _topk_rows_kernel(topk_ptr, s_tm, s_tk, M, K, req_ptr, table_ptr, s_tab, max_blocks, out_ptr, s_om,
                      flag_ptr, block_size, dcp_rank, dcp_world, interleave, row_s0, row_s1,
                      BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, COMPACT: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    o_rows = out_ptr + rm[:, None].to(tl.int64) * s_om
    base = tl.zeros([BLOCK_M], tl.int32)  # COMPACT: rows kept so far in each of the block's rows
    bad = tl.zeros([], tl.int32)
    # COMPACT: a program holds whole rows (grid M / BLOCK_M x 1), else a block of each (grid M / BLOCK_M x K / BLOCK_K)
    for k0 in range(tl.program_id(1) * BLOCK_K, K if COMPACT else (tl.program_id(1) + 1) * BLOCK_K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        inside = (rm[:, None] < M) & (rk[None, :] < K)
        # int32 positions (vLLM's top-k) divide in int32, a few instructions where int64 takes a call each
        t = tl.load(topk_ptr + rm[:, None].to(tl.int64) * s_tm + rk[None, :] * s_tk, mask=inside, other=-1)
        # a negative t never reaches the arithmetic's result (keep is false), so C-style // and % are exact;
        # t // (world x interleave) is (t // interleave) // world: three divisions where six were
        stripe = t // interleave
        turn = stripe // dcp_world
        local = turn * interleave + (t - stripe * interleave)
        keep = inside & (t >= 0) & (stripe - turn * dcp_world == dcp_rank)
        beyond = keep & (local >= max_blocks * block_size)
        keep = keep & ~beyond
        req = tl.load(req_ptr + rm, mask=rm < M, other=0).to(tl.int64)
        block = tl.where(keep, local // block_size, 0)
        phys = tl.load(table_ptr + req[:, None] * s_tab + block, mask=keep, other=0).to(tl.int64)
        row = phys * row_s0 + (local - block * block_size).to(tl.int64) * row_s1
        if COMPACT:  # each kept row at its place among the row's kept ones, in listed order
            kept = keep.to(tl.int32)
            tl.store(o_rows + base[:, None] + tl.cumsum(kept, axis=1) - 1, row, mask=keep)
            base += tl.sum(kept, axis=1)
        else:
            tl.store(o_rows + rk[None, :], tl.where(keep, row, -1), mask=inside)
        bad = tl.maximum(bad, tl.max(tl.max((beyond | (inside & (t < -1))).to(tl.int32), 1), 0))
    if COMPACT:  # the rest of each row: [kept, K), which no kept row was stored to
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            tl.store(o_rows + rk[None, :], tl.full([BLOCK_M, BLOCK_K], -1, tl.int64),
                     mask=(rm[:, None] < M) & (rk[None, :] < K) & (rk[None, :] >= base[:, None]))
    tl.atomic_or(flag_ptr, bad)


@triton.jit
def _scatter_rows_kernel(cache_ptr, s0, s1, num_blocks, block_size, null_block, slots_ptr, N, rows_ptr, s_row, W,
                         flag_ptr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slots_ptr + rn, mask=rn < N, other=-1).to(tl.int64)
    block = slot // block_size
    bad = (slot >= 0) & ((block == null_block) | (slot >= num_blocks * block_size))
    write = (slot >= 0) & ~bad
    rw = tl.arange(0, BLOCK_W)
    m = write[:, None] & (rw[None, :] < W)
    v = tl.load(rows_ptr + rn[:, None].to(tl.int64) * s_row + rw[None, :], mask=m)
    at = tl.where(write, block * s0 + (slot % block_size) * s1, 0)
    tl.store(cache_ptr + at[:, None] + rw[None, :], v, mask=m)
    tl.atomic_or(flag_ptr, tl.max(bad.to(tl.int32), 0))


def topk_rows(topk: torch.Tensor, token_req: torch.Tensor, block_table: torch.Tensor, block_size: int,
              row_s0: int, row_s1: int, flag: torch.Tensor, dcp_rank: int = 0, dcp_world: int = 1,
              interleave: int = 1, out: torch.Tensor | None = None, compact: bool = False) -> torch.Tensor:
    """int64 [M, K] rows of ``topk``'s positions in the row view (module docstring); ``flag`` int32 [1]
    (``DeviceChecks.word("topk_position")``); ``out`` an optional int64 [M, K] buffer (last dim
    contiguous). ``compact``: each row's kept rows first, in their listed order, then -1 (the attention's
    paged path: the decode kernel then copies its slice instead of compacting the row,
    ``triton_decode._compact_split``); a program per row (``compact_launch``)."""
    m, k = topk.shape
    if out is None:
        out = torch.empty((m, k), dtype=torch.int64, device=topk.device)
    if m and k:
        block_m, block_k, warps = compact_launch(k) if compact else (TOPK_BLOCK_M, TOPK_BLOCK_K, TOPK_WARPS)
        grid = (triton.cdiv(m, block_m), 1 if compact else triton.cdiv(k, block_k))
        _topk_rows_kernel[grid](topk, topk.stride(0), topk.stride(1), m, k, token_req, block_table,
                                block_table.stride(0), block_table.shape[1], out, out.stride(0), flag, block_size,
                                dcp_rank, dcp_world, interleave, row_s0, row_s1, BLOCK_M=block_m,
                                BLOCK_K=block_k, COMPACT=compact, num_warps=warps)
    return out


def compact_launch(k: int) -> tuple[int, int, int]:
    """(rows a program, positions a trip, warps) of ``topk_rows(compact=True)``: one row a program, the whole
    row in one trip up to TOPK_COMPACT_K positions (GLM-5.2's top-2,048: its loads all in flight at once;
    a larger K takes more trips, each after the last's count), 8 positions a thread."""
    block_k = min(triton.next_power_of_2(k), TOPK_COMPACT_K)
    return 1, block_k, max(1, min(8, block_k // 256))


def scatter_rows(kv_cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, null_block: int,
                 flag: torch.Tensor) -> None:
    """``kv_cache[slot // block_size, slot % block_size] = rows[i]`` (module docstring); rows [N, W] in
    the cache's dtype with a contiguous last dim, ``flag`` int32 [1] (``DeviceChecks.word("cache_slots")``)."""
    n, width = rows.shape
    if n:
        _scatter_rows_kernel[(triton.cdiv(n, SCATTER_BLOCK_N),)](
            kv_cache, kv_cache.stride(0), kv_cache.stride(1), kv_cache.shape[0], kv_cache.shape[1], null_block,
            slots, n, rows, rows.stride(0), width, flag, BLOCK_N=SCATTER_BLOCK_N,
            BLOCK_W=triton.next_power_of_2(width), num_warps=SCATTER_WARPS)


@triton.jit
def _copy_rows_kernel(dst_ptr, s_dst, dst_rows_ptr, src_ptr, s_src, src_rows_ptr, mask_ptr, N, W,
                      HAS_DST_ROWS: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_W: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    take = rn < N
    if HAS_MASK:
        take = take & (tl.load(mask_ptr + rn, mask=take, other=0) != 0)
    src = tl.load(src_rows_ptr + rn, mask=take, other=0).to(tl.int64)
    if HAS_DST_ROWS:
        dst = tl.load(dst_rows_ptr + rn, mask=take, other=0).to(tl.int64)
    else:
        dst = rn.to(tl.int64)
    rw = tl.arange(0, BLOCK_W)
    m = take[:, None] & (rw[None, :] < W)
    v = tl.load(src_ptr + src[:, None] * s_src + rw[None, :], mask=m)
    tl.store(dst_ptr + dst[:, None] * s_dst + rw[None, :], v, mask=m)


@triton.jit
def _nonfinite_kernel(t_ptr, N, D, s_row, flag_ptr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    bad = tl.zeros([BLOCK_N], tl.int32)
    for d0 in range(0, D, BLOCK_D):
        rd = d0 + tl.arange(0, BLOCK_D)
        m = (rn[:, None] < N) & (rd[None, :] < D)
        x = tl.load(t_ptr + rn[:, None].to(tl.int64) * s_row + rd[None, :], mask=m, other=0.0).to(tl.float32)
        bad = tl.maximum(bad, tl.max(((x != x) | (tl.abs(x) == float("inf"))).to(tl.int32), 1))
    tl.atomic_or(flag_ptr, tl.max(bad, 0))


def flag_nonfinite(t: torch.Tensor, flag: torch.Tensor) -> None:
    """OR "``t`` [N, D] holds a NaN or an infinity" into ``flag`` (int32 [1], a ``device_checks`` word);
    t float32 or bfloat16 with a contiguous last dim."""
    n, d = t.shape
    if n and d:
        _nonfinite_kernel[(triton.cdiv(n, CHECK_BLOCK_N),)](t, n, d, t.stride(0), flag, BLOCK_N=CHECK_BLOCK_N,
                                                            BLOCK_D=CHECK_BLOCK_D, num_warps=CHECK_WARPS)


_TOPK_SIG = dict(s_tm="i32", s_tk="i32", M="i32", K="i32", table_ptr="*i32", s_tab="i32", max_blocks="i32",
                 out_ptr="*i64", s_om="i32", flag_ptr="*i32", block_size="i32", dcp_rank="i32", dcp_world="i32",
                 interleave="i32", row_s0="i64", row_s1="i64")
_SCATTER_SIG = dict(s0="i64", s1="i64", num_blocks="i32", block_size="i32", null_block="i32", slots_ptr="*i64",
                    N="i32", s_row="i32", W="i32", flag_ptr="*i32")


def copy_rows(dst: torch.Tensor, src: torch.Tensor, src_rows: torch.Tensor, mask: torch.Tensor | None = None,
              dst_rows: torch.Tensor | None = None) -> None:
    """The module docstring's ``copy_rows``: dst and src [*, W] with a contiguous last dim, src_rows,
    dst_rows int [N], mask bool [N]; rows not taken are neither read nor written."""
    n, width = src_rows.shape[0], dst.shape[1]
    if n:
        dummy = src_rows
        _copy_rows_kernel[(triton.cdiv(n, COPY_BLOCK_N),)](
            dst, dst.stride(0), dummy if dst_rows is None else dst_rows, src, src.stride(0), src_rows,
            dummy if mask is None else mask, n, width, HAS_DST_ROWS=dst_rows is not None, HAS_MASK=mask is not None,
            BLOCK_N=COPY_BLOCK_N, BLOCK_W=triton.next_power_of_2(width), num_warps=COPY_WARPS)


def _ordered(fn, sig: dict) -> dict:
    return {n: sig[n] for n in fn.arg_names}


def compile_specs() -> list[dict]:
    """Every launch configuration the wrappers use, for compiling without a GPU (benchmarks/kernel_report.py): the
    top-k kernel for int32 top-k (the indexer's buffer) and int64 token_req; the scatter for record
    bytes (656-byte fp8_ds_mla rows: the widest) and bf16 [latent ; rope] rows; the row copy of the
    selected path's workspace patch (432-byte records, the widest of its formats), masked, and
    unmasked into listed rows (the replica store)."""
    specs = []
    topk = dict(_TOPK_SIG, topk_ptr="*i32", req_ptr="*i64", BLOCK_M="constexpr", BLOCK_K="constexpr",
                COMPACT="constexpr")
    block_m, block_k, warps = compact_launch(2048)  # the attention's paged path at GLM-5.2's top-2,048
    for name, compact, bm, bk, w in (("paging_topk_rows", False, TOPK_BLOCK_M, TOPK_BLOCK_K, TOPK_WARPS),
                                     ("paging_topk_rows[compact]", True, block_m, block_k, warps)):
        specs.append(dict(name=name, fn=_topk_rows_kernel, signature=_ordered(_topk_rows_kernel, topk),
                          constexprs={"BLOCK_M": bm, "BLOCK_K": bk, "COMPACT": compact}, num_warps=w, num_stages=1))
    for elem, width in (("u8", 656), ("bf16", 576)):
        sig = dict(_SCATTER_SIG, cache_ptr=f"*{elem}", rows_ptr=f"*{elem}", BLOCK_N="constexpr", BLOCK_W="constexpr")
        specs.append(dict(name=f"paging_scatter_rows[{elem}]", fn=_scatter_rows_kernel,
                          signature=_ordered(_scatter_rows_kernel, sig),
                          constexprs={"BLOCK_N": SCATTER_BLOCK_N, "BLOCK_W": triton.next_power_of_2(width)},
                          num_warps=SCATTER_WARPS, num_stages=1))
    for elem in ("fp32", "bf16"):  # the check of the indexer's weights and of a cache write's values
        sig = dict(t_ptr=f"*{elem}", N="i32", D="i32", s_row="i32", flag_ptr="*i32", BLOCK_N="constexpr",
                   BLOCK_D="constexpr")
        specs.append(dict(name=f"paging_flag_nonfinite[{elem}]", fn=_nonfinite_kernel,
                          signature=_ordered(_nonfinite_kernel, sig),
                          constexprs={"BLOCK_N": CHECK_BLOCK_N, "BLOCK_D": CHECK_BLOCK_D}, num_warps=CHECK_WARPS,
                          num_stages=1))
    for name, dst_rows, mask in (("paging_copy_rows[masked]", False, True), ("paging_copy_rows[listed]", True, False)):
        sig = dict(dst_ptr="*u8", s_dst="i32", dst_rows_ptr="*i64", src_ptr="*u8", s_src="i32", src_rows_ptr="*i64",
                   mask_ptr="*i1", N="i32", W="i32", HAS_DST_ROWS="constexpr", HAS_MASK="constexpr",
                   BLOCK_N="constexpr", BLOCK_W="constexpr")
        specs.append(dict(name=name, fn=_copy_rows_kernel, signature=_ordered(_copy_rows_kernel, sig),
                          constexprs={"HAS_DST_ROWS": dst_rows, "HAS_MASK": mask, "BLOCK_N": COPY_BLOCK_N,
                                      "BLOCK_W": 512}, num_warps=COPY_WARPS, num_stages=1))
    return specs
