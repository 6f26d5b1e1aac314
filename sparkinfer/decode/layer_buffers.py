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


def attend_in_blocks(arenas: AttentionArena, q_nope: torch.Tensor, q_rope: torch.Tensor, fmt, scale: float, k: int,
                     indices):
    """(out [M, H, 512], lse float32 [M, H]) of the forward's Triton sparse-MLA attention over q_nope's
    M rows and H heads with K indices per row, in blocks of ``BLOCK_ROWS`` rows, every buffer a view of
    the arena: ``indices(a, b, topk_rows)`` gives rows [a, b)'s (records, indices [b - a, K]) (the
    paged path maps its top-k into ``topk_rows``, the block's int64 [b - a, K] arena view; the
    selected path's slots are already rows of its workspace). out is bf16 for bf16 queries (the decode kernel rounds it: no cast after the layer's
    attention), else float32."""
    from sparkinfer.attention import sparse_mla_decode
    from sparkinfer.attention.triton_decode import BLOCK_H, DecodeWorkspace, default_num_splits

    m, h = q_nope.shape[:2]
    device = q_nope.device
    out_dtype = torch.bfloat16 if q_nope.dtype == torch.bfloat16 else torch.float32
    need, blocks = call_plan(m, h, k, out_dtype.itemsize, lambda n: default_num_splits(n, h, k, device))
    arena = arenas.take(need)
    out = arena.view("out", out_dtype, (m, h, LATENT_DIM))
    lse = arena.view("lse", torch.float32, (m, h))
    for a, b, s in blocks:
        n = b - a
        many = s > 1
        ws = DecodeWorkspace(arena.view("indices", torch.int64, (n, k)),
                             arena.view("partial_out", torch.float32, (s, n, h, LATENT_DIM)) if many else None,
                             arena.view("partial_lse", torch.float32, (s, n, h)) if many else None,
                             arena.view("tickets", torch.int32, (n, -(-h // BLOCK_H))) if many else None)
        records, rows = indices(a, b, arena.view("topk_rows", torch.int64, (n, k)))
        sparse_mla_decode(q_nope[a:b], q_rope[a:b], records, fmt, rows, scale, backend="triton", check_indices=False,
                          out=out[a:b], lse=lse[a:b], workspace=ws)
    return out, lse


def record_inputs(arenas: AttentionArena, latent: torch.Tensor, rope):
    """(latent, rope) as the float32 contiguous tensors the record encoders read: as they are when
    they already are, else copied into the arena's ``record_latent`` / ``record_rope`` (a bf16
    model's cache write, in the forward: no allocation)."""
    def staged(t, name):
        if t is None or (t.dtype == torch.float32 and t.is_contiguous()):
            return t
        view = arenas.take({name: 4 * t.numel()}).view(name, torch.float32, tuple(t.shape))
        return view.copy_(t)

    return staged(latent, "record_latent"), staged(rope, "record_rope")


def record_rows(arenas: AttentionArena, n: int, width: int) -> torch.Tensor:
    """uint8 [n, width]: a cache write's encoded records on their way into a strided cache."""
    return arenas.take({"record_rows": n * width}).view("record_rows", torch.uint8, (n, width))


def indexer_q_buffers(arenas: AttentionArena, n: int, d: int, group_size: int):
    """(q float8_e4m3fn [N, D], scales float32 [N, D // group_size]): the indexer's quantized q, which
    the layer's indexer op consumes (the scales are folded into its weights first)."""
    arena = arenas.take({"indexer_q": n * d, "indexer_scales": 4 * n * (d // group_size)})
    return (arena.view("indexer_q", torch.float8_e4m3fn, (n, d)),
            arena.view("indexer_scales", torch.float32, (n, d // group_size)))
