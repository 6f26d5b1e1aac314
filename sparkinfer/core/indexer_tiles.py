"""The tiled indexer's pass width and the device bytes one batched call allocates (torch-free).

``sparkinfer.indexer.tiled.indexer_topk_rows`` scores ``tile`` list positions of all M rows per
pass (``pick_tile``) into an int64 work buffer [M, k + tile]; ``topk_rows_bytes`` is everything
one call with the Triton scorer works in besides its output, counted per tensor
(``tests/core/test_reservations.py`` checks it against the allocations the call makes,
``sparkinfer.testing.host_reads``):

=======================  ===========================  =============
work (running top-k)     int64 [M, k + tile]          8 M (k + tile)
top-k (values, indices)  int64 [M, k] x 2             16 M k
=======================  ===========================  =============

(the Triton top-k uses the two as one candidate buffer int64 [M, 2k], ``triton_topk``). So
``8 M tile + 24 M k`` bytes (``tiled.TopkWorkspace``; the last pass's top-k is sorted and the ids
are unpacked into the caller's int32 [M, k] output in place), fixed by M and k whatever the
context length, since ``tile <= TILE_BYTES / (8 M)``. A serving engine holds one workspace that
every call of its steps fits in (``engine_workspace_bytes``), so a step allocates none of it.
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
    """Device bytes of the workspace one Triton ``indexer_topk_rows`` call of M rows works in (table above)."""
    if m <= 0:
        return 0
    return pass_workspace_bytes(m, k, pick_tile(m, max_len, TRITON_BYTES_PER_COL, tile_bytes))


def pass_workspace_bytes(m: int, k: int, tile: int) -> int:
    """The table's bytes for M rows, top-k and passes of ``tile`` positions."""
    return 8 * m * (k + tile) + 16 * m * k


def workspace_bytes(rows: int, k: int, max_len: int, tile_bytes: int) -> int:
    """A workspace every call of at most ``rows`` rows, ``k`` and ``max_len`` fits in: the largest
    ``topk_rows_bytes`` over M <= rows (fewer rows take wider passes, so the largest M need not be
    the largest call)."""
    return max((topk_rows_bytes(m, k, max_len, tile_bytes) for m in range(1, rows + 1)), default=0)


# The engine's batched call (``vllm.replicated_indexer``): a step's rows in blocks of at most
# INDEXER_ROWS, each pass at most ENGINE_TILE_BYTES of keys, so its one workspace
# (``engine_workspace_bytes``) is ENGINE_TILE_BYTES + 24 x INDEXER_ROWS x k whatever the step's
# token budget, and the sharded merge 88 x INDEXER_ROWS x k at DCP4 (``merge_bytes``): 19 MiB and
# 11 MiB at k 2048 (they were 88 and 88 at 512 rows and 64 MiB). Neither changes a result, and
# neither costs scoring work: every query row loads its own keys (one program per row), so a
# smaller block reads no key twice more, and a pass's tile stays 32,768 positions (16 MiB / (8 B x
# 64 rows)), so the running top-k's extra k columns per pass are 6% of the positions scored. What a
# smaller block adds is launches and, when scoring is sharded, one all-gather per block: a
# prefill chunk of 2,048 rows is 32 blocks per Full layer, run eagerly (a decode step of up to 64
# rows, max_num_seqs 16 x 4 at the main profile, is one block).
INDEXER_ROWS = 64
ENGINE_TILE_BYTES = 16 << 20


def engine_workspace_bytes(step_rows: int, k: int, max_model_len: int) -> int:
    """The engine's indexer workspace: every block of a step of ``step_rows`` rows (vLLM's token
    budget), top-``k``, context up to ``max_model_len``, scored tiled or paged."""
    rows = min(step_rows, INDEXER_ROWS)
    paged = max((paged_workspace_bytes(m, k, paged_tile(max_model_len)) for m in range(1, rows + 1)), default=0)
    return max(workspace_bytes(rows, k, max(max_model_len, k), ENGINE_TILE_BYTES), paged)


