"""The attention arena: the buffers a layer's forward writes and consumes before the next layer runs,
views of one device allocation made at engine start (``core.attention_workspace`` has the layout).

What lives here: the attention's output and LSE, the decode kernel's scratch and the top-k's cache
rows (a block of ``BLOCK_ROWS`` rows at a time: ``attend_in_blocks``), and the indexer's quantized
q. Every call overwrites what the previous one left, so only what a layer consumes before the next
call may live here (an attention output is up-projected or LSE-merged in its layer, the quantized q
is read by the layer's indexer op); the launches are stream-ordered, so on a GPU the layer's reads
come before the next layer's writes. Only the forward's forms use it (through their step's
``forward_step.ForwardStep``; the indexer's q quantization inside vLLM's forward): a direct call
returns tensors of its own.

Each worker holds one ``AttentionArena`` (``runtime.WorkerRuntime.arena``), allocated at engine
start (``reserve``, from ``sparkinfer.vllm.engine_start``) with the bytes patch 0008 reserved out of
the KV memory (``reservations``: ``attention_workspace``). A call the arena cannot hold (a step
larger than the scheduler's budget, or no arena reserved) gets a larger arena, allocated there and
then; after a reservation that is logged once, since those bytes are outside the KV budget.
"""

from __future__ import annotations

import logging
import math

import torch

from sparkinfer.core.attention_workspace import LATENT_DIM, ZEROED, arena_bytes, call_plan, offsets

log = logging.getLogger(__name__)


