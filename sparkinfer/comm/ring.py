"""Prefetch ring: workspaces for the current layer plus ``depth`` layers ahead.

Decode: at a Full layer F the indexer's top-k gives the planes; F and the Shared layers that reuse
its top-k (``IndexSharePattern.prefetch_targets(F, depth)``) travel in ONE layered exchange (one
destination map, one copy per pair, one barrier) into consecutive ring slots. Attention at layer l
calls ``get(l)`` and ``release(l)`` once its attention is enqueued. ``get(l)`` waits only for
layer l's section of the exchange (per-layer arrival, ``exchange.py``): F's attention starts once
F's records landed while the Shared layers' records are still moving, which is what makes the
prefetch of depth N overlap; the exchange completes (region released) at its last layer's release. Prefill: ``prefill_planes`` describes every rank's whole shard, so the same
ring gathers the full CKV of layer l + depth while layer l computes.

Buffer: uint8 ``[depth + 1, rows, width]`` allocated once; ``rows = B * U`` (decode) or
``B * T`` (prefill: row ``b * T + t`` holds token t). An exchange of J layers takes J consecutive
slots (wrapping to slot 0 when they would run past the end), which must all be released. Between
steps the same bytes can be viewed as ONE slot of ``(depth + 1) * rows`` rows (``widen``): a
gathered step larger than a slot then takes its layers one at a time, without prefetch overlap,
where it would otherwise run stock (``docs/design/memory.md``: the ring is sized by the decode
batch, and a prefill chunk's whole prefix is far larger than a decode step's union).

Overwrite safety: a slot is handed out again only after ``release``; the unpack / own-record
kernels that overwrite it are enqueued after that call on the same stream as the attention that
read it (host fabric: they run after it), so stream order keeps the old contents alive until
attention consumed them. Reusing a slot that is still held raises instead of corrupting it.
"""

from __future__ import annotations

import torch

from sparkinfer.core.topology import DcpLayout, IndexSharePattern
from sparkinfer.plan import build_planes

from .exchange import Pending, SelectedExchange
from .pack import Shard


