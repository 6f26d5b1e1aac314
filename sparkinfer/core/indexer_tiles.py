"""The tiled indexer's pass width and the device bytes one batched call allocates (torch-free).

``sparkinfer.indexer.tiled.indexer_topk_rows`` scores ``tile`` list positions of all M rows per
pass (``pick_tile``) into an int64 work buffer [M, k + tile]; ``topk_rows_bytes`` is everything
one call with the Triton scorer allocates, counted per tensor (``tests/test_reservations.py``
checks it against the allocations the call makes, ``sparkinfer.vllm.host_reads``):

=======================  ===========================  =============
work (running top-k)     int64 [M, k + tile]          8 M (k + tile)
top, its topk indices    int64 [M, k] x 2             16 M k
final sort               int64 values + indices       16 M k
unpack_keys              bool, 4 x int64, int32       37 M k
=======================  ===========================  =============

So ``8 M tile + 77 M k`` bytes: a bound on the call's peak (not all of it is live at once), fixed by
M and k whatever the context length, since ``tile <= TILE_BYTES / (8 M)``.
"""

from __future__ import annotations

TILE_BYTES = 256 << 20  # budget of a pass's scored columns: M * tile * 8 B (Triton), M * tile * 8 * (3 Hi + 4) B (torch)
ALIGN = 64  # tiles are a whole number of the kernel's BLOCK_T (triton_scores.BLOCK_T)
MAX_TILE = 65535 * 64  # a pass is one launch: at most 65,535 programs on grid axis 1
TRITON_BYTES_PER_COL = 8  # one int64 key per scored position


def pick_tile(m: int, max_len: int, bytes_per_col: int, tile_bytes: int) -> int:
    """Positions per pass: as many as tile_bytes allows for M rows (at most 65,535 x 64), a multiple
    of 64, at least 64, no more than max_len needs."""
    cols = max(ALIGN, min(MAX_TILE, tile_bytes // max(1, bytes_per_col * m)) // ALIGN * ALIGN)
    return min(cols, -(-max(max_len, 1) // ALIGN) * ALIGN)


def topk_rows_bytes(m: int, k: int, max_len: int, tile_bytes: int = TILE_BYTES) -> int:
    """Device bytes one Triton ``indexer_topk_rows`` call of M rows allocates (ids only; table above)."""
    if m <= 0:
        return 0
    tile = pick_tile(m, max_len, TRITON_BYTES_PER_COL, tile_bytes)
    return 8 * m * tile + 77 * m * k


# The engine's batched call (``vllm.replicated_indexer``): a step's rows in blocks of at most
# INDEXER_ROWS, each pass at most ENGINE_TILE_BYTES of keys, so the reserved workspace is
# topk_rows_bytes(min(step rows, INDEXER_ROWS), k, max_model_len, ENGINE_TILE_BYTES) whatever the
# step's token budget: 64 MiB + 77 x 512 x k (141 MiB at k 2048). Neither changes a result.
INDEXER_ROWS = 512
ENGINE_TILE_BYTES = 64 << 20
