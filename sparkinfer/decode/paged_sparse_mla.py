"""Sparse MLA over vLLM's paged record cache: the core the sparkinfer backend's ``forward_mqa`` calls.

vLLM hands a sparse-MLA backend, per query row m, the indexer's top-k as *logical* token
positions of the row's request (``topk [M, K]`` int32, -1 = unused) and, per request r, a block
table (``block_table [R, B]`` int32: logical block -> physical block). The cache of one layer is
``uint8 [num_blocks, block_size, record_bytes]``; physical slot = block * block_size + offset.

Under DCP (world D, interleave I, this rank ``rank``) token t lives on rank (t // I) % D at local
ordinal (t // (D*I)) * I + t % I, and the block table addresses local ordinals; tokens owned by
other ranks map to -1 here (a row with none gets lse -inf), and vLLM merges the per-rank partial
outputs with their LSE (``cpu_dcp`` on CPU).
"""

from __future__ import annotations

import torch


def topk_to_slots(topk: torch.Tensor, token_req: torch.Tensor, block_table: torch.Tensor, block_size: int,
                  dcp_rank: int = 0, dcp_world: int = 1, interleave: int = 1) -> torch.Tensor:
    """Physical cache slots int64 [M, K] of the logical top-k positions (-1 where unused or remote).

    topk int32/int64 [M, K] (logical positions in row m's request, -1 = unused); token_req int [M]
    (row m's request, an index into block_table); block_table int [R, B]. Every argument is checked
    on the host (reading the tensors back); the forward's form is ``topk_slots``.
    """
    _check_topk_inputs(topk, token_req, block_table, block_size, dcp_rank, dcp_world, interleave)
    return topk_slots(topk, token_req, block_table, block_size, dcp_rank, dcp_world, interleave)[0]