class PrefetchRing:
    def __init__(self, exchange: SelectedExchange, depth: int, rows: int):
        if depth < 0 or rows < 1:
            raise ValueError(f"ring needs depth >= 0 and rows >= 1, got depth={depth}, rows={rows}")
        self.exchange = exchange
        self.depth = depth
        lay = exchange.layout
        self._slots = torch.zeros(depth + 1, rows, lay.width, dtype=torch.uint8, device=exchange.fabric.device)
        self.buf = self._slots  # [slots, rows per slot, width]: the slots, or one slot of them all (widen)
        self.slot_rows = rows
        self._held: list[int | None] = [None] * (depth + 1)  # layer in each slot
        self._slot: dict[int, int] = {}
        self._pending: dict[int, tuple[Pending, int]] = {}  # layer -> (its exchange, index in it)
        self._layer_ids: dict[tuple, torch.Tensor] = {}  # int32 layer lists handed to the exchange
        self._next = 0

    def widen(self, wide: bool) -> None:
        """View the ring as one slot holding every row (``wide``) or as its ``depth + 1`` slots; only
        while no slot is held (between steps). ``depth`` follows: 0 when wide."""
        n = 1 if wide else self._slots.shape[0]
        if self.buf.shape[0] == n:
            return
        held = [l for l in self._held if l is not None]
        if held:
            raise RuntimeError(f"the ring's slots can only be regrouped between steps; layer(s) {held} are held")
        self.buf = self._slots.view(n, -1, self._slots.shape[2])
        self.depth, self._held, self._next = n - 1, [None] * n, 0

    def prefetch(self, planes, shard: Shard, layers: list[int], sizing: str | None = None,
                 rows: int | None = None) -> Pending:
        """Start one layered exchange of ``layers`` into the next free ring slots (its ``stats`` are
        complete once a layer of it was fetched with ``get``); ``sizing``: the exchange's default or
        ``host``/``device`` for this one; ``rows``: the exchange writes the slots' first ``rows`` rows
        only (a device-sized exchange needs planes covering its workspace, so a ring sized for
        larger gathered steps hands decode exchanges a view of ``B * U`` rows)."""
        s = self._free_slots(layers)
        ws = self.buf[s: s + len(layers)] if rows is None else self.buf[s: s + len(layers), :rows]
        pending = self.exchange.start(planes, shard, self._ids(layers), ws, sizing)
        self._assign(s, layers)
        for j, layer in enumerate(layers):
            self._pending[layer] = (pending, j)
        return pending

    def reserve(self, layers: list[int]) -> None:
        """Ring slots for ``layers`` with no exchange: every record they need is already local (the
        caller fills the workspaces), so nothing is packed, copied or waited for."""
        self._ids(layers)  # a later step's exchange of them then finds their ids made
        self._assign(self._free_slots(layers), layers)

    def _ids(self, layers: list[int]) -> torch.Tensor:
        """int32 ``layers`` on the device: a model's layer groups are fixed, so built once, then reused."""
        key = tuple(layers)
        if key not in self._layer_ids:
            self._layer_ids[key] = torch.tensor(key, dtype=torch.int32, device=self.buf.device)
        return self._layer_ids[key]

    def _free_slots(self, layers: list[int]) -> int:
        """First of the ``len(layers)`` consecutive slots the layers take next (checked free)."""
        J = len(layers)
        if not 1 <= J <= self.depth + 1:
            raise ValueError(f"{J} layers do not fit a ring of {self.depth + 1} slots")
        dup = [l for l in layers if l in self._slot]
        if dup:
            raise ValueError(f"layer(s) {dup} are already in the ring")
        s = self._next if self._next + J <= self.depth + 1 else 0
        busy = [(k, self._held[k]) for k in range(s, s + J) if self._held[k] is not None]
        if busy:
            raise RuntimeError(f"prefetch ring full: slot(s) {[k for k, _ in busy]} still hold layer(s) "
                               f"{[l for _, l in busy]}; release() each layer after its attention")
        return s

    def _assign(self, s: int, layers: list[int]) -> None:
        J = len(layers)
        for j, layer in enumerate(layers):
            self._held[s + j] = layer
            self._slot[layer] = s + j
        self._next = (s + J) % (self.depth + 1)

    def get(self, layer: int) -> torch.Tensor:
        """uint8 [rows, width] workspace of ``layer``, its records landed (the exchange's later
        layers may still be in flight)."""
        if layer not in self._slot:
            raise ValueError(f"layer {layer} was not prefetched into the ring (held: {sorted(self._slot)})")
        if layer in self._pending:
            self.exchange.finish_layer(*self._pending[layer])
        return self.buf[self._slot[layer]]

    def release(self, layer: int) -> None:
        """Attention of ``layer`` is done (or enqueued on the exchange's stream): its slot may be reused."""
        if layer not in self._slot:
            raise ValueError(f"layer {layer} is not in the ring")
        entry = self._pending.pop(layer, None)
        if entry is not None:  # never recycle a slot an unpack may still write
            self.exchange.finish_layer(*entry)
            if not any(p is entry[0] for p, _ in self._pending.values()):
                self.exchange.finish(entry[0])  # its last layer: release the region
        self._held[self._slot.pop(layer)] = None


def decode_groups(pattern: IndexSharePattern, depth: int) -> list[list[int]]:
    """Layers exchanged together in a decode step: each Full layer with its prefetch targets."""
    return [[f] + pattern.prefetch_targets(f, depth) for f in pattern.full_layers]


def prefix_union(seq_lens: torch.Tensor):
    """``union`` int32 [B, T] (T = the longest) = positions 0 .. seq_lens[b] - 1 of each request, -1
    after them, and ``counts`` int32 [B]: the union of a full-prefix gather (one host read)."""
    T = int(seq_lens.max())
    t = torch.arange(T, device=seq_lens.device)
    union = torch.where(t[None, :] < seq_lens[:, None], t[None, :], -1).to(torch.int32)
    return union, seq_lens.to(torch.int32)


def prefill_planes(seq_lens: list[int], dcp: DcpLayout, device="cpu"):
    """Planes that move every rank's whole shard to every rank: workspace row ``b * T + t`` holds
    token t of request b (T = max seq_len), i.e. the unsharded cache, for the prefill ring."""
    union, counts = prefix_union(torch.tensor(seq_lens, device=device))
    B, T = union.shape
    return build_planes(union, counts, dcp, capacity=B * dcp.max_local_len(T))
