"""Every device buffer the selected path holds on a rank, sized once at engine start (torch-free).

(The attention's output, LSE and scratch live in the attention arena, held in every mode:
``core.attention_workspace``.)

The engine (``sparkinfer.vllm.reservations``, patch 0008) reserves the sum out of vLLM's KV memory
before vLLM turns it into KV blocks, the worker's runtime allocates exactly these buffers from the
same ``SelectedSizing`` at engine start, and ``sparkinfer plan --json`` lists them. Per rank:

=====================  ====================================================================
prefetch_ring          uint8 ``[depth + 1, slot_rows, W]``: the workspaces of the layer being
                       attended plus ``depth`` prefetched ones; ``slot_rows = pool_mb MiB /
                       ((depth + 1) W)``; a decode step uses ``B x R x K`` rows of a slot, a
                       gathered step ``B x T`` (past a slot's rows: the whole ring as one slot)
exchange_recv          the receive segment (``core.slab``): flags + 2 slots x ``depth + 1``
                       layers x ``capacity`` records, ``capacity = max_batch x R x K``: what one
                       destination can receive in a decode step over all its sources together
                       (the union of its rows), never ``B x R x K`` from every peer
exchange_send          the send slab, only for host sizing: ``send_capacity`` records per
                       (slot, destination, layer); with device sizing (GPU) decode steps write
                       straight into the peers' regions and only gathered steps use it, in rounds
                       of at most ``capacity / SEND_SHARE`` records per pair
exchange_index         int32 identity table and zero column [capacity] of the device-sized unpack
stashed_records        uint8 ``[max(max_batch x R, step_tokens), W]``: one layer's own records of
                       the step, encoded at its cache write and held until its attention (a
                       gathered step's rows are at most ``step_tokens``, vLLM's
                       ``max_num_batched_tokens``)
indexer_workspace      the replicated indexer's top-k workspace (``indexer.tiled.TopkWorkspace``),
                       every block of a step in it: blocks of up to ``min(step rows, INDEXER_ROWS)``
                       rows, passes of ``ENGINE_TILE_BYTES`` (``core.indexer_tiles``:
                       ``8 M (k + tile) + 16 M k`` at its largest M, context ``max_model_len``)
indexer_merge          the sharded indexer's merge buffers (``indexer.sharded.MergeBuffers``) for
                       ``M = max(max_num_seqs x R, INDEXER_ROWS)`` rows (a decode step, or one block
                       of a larger step, which is scored and merged block by block): int64 keys
                       ``[M, k]`` x 3 and ``[M, dcp x k]`` x 2 (``core.indexer_tiles.merge_bytes``);
                       held wherever ``indexer_scoring`` may pick sharded, reserved at every DCP > 1
group_plan             a Full layer's plan of its group (``sparkinfer.decode.group_plan``), ``E = max_batch x
                       R x K`` entries: union, remap and workspace slots int32 ``[E]``, the union
                       kernel's scratch int32 ``[max_batch x union_scratch_ints(R x K)]``, counts
                       ``[max_batch]``, the workspace patch (own / kept bool ``[E]``, new / store rows
                       int32 ``[E]``), sends per request and source ``[max_batch, dcp]``, the planes
                       (req / local / slot int32 ``[dcp, E]``: every destination's list from one
                       source is the same, count ``[dcp, dcp]``)
replica_store          ``window x max_num_seqs x layers x W`` (``sparkinfer.vllm.replica_budget``;
                       its window depends on what the other buffers left)
=====================  ====================================================================

``max_batch = min(max_num_seqs, slot_rows // (R x K))``: a decode step holds at most that many
requests on the selected path (a larger one runs stock).
"""

from __future__ import annotations

from dataclasses import dataclass

from sparkinfer.core.slab import SlabLayout
from sparkinfer.core.indexer_tiles import INDEXER_ROWS, engine_workspace_bytes, merge_bytes

SLAB_DEPTH = 2  # exchanges in flight in the slabs (a group's exchange and the next one)
SEND_SHARE = 16  # device sizing: the send slab (gathered steps only) holds capacity / SEND_SHARE per pair