def topk_slots(topk: torch.Tensor, token_req: torch.Tensor, block_table: torch.Tensor, block_size: int,
               dcp_rank: int = 0, dcp_world: int = 1, interleave: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots, bad): ``topk_to_slots``' slots without a check or a host read, fixed-shape device work
    (the forward's torch form, the twin of ``triton_paging.topk_rows``): a position below -1 or
    beyond its request's blocks is ``bad`` (bool [M, K]; the forward flags it, ``topk_position``)
    and maps to -1."""
    max_blocks = block_table.shape[1]
    t = topk.to(torch.int64)
    owner = (t // interleave) % dcp_world
    local = (t // (dcp_world * interleave)) * interleave + t % interleave
    keep = (t >= 0) & (owner == dcp_rank)
    beyond = keep & (local >= max_blocks * block_size)
    keep = keep & ~beyond
    local = torch.where(keep, local, torch.zeros_like(local))
    rows = block_table.to(torch.int64)[token_req.to(torch.int64)]  # [M, B]
    blocks = torch.gather(rows, 1, local // block_size)
    return torch.where(keep, blocks * block_size + local % block_size, torch.full_like(local, -1)), beyond | (t < -1)


def _check_topk_inputs(topk, token_req, block_table, block_size, dcp_rank, dcp_world, interleave) -> None:
    if topk.dim() != 2 or token_req.dim() != 1 or token_req.shape[0] != topk.shape[0]:
        raise ValueError(f"topk must be [M, K] and token_req [M]; got {tuple(topk.shape)} and "
                         f"{tuple(token_req.shape)}")
    if block_table.dim() != 2:
        raise ValueError(f"block_table must be [R, B], got {tuple(block_table.shape)}")
    if not (0 <= dcp_rank < dcp_world) or interleave < 1 or block_size < 1:
        raise ValueError(f"need 0 <= dcp_rank < dcp_world, interleave >= 1, block_size >= 1; got rank "
                         f"{dcp_rank}, world {dcp_world}, interleave {interleave}, block_size {block_size}")
    num_reqs, max_blocks = block_table.shape
    if token_req.numel() and (int(token_req.min()) < 0 or int(token_req.max()) >= num_reqs):
        raise ValueError(f"token_req must lie in [0, {num_reqs}), got [{int(token_req.min())}, "
                         f"{int(token_req.max())}]")
    t = topk.to(torch.int64)
    if bool((t < -1).any()):
        raise ValueError("topk entries must be >= -1")
    owner = (t // interleave) % dcp_world
    local = (t // (dcp_world * interleave)) * interleave + t % interleave
    if bool((local[(t >= 0) & (owner == dcp_rank)] >= max_blocks * block_size).any()):
        raise ValueError(f"a top-k position lies beyond the request's {max_blocks} blocks of {block_size}")


# vLLM's BlockPool hands its first block to no request (its null block): a write with nothing to
# write there rewrites that block's first record with its own bytes.
NULL_BLOCK = 0


def scatter_rows(kv_cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """``kv_cache[slot // block_size, slot % block_size] = rows[i]`` for every ``slots[i] >= 0``, into a
    cache ``[num_blocks, block_size, W]`` of any strides (vLLM's strided layer views included).

    rows [N, W] in the cache's dtype, slots int [N] (-1 = skip). A slot in ``NULL_BLOCK`` or outside
    the cache is refused (read back on the host); the forward's form, which flags it instead, is
    ``forward_scatter_rows``.
    """
    slots, bad = _bad_slots(kv_cache, slots)
    if bool(bad.any()):
        raise ValueError(f"a cache write's slot lies in vLLM's null block {NULL_BLOCK} or outside the cache's "
                         f"{kv_cache.shape[0]} blocks of {kv_cache.shape[1]}: the slot mapping is corrupt")
    _write_rows(kv_cache, slots, rows, bad)


def forward_scatter_rows(step, kv_cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """``scatter_rows`` in a layer's forward (``step``: its ``ForwardStep``): a slot in ``NULL_BLOCK`` or
    outside the cache is not written but flagged (``cache_slots``). One kernel on the Triton backend
    (``triton_paging.scatter_rows``); its torch twin is fixed-shape device work, no host read: a
    skipped row targets the first record of ``NULL_BLOCK`` with that record's own bytes, so every
    write to it carries the same value."""
    if step.backend == "triton" and rows.stride(-1) == 1:
        from sparkinfer.attention import triton_paging

        triton_paging.scatter_rows(kv_cache, slots, rows, NULL_BLOCK, step.checks.word("cache_slots"))
        return
    slots, bad = _bad_slots(kv_cache, slots)
    step.checks.flag("cache_slots", bad)
    _write_rows(kv_cache, slots, rows, bad)


def _bad_slots(kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots int64, bad bool [N]: a slot in ``NULL_BLOCK`` or past the cache)."""
    nb, bs = kv_cache.shape[:2]
    slots = slots.to(torch.int64)
    return slots, (slots >= 0) & ((slots // bs == NULL_BLOCK) | (slots >= nb * bs))


def _write_rows(kv_cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, bad: torch.Tensor) -> None:
    bs = kv_cache.shape[1]
    valid = (slots >= 0) & ~bad
    block = torch.where(valid, slots // bs, NULL_BLOCK)
    offset = torch.where(valid, slots % bs, 0)
    kv_cache[block, offset] = torch.where(valid[:, None], rows, kv_cache[NULL_BLOCK, 0])


def copy_rows(dst: torch.Tensor, src: torch.Tensor, src_rows: torch.Tensor, mask: torch.Tensor | None = None,
              dst_rows: torch.Tensor | None = None) -> None:
    """``dst[dst_rows[i]] = src[src_rows[i]]`` (``dst[i]`` without ``dst_rows``) for every i with
    ``mask[i]`` (every i without a mask): dst, src [*, W], src_rows / dst_rows int [N], mask bool [N].
    One kernel on a GPU (``triton_paging.copy_rows``: only the taken rows are read and written); the
    torch twin is fixed-shape device work, no host read (rows not taken are rewritten with
    themselves, so their src_rows / dst_rows must still be in range)."""
    from sparkinfer.decode.impls import kernel_backend

    if kernel_backend(dst.device) == "triton" and dst.stride(-1) == 1 and src.stride(-1) == 1:
        from sparkinfer.attention import triton_paging

        triton_paging.copy_rows(dst, src, src_rows, mask, dst_rows)
        return
    value = src[src_rows]
    if dst_rows is None:
        head = dst[: value.shape[0]]
        head.copy_(value if mask is None else torch.where(mask[:, None], value, head))
    else:
        dst[dst_rows] = value if mask is None else torch.where(mask[:, None], value, dst[dst_rows])


def write_cache_records(fmt, kv_cache: torch.Tensor, slots: torch.Tensor, latent, rope=None) -> None:
    """Encode ``latent [N, D]`` (and ``rope [N, 64]``) as ``fmt`` records into ``kv_cache [num_blocks,
    block_size, W]`` at ``slots [N]`` (-1 = skip): in place through the format's writer when the cache
    is contiguous, else encoded and scattered into the strided view (``scatter_rows``). Checked on
    the host; the forward's form is ``forward_write_records``."""
    if kv_cache.is_contiguous():
        fmt.write(kv_cache, slots, latent, rope)
    else:
        scatter_rows(kv_cache, slots, fmt.encode(latent, rope))


def forward_write_records(step, fmt, kv_cache: torch.Tensor, slots: torch.Tensor, latent, rope=None) -> None:
    """``write_cache_records`` in a layer's forward (``step``: its ``ForwardStep``): one launch on every
    device (``formats.native.write_paged``: the CUDA encoder on a GPU, its host twin on CPU), straight
    from the model's fp32 or bf16 rows into the cache of any strides, with the checks of the values
    (``record_values``) and of the slots (``cache_slots``: below -1, in ``NULL_BLOCK`` or past the
    cache; such a slot is not written) flagged on the device: no staging copy, no host read.

    latent / rope rows need a contiguous last dim and slots are int64 contiguous: what vLLM hands
    every layer (``tests/decode/test_eager_launches.py`` holds the engine's cache write to one launch)."""
    from sparkinfer.formats import native

    native.write_paged(fmt, latent, rope, kv_cache, slots, NULL_BLOCK, step.checks.word("record_values"),
                       step.checks.word("cache_slots"))


def compact_pages(kv_cache: torch.Tensor, slots: torch.Tensor):
    """A contiguous stand-in for the pages of ``kv_cache [num_blocks, block_size, record]`` that ``slots``
    (int, any shape, -1 = none) touch -> (pages [P, block_size, record], the slots renumbered into
    pages (-1 kept), blocks int64 [P] or None).

    vLLM's block-outermost KV cache layouts (the only ones it allows when DCP-sharded records share a
    group with the replicated indexer) interleave the layers' pages, so one layer's view is strided and
    cannot be addressed by flat slot. A contiguous cache is returned as is (blocks None); otherwise the
    touched pages are copied out, and a writer copies them back with ``kv_cache[blocks] = pages``.
    """
    if kv_cache.is_contiguous():
        return kv_cache, slots, None
    block_size = kv_cache.shape[1]
    slots = slots.to(torch.int64)
    valid = slots >= 0
    blocks, inverse = torch.unique(slots[valid] // block_size, return_inverse=True)
    local = torch.full_like(slots, -1)
    local[valid] = inverse * block_size + slots[valid] % block_size
    return kv_cache[blocks], local, blocks


# The byte pitch of a strided cache's row view (``row_view``'s align): 4, what the ABI guarantees and
# the indexer's aligned loads need, or 16 where the cache allows it (``row_align``), so the attention
# kernel loads its records 16 bytes at a time (``attention.triton_decode.record_alignment``).
def _pitch(kv_cache: torch.Tensor, align: int = 4) -> int:
    """Elements per ``align`` bytes: the start-to-start distance of a strided cache's rows (``row_view``)."""
    return max(1, align // kv_cache.element_size())


def row_align(kv_cache: torch.Tensor) -> int:
    """16 when ``kv_cache``'s data pointer and its block and slot strides are multiples of 16 bytes, else 4:
    the widest pitch its ``row_view`` may take. vLLM's layer views of 368 / 432 / 656-byte records are the
    first: a block-outermost block packs the layers' pages (block_size x record bytes; block_size x 132
    for the indexer, block_size a multiple of 4) from its byte 0, so each page's offset and the block
    stride (their sum, which vLLM rounds up to its specs' block-stride alignments) are multiples of 16,
    and the pool is one CUDA allocation (256-byte aligned). Shapes, strides and the pointer only: no
    host read."""
    wide = row_strides(kv_cache, 16) is not None and kv_cache.data_ptr() % 16 == 0
    return 16 if wide else 4


def row_strides(kv_cache: torch.Tensor, align: int = 4) -> tuple[int, int] | None:
    """(row_s0, row_s1): slot ``b * block_size + i`` of ``kv_cache`` is row ``b * row_s0 + i * row_s1``
    of its ``row_view`` at the same ``align``; None when the cache has no such row view (``row_view``)."""
    if kv_cache.is_contiguous():
        return kv_cache.shape[1], 1
    pitch = _pitch(kv_cache, align)
    s0, s1 = kv_cache.stride(0), kv_cache.stride(1)
    if kv_cache.stride(2) != 1 or s0 % pitch or s1 % pitch or kv_cache.storage_offset() % pitch:
        return None
    return s0 // pitch, s1 // pitch


def row_view(kv_cache: torch.Tensor, slots: torch.Tensor | None, align: int = 4):
    """``kv_cache [num_blocks, block_size, record]`` as rows a reader addresses by index, without a
    copy -> (rows [R, record], row int64 of each of ``slots`` in it, -1 kept; None for ``slots`` None:
    the rows depend only on the shape, strides and ``align``, so caches alike share them).

    A contiguous cache is its own flat view. A strided one (the block-outermost layouts, see
    ``compact_pages``) becomes an overlapping view of its storage whose rows start every ``align``
    bytes (4: what the indexer kernel's aligned loads need; 16 where ``row_align`` allows it: the
    attention's 16-byte record loads; every element for wider dtypes): slot ``b * block_size + i`` is
    the row at byte ``b * stride(0) + i * stride(1)``, divided by ``align``. Read-only: rows overlap.
    None when a stride or the storage offset is not a multiple of ``align`` bytes (at 4: then
    ``compact_pages`` copies).
    """
    strides = row_strides(kv_cache, align)
    if strides is None:
        return None
    if kv_cache.is_contiguous():
        rows = kv_cache.view(-1, kv_cache.shape[-1])
    else:
        nb, bs, width = kv_cache.shape
        n_rows = (nb - 1) * strides[0] + (bs - 1) * strides[1] + 1  # the last record's row
        rows = kv_cache.as_strided((n_rows, width), (_pitch(kv_cache, align), 1))
    if slots is None:
        return rows, None
    slots = slots.to(torch.int64)
    if kv_cache.is_contiguous():
        return rows, slots
    at = (slots // kv_cache.shape[1]) * strides[0] + (slots % kv_cache.shape[1]) * strides[1]
    return rows, torch.where(slots >= 0, at, -1)


def topk_cache_rows(kv_cache: torch.Tensor, topk: torch.Tensor, token_req: torch.Tensor, block_table: torch.Tensor,
                    dcp_rank: int = 0, dcp_world: int = 1, interleave: int = 1):
    """(rows of ``kv_cache``, int64 [M, K] row of each top-k position in them, -1 where unused or remote):
    what the attention kernels read (``topk_to_slots`` then ``row_view``; the pages copied out by
    ``compact_pages`` when the cache has no row view). Checked on the host; the forward's form is
    ``forward_cache_rows``.

    The strided pages are read in place: copying the pages a top-k touches moves up to the whole
    shard per layer, many times the k records attention reads. The rows are ``row_align``'s (16 bytes
    apart where the cache allows, so the decode loads its records 16 bytes at a time). int64 rows: the
    view spans the cache, 4 or 16 bytes a row, so a layer view over 8 GiB has rows past 2^31 (the
    decode keeps them int64 to the address: ``attention.triton_decode``).
    """
    slots = topk_to_slots(topk, token_req, block_table, kv_cache.shape[1], dcp_rank, dcp_world, interleave)
    return _rows_at(kv_cache, slots, row_align(kv_cache))


def forward_cache_rows(step, kv_cache: torch.Tensor, topk: torch.Tensor, token_req: torch.Tensor, dcp_rank: int,
                       dcp_world: int, out=None, align: int = 4, compact: bool = False):
    """``topk_cache_rows`` in a layer's forward (``step``: its ``ForwardStep``, whose block table and
    interleave it reads), rows of the ``row_view`` at ``align`` (the attention's: ``row_align``): a bad
    position is flagged (``topk_position``) and maps to -1. On the Triton backend, over a cache with a
    row view, one kernel (``triton_paging.topk_rows``) from the top-k straight to rows, into ``out``
    (int64 [M, K]) when given; ``compact`` (the attention's) puts each row's kept rows first, in listed
    order, then -1 there, so the decode kernel need not compact them (~3/4 of a DCP4 rank's are -1)."""
    strides = row_strides(kv_cache, align)
    bs = kv_cache.shape[1]
    dcp = (dcp_rank, dcp_world, step.interleave)
    if strides is not None and step.backend == "triton":
        from sparkinfer.attention import triton_paging

        rows = triton_paging.topk_rows(topk, token_req, step.block_table, bs, *strides,
                                       step.checks.word("topk_position"), *dcp, out=out, compact=compact)
        return row_view(kv_cache, None, align)[0], rows
    slots, bad = topk_slots(topk, token_req, step.block_table, bs, *dcp)
    step.checks.flag("topk_position", bad)
    return _rows_at(kv_cache, slots, align)


def _rows_at(kv_cache: torch.Tensor, slots: torch.Tensor, align: int):
    """(rows, row of each of ``slots``): the cache's row view at ``align``, or its touched pages copied out."""
    if row_strides(kv_cache, align) is not None:
        return row_view(kv_cache, slots, align)
    pages, local, _ = compact_pages(kv_cache, slots)
    return pages.view(-1, kv_cache.shape[-1]), local


def paged_sparse_mla(q_nope: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor, cache_dtype: str,
                     topk: torch.Tensor, token_req: torch.Tensor, block_table: torch.Tensor, scale: float,
                     dcp_rank: int = 0, dcp_world: int = 1, interleave: int = 1):
    """(out float32 [M, H, 512], lse float32 [M, H]) of each row over its top-k records in the paged cache.

    q_nope [M, H, 512] (absorbed), q_rope [M, H, 64]; kv_cache uint8 [num_blocks, block_size, record];
    see ``sparkinfer.attention.sparse_mla_decode`` for the attention and LSE definitions. The kernel
    is ``sparkinfer.decode.impls.kernel_backend``'s: Triton on a GPU or when forced, else torch.
    Every argument is checked on the host; the forward's form is ``attend``.
    """
    from sparkinfer.attention import sparse_mla_decode
    from sparkinfer.decode.impls import kernel_backend
    from sparkinfer.formats import get_format

    fmt = get_format(cache_dtype)  # any spelling vLLM accepts for a record format
    if kv_cache.dim() != 3 or kv_cache.dtype != torch.uint8 or kv_cache.shape[-1] != fmt.record_bytes:
        raise ValueError(f"kv_cache must be uint8 [num_blocks, block_size, {fmt.record_bytes}] for {fmt.name}, "
                         f"got {kv_cache.dtype} {tuple(kv_cache.shape)}")
    records, rows = topk_cache_rows(kv_cache, topk, token_req, block_table, dcp_rank, dcp_world, interleave)
    return sparse_mla_decode(q_nope, q_rope, records, fmt, rows, scale, backend=kernel_backend(kv_cache.device))


def attend(step, q_nope: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor, fmt, topk: torch.Tensor,
           scale: float, dcp_rank: int, dcp_world: int):
    """``paged_sparse_mla`` in a layer's forward (``step``: its ``ForwardStep``, which holds each row's
    request, the block table, the kernels' backend and the arena; ``fmt`` the cache's record format):
    no host read and nothing checked here (``forward_cache_rows``). On the Triton backend over a cache
    with a row view it attends in blocks of rows into views of the step's arena (``layer_buffers``:
    consumed before the next call; out bf16 for bf16 queries), else as ``paged_sparse_mla``."""
    from sparkinfer.attention import sparse_mla_decode
    from sparkinfer.decode.layer_buffers import attend_in_blocks

    m = q_nope.shape[0]
    token_req = step.token_req if step.token_req.shape[0] == m else step.token_req[:m]
    align = row_align(kv_cache)  # 16 for every view vLLM makes: the decode's 16-byte record loads
    if step.backend == "triton" and row_strides(kv_cache, align) is not None:
        # each row's kept rows first (compact), so the decode copies its slice of them (compacted) where it
        # compacted each row in every program (~3/4 of a DCP4 rank's top-k is other ranks' tokens)
        def cache_rows(a, b, topk_rows):
            whole = b - a == m  # a decode step's one block: no views to make
            return forward_cache_rows(step, kv_cache, topk if whole else topk[a:b],
                                      token_req if whole else token_req[a:b], dcp_rank, dcp_world, topk_rows, align,
                                      compact=True)

        return attend_in_blocks(step.arena, q_nope, q_rope, fmt, scale, topk.shape[1], cache_rows, step.plans,
                                compacted=True)
    records, rows = forward_cache_rows(step, kv_cache, topk, token_req, dcp_rank, dcp_world, align=align)
    return sparse_mla_decode(q_nope, q_rope, records, fmt, rows, scale, backend=step.backend, check_indices=False)