class Arena:
    """One uint8 device buffer holding named segments ({name: bytes}); ``view`` types a segment's head."""

    def __init__(self, segments: dict[str, int], device, reserved: bool = False):
        self.segments = dict(segments)
        self.reserved = reserved
        self._at = offsets(self.segments)
        self.buf = torch.empty(arena_bytes(self.segments), dtype=torch.uint8, device=device)
        for name in ZEROED:  # the decode's merge tickets: every call leaves them zero again
            if name in self._at:
                at, size = self._at[name]
                self.buf[at:at + size].zero_()

    def fits(self, need: dict[str, int]) -> bool:
        return all(size <= self.segments.get(name, 0) for name, size in need.items())

    def view(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The first ``prod(shape)`` elements of segment ``name`` as a contiguous ``dtype`` tensor."""
        at, size = self._at[name]
        n = math.prod(shape) * dtype.itemsize
        assert n <= size, f"segment {name} holds {size} B, a view of {n} B asked for: grow the arena first (AttentionArena.take)"
        return self.buf[at:at + n].view(dtype).view(shape)


class AttentionArena:
    """A worker's arena (``runtime.WorkerRuntime.arena``): reserved at engine start (``reserve``), grown
    when a call needs more than it holds (``take``)."""

    def __init__(self, device):
        self.device = device
        self.arena: Arena | None = None

    def reserve(self, segments: dict[str, int]) -> Arena:
        """Allocate the arena at engine start, ``segments`` as reserved out of the KV memory
        (``AttentionWorkspace.segments()``)."""
        self.arena = Arena(segments, self.device, reserved=True)
        return self.arena

    def held_bytes(self) -> int:
        """Bytes of the arena (0 if none)."""
        return 0 if self.arena is None else self.arena.buf.numel()

    def take(self, need: dict[str, int]) -> Arena:
        """The arena, grown first when it cannot hold ``need`` ({segment: bytes})."""
        arena = self.arena
        if arena is not None and arena.fits(need):
            return arena
        segments = dict(arena.segments) if arena is not None else {}
        for name, size in need.items():
            segments[name] = max(size, segments.get(name, 0))
        if arena is not None and arena.reserved:
            log.warning("sparkinfer: a layer's attention needs %s, more than the attention workspace reserved at "
                        "engine start; %.1f MiB allocated outside the KV budget (max_num_batched_tokens or "
                        "max_num_seqs larger than the engine was started with?)",
                        {k: v for k, v in need.items() if v > arena.segments.get(k, 0)},
                        arena_bytes(segments) / 2**20)
        self.arena = Arena(segments, self.device)
        return self.arena


class AttentionPlan:
    """Everything one attention shape needs beyond its layer's inputs, resolved once: the arena views of
    the output, the LSE and each block's scratch, the blocks (``call_plan``), the record layout. A
    step's layers share one (``ForwardStep.plans``): the first layer resolves it, the others only
    launch. ``arena`` is the ``Arena`` it views (a plan over an arena grown since is made again)."""

    def __init__(self, arenas: AttentionArena, m: int, h: int, k: int, q_dtype: torch.dtype, fmt, device):
        from sparkinfer.attention.dispatch import pick_backend
        from sparkinfer.attention.triton_decode import BLOCK_H, DecodeWorkspace, default_num_splits
        from sparkinfer.attention.validate import resolve_layout

        pick_backend("triton", device.type == "cuda", "sparse_mla_decode")  # counted once per plan (impls.probe_counts)
        self.layout = resolve_layout(fmt)
        self.outer_scale = float(getattr(fmt, "outer_scale", 1.0))
        out_dtype = torch.bfloat16 if q_dtype == torch.bfloat16 else torch.float32
        need, blocks = call_plan(m, h, k, out_dtype.itemsize, lambda n: default_num_splits(n, h, k, device))
        self.arena = arena = arenas.take(need)
        self.out = arena.view("out", out_dtype, (m, h, LATENT_DIM))
        self.lse = arena.view("lse", torch.float32, (m, h))
        self.blocks = []  # (a, b, the decode's workspace, the block's int64 [b - a, K] top-k rows)
        for a, b, s in blocks:
            n = b - a
            many = s > 1  # partials and merge tickets for a split row only (the decode kernel rounds bf16)
            ws = DecodeWorkspace(arena.view("indices", torch.int64, (n, k)),
                                 arena.view("partial_out", torch.float32, (s, n, h, LATENT_DIM)) if many else None,
                                 arena.view("partial_lse", torch.float32, (s, n, h)) if many else None,
                                 arena.view("tickets", torch.int32, (n, -(-h // BLOCK_H))) if many else None)
            self.blocks.append((a, b, ws, arena.view("topk_rows", torch.int64, (n, k)), self.out[a:b], self.lse[a:b]))


def attend_in_blocks(arenas: AttentionArena, q_nope: torch.Tensor, q_rope: torch.Tensor, fmt, scale: float, k: int,
                     indices, plans: dict | None = None, compacted: bool = False):
    """(out [M, H, 512], lse float32 [M, H]) of the forward's Triton sparse-MLA attention over q_nope's
    M rows and H heads with K indices per row, in blocks of ``BLOCK_ROWS`` rows, every buffer a view of
    the arena (``AttentionPlan``; taken from ``plans``, the step's, when its layers share it):
    ``indices(a, b, topk_rows)`` gives rows [a, b)'s (records, indices [b - a, K]) (the paged path
    maps its top-k into ``topk_rows``, the block's int64 [b - a, K] arena view; the selected path's
    slots are already rows of its workspace); ``compacted``: each row's valid indices come first (the paged
    path's, ``triton_paging.topk_rows(compact=True)``: the decode copies them instead of compacting
    them). out is bf16 for bf16 queries (the decode kernel
    rounds it: no cast after the layer's attention), else float32. The inputs are the engine's, checked
    where they are made: only the kernels run here."""
    from sparkinfer.attention.triton_decode import sparse_mla_decode_triton

    m, h = q_nope.shape[:2]
    key = (m, h, k, q_nope.dtype, fmt.name, getattr(fmt, "outer_scale", 1.0))
    plan = None if plans is None else plans.get(key)
    if plan is None or plan.arena is not arenas.arena:
        plan = AttentionPlan(arenas, m, h, k, q_nope.dtype, fmt, q_nope.device)
        if plans is not None:
            plans[key] = plan
    for a, b, ws, topk_rows, out, lse in plan.blocks:
        records, rows = indices(a, b, topk_rows)
        whole = b - a == m  # a decode step's one block: no views of the rows to make
        sparse_mla_decode_triton(q_nope if whole else q_nope[a:b], q_rope if whole else q_rope[a:b], records,
                                 plan.layout, rows, scale, outer_scale=plan.outer_scale, out=out, lse=lse, workspace=ws,
                                 compacted=compacted)
    return plan.out, plan.lse


def indexer_q_buffers(arenas: AttentionArena, n: int, d: int, group_size: int):
    """(q float8_e4m3fn [N, D], scales float32 [N, D // group_size]): the indexer's quantized q, which
    the layer's indexer op consumes (the scales are folded into its weights first)."""
    arena = arenas.take({"indexer_q": n * d, "indexer_scales": 4 * n * (d // group_size)})
    return (arena.view("indexer_q", torch.float8_e4m3fn, (n, d)),
            arena.view("indexer_scales", torch.float32, (n, d // group_size)))