@dataclass(frozen=True)
class SelectedSizing:
    dcp: int
    record_bytes: int
    max_num_seqs: int
    rows: int  # R: 1 + speculative tokens
    topk: int  # K
    prefetch_depth: int
    pool_mb: int
    sizing: str  # "device" or "host" (comm.exchange)
    # vLLM's max_num_batched_tokens and max_model_len (0: decode steps only, max_batch x R rows)
    step_tokens: int = 0
    max_model_len: int = 0

    def __post_init__(self):
        if self.sizing not in ("device", "host"):
            raise ValueError(f"sizing must be device or host, got {self.sizing!r}")
        for name in ("dcp", "record_bytes", "max_num_seqs", "rows", "topk", "pool_mb"):
            if getattr(self, name) < 1:
                raise ValueError(f"SelectedSizing.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def slot_rows(self) -> int:
        """Rows of one ring slot (a decode step's ``B x R x K`` must fit them; a gathered step's ``B x T``
        the whole ring: ``gather_rows``)."""
        return self.pool_mb * 2**20 // (self.record_bytes * (self.prefetch_depth + 1))

    @property
    def gather_rows(self) -> int:
        """Rows a gathered step may hold: the whole ring, viewed as one slot when the step passes one
        (``comm.ring.PrefetchRing.widen``)."""
        return (self.prefetch_depth + 1) * self.slot_rows

    @property
    def union_rows(self) -> int:
        """U = R x K: the workspace rows of one request in a decode step."""
        return self.rows * self.topk

    @property
    def max_batch(self) -> int:
        return min(self.max_num_seqs, self.slot_rows // self.union_rows)

    def slab(self) -> SlabLayout:
        """The exchange slabs: a decode step's pairs move in one round (``capacity >= B x R x K``)."""
        cap = max(self.dcp - 1, self.max_batch * self.union_rows)
        send = cap if self.sizing == "host" else max(1, cap // SEND_SHARE)
        return SlabLayout(self.dcp, self.record_bytes, capacity=cap, max_layers=self.prefetch_depth + 1,
                          depth=SLAB_DEPTH, send_capacity=send)

    def group_plan_bytes(self) -> int:
        """The ``group_plan`` row of the table."""
        b, e, d = max(1, self.max_batch), max(1, self.max_batch) * self.union_rows, self.dcp
        return 4 * (3 * e + b * union_scratch_ints(self.union_rows) + b + 2 * e + b * d + 3 * d * e + d * d) + 2 * e

    def buffers(self) -> dict[str, int]:
        """Bytes per rank of every buffer but the replica store, by name."""
        slab = self.slab()
        return {
            "prefetch_ring": (self.prefetch_depth + 1) * self.slot_rows * self.record_bytes,
            "exchange_recv": slab.segment_bytes,
            "exchange_send": slab.send_bytes,
            "exchange_index": 2 * 4 * slab.capacity,
            "stashed_records": self.step_rows * self.record_bytes,
            "indexer_workspace": engine_workspace_bytes(self.step_rows, self.topk, self.max_model_len),
            "indexer_merge": (merge_bytes(self.dcp, max(self.max_num_seqs * self.rows, INDEXER_ROWS), self.topk)
                              if self.dcp > 1 else 0),
            "group_plan": self.group_plan_bytes(),
        }

    @property
    def step_rows(self) -> int:
        """The most rows a step holds: a decode step's ``max_batch x R`` or vLLM's token budget."""
        return max(max(1, self.max_batch) * self.rows, self.step_tokens)


def union_scratch_ints(n: int) -> int:
    """int32 scratch one request of ``n = R x K`` top-k entries needs in the union kernel
    (``csrc/include/sparkinfer/union.h``, ``workspace_ints``): a table of the power of two >= 2n
    slots (keys and values), then two per-entry columns."""
    cap = 2
    while cap < 2 * n:
        cap <<= 1
    return 2 * cap + 2 * n


EXCHANGE_BUFFERS = ("exchange_recv", "exchange_send", "exchange_index")


def exchange_bytes(reservations: dict[str, int]) -> int:
    """The exchange buffers among ``reservations`` (issue #16's bound: <= 512 MiB per rank)."""
    return sum(reservations.get(k, 0) for k in EXCHANGE_BUFFERS)