# The paged top-k (``indexer.triton_paged``: a row scores its request's pages and selects in one
# program per split, looping to the row's length read on the device): ``paged_splits(M)`` programs
# per row, so a step of few rows still spreads over the GPU (about 2 waves of 132 SMs at any M up to
# 256), each keeping a running top-k of k + PAGED_TILE keys. Both follow the rows only, never the
# contexts, so a captured graph's launch fits every step of its batch size. A larger tile selects
# less often per position (a select scans k + tile keys a radix level: (k + tile) / tile of a scan
# per position): 8,192 took the decode step's issue from 162.4 to 155.9 us on the H200 (2026-12-07,
# kernel_report.py); 16,384 (152.8) would hold 41 MiB and a 38 MB working set of work rows against
# the H200's 50 MB L2. At k 2,048 the buffers are 8 x 256 x (2 k + 8,192) + 8 x 64 x k = 25 MiB at
# most (64 rows), above the tiled path's 19: engine_workspace_bytes takes the larger.
PAGED_TILE = 8192
PAGED_PROGRAMS = 256
MAX_SPLITS = 16


# Which scorer a step of the Triton backend takes (``vllm.replicated_indexer``). A uniform decode
# step (every request at most 1 + drafts rows) scores pages: its launches follow the rows alone, as the
# FULL graph that replays it needs. A step holding prefill rows is never captured (vLLM runs mixed
# batches piecewise), and there the tiled scorer over host-planned lists costs less: it reads a
# pass's keys once for all of a block's rows, where the paged top-k reads them once per 2 rows. At a
# prefill chunk of 2,048 rows at 128K, kernel_report.py (2026-12-07) puts both at or under their
# memory floors by issue, and the floors are 2.25 ms tiled against 4.65 ms paged (32 blocks of 64
# rows) on the H200, 4.45 against 12.5 ms on the RTX PRO 6000 (docs/design/indexer.md). The lists
# hold every listed position of the step's requests (``_step_rows``: 40 B a position at the plan's
# peak, 20.0 MiB measured at 2^19 positions by torch's profiler on a strided cache, 8 B kept for the
# step), so past LIST_POSITIONS (one 2,048-row chunk at up to 522K context) the step scores pages, in
# the reserved workspace.
LIST_POSITIONS = 1 << 19


def scores_lists(longest_query: int, listed: int, rows_per_req: int) -> bool:
    """Whether a step whose longest request has ``longest_query`` rows and whose requests list
    ``listed`` positions in all scores host-planned lists (tiled) rather than pages (see above)."""
    return longest_query > rows_per_req and listed <= LIST_POSITIONS


def paged_tile(max_len: int) -> int:
    """The paged top-k's positions per running selection for lists up to ``max_len`` (an engine's
    context bound): PAGED_TILE, or fewer when no list is that long (a multiple of 64)."""
    return min(PAGED_TILE, -(-max(max_len, 1) // ALIGN) * ALIGN)


def paged_splits(m: int) -> int:
    """Programs per row of a paged top-k call of M rows."""
    return max(1, min(MAX_SPLITS, PAGED_PROGRAMS // max(m, 1)))


def paged_split_rows() -> int:
    """The most rows a paged call of several splits has (a call of more takes one split a row): the
    size of its split counters."""
    return PAGED_PROGRAMS // 2


def paged_workspace_bytes(m: int, k: int, tile: int) -> int:
    """A paged top-k call's workspace (``TopkWorkspace.take_paged``): a work row int64 [k + tile] per
    program, the splits' heads side by side int64 [M, splits x k] when there are several, and the
    sorted top-k keys int64 [M, k]. (With several splits, the rows' int32 split counters are held
    beside it: 4 x ``paged_split_rows()`` = 512 B, made once.)"""
    splits = paged_splits(m)
    return 8 * m * (splits * (k + tile) + (splits * k if splits > 1 else 0) + k)


def merge_bytes(world: int, rows: int, k: int) -> int:
    """A sharded step's merge (``indexer.sharded.MergeBuffers``) of ``rows`` rows over ``world``
    ranks' top-``k`` int64 keys: this rank's [M, k], the gathered and the side-by-side [M, world k],
    topk's values and indices [M, k]."""
    return 8 * rows * k * (2 * world + 3)

