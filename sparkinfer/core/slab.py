"""Byte layout of the exchange slabs (torch-free; both fabrics of ``sparkinfer.comm`` map the same
layout, and the planning core sizes the buffers from it, ``core.reservations``, so it lives here).

Per rank, for ``depth`` in-flight exchanges ("slots"; exchange number ``seq`` uses slot
``seq % depth``) and ``world`` peers::

    receive segment (peers write it)     flags | [depth][region_bytes]
    send slab (private to the rank)      [depth][world dst][send_region_bytes]   (may be empty)
    flags: 3 + max_layers int64 words per peer, each on its own 64-byte line so peers never share one
        arrive[src]     last exchange seq whose region from src has fully landed here
        ack[dst]        last exchange seq whose region from this rank dst has consumed (slot reusable)
        abort[src]      nonzero once src gave up (1 + bitmask of the peers it was missing)
        landed[j][src]  last exchange seq whose layer-j section from src has landed here (per-layer
                        arrival of a host-sized exchange: ``exchange.py``); arrive[src] follows the
                        last section

A destination has ONE receive region per slot, shared by all its sources: ``capacity`` records per
layer over all sources together (a step's union, ``B x R x K``, is at most what one destination
can need), ``max_layers`` layers, ``region_bytes = max_layers x capacity x width``. The sources
write disjoint parts of it:

* device sizing (no count on the host): the region is shaped like the destination's workspace,
  ``[J, capacity, width]`` (layer stride ``capacity x width``), and every source writes record i
  at its own workspace row ``slot[i]``; a row of the union has exactly one owner, so the sources
  never collide and no offset has to be computed at all;
* host sizing (counts read on the host): the sources' packed ``[J, n, width]`` blocks lie one after
  the other (``host_offsets``: each source's byte offset is the exclusive prefix sum of the counts
  of the lower-ranked sources of this round), moved in as many rounds as ``host_window`` needs.

The send slab exists only for host sizing: ``send_capacity`` records per (slot, destination) per
layer (0: no send slab; a host-sized exchange is then refused). Regions start on 256-byte
boundaries so 16-byte vector copies and DMA stay aligned.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

FLAG_STRIDE = 8  # int64 words between flags (64-byte lines)
REGION_ALIGN = 256
ARRIVE, ACK, ABORT = 0, 1, 2
LANDED = 3  # flag kind of layer j's section: LANDED + j


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class SlabLayout:
    world: int
    width: int
    capacity: int    # records per layer one destination receives per round, all sources together
    max_layers: int  # layers one exchange may carry
    depth: int = 2   # exchanges in flight before a slot is reused
    send_capacity: int | None = None  # records per (slot, dst) send region and layer; None: capacity

    def __post_init__(self):
        if self.send_capacity is None:
            object.__setattr__(self, "send_capacity", self.capacity)
        for name in ("world", "width", "capacity", "max_layers", "depth"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"SlabLayout.{name} must be a positive int, got {v!r}")
        if not isinstance(self.send_capacity, int) or self.send_capacity < 0:
            raise ValueError(f"SlabLayout.send_capacity must be an int >= 0, got {self.send_capacity!r}")
        if self.world > 63:
            raise ValueError(f"world size {self.world} > 63 is not supported (peer bitmasks are int64)")
        if self.capacity < self.world - 1:
            raise ValueError(f"SlabLayout.capacity {self.capacity} < world - 1 = {self.world - 1}: every source "
                             "needs at least one record of the shared receive region per round")

    @property
    def region_bytes(self) -> int:
        """One slot's receive region (all sources together)."""
        return _align(self.max_layers * self.capacity * self.width, REGION_ALIGN)

    @property
    def send_region_bytes(self) -> int:
        return _align(self.max_layers * self.send_capacity * self.width, REGION_ALIGN)

    def slot(self, seq: int) -> int:
        return seq % self.depth

    def send_offset(self, seq: int, dst: int) -> int:
        return (self.slot(seq) * self.world + dst) * self.send_region_bytes

    @property
    def send_bytes(self) -> int:
        return self.depth * self.world * self.send_region_bytes

    def flag_index(self, kind: int, peer: int) -> int:
        """int64 word index of flag ``kind`` (ARRIVE/ACK/ABORT, LANDED + j) for ``peer`` in a receive segment."""
        if not 0 <= kind < LANDED + self.max_layers:
            raise ValueError(f"flag kind {kind} outside [0, {LANDED + self.max_layers}) (LANDED + layer < max_layers)")
        return (kind * self.world + peer) * FLAG_STRIDE

    @property
    def flags_bytes(self) -> int:
        return _align((LANDED + self.max_layers) * self.world * FLAG_STRIDE * 8, REGION_ALIGN)

    def recv_offset(self, seq: int) -> int:
        """Byte offset of the slot's shared receive region in a segment."""
        return self.flags_bytes + self.slot(seq) * self.region_bytes

    @property
    def segment_bytes(self) -> int:
        return self.flags_bytes + self.depth * self.region_bytes

    @property
    def device_bytes(self) -> int:
        """Every byte of the slabs of one rank (receive segment and send slab)."""
        return self.segment_bytes + self.send_bytes

    def nbytes(self, n_layers: int, count: int) -> int:
        """Bytes of one packed block carrying ``count`` records of ``n_layers`` layers."""
        if not 0 <= count <= self.capacity or not 0 <= n_layers <= self.max_layers:
            raise ValueError(f"region of {n_layers} layers x {count} records exceeds the slab "
                             f"({self.max_layers} layers x {self.capacity} records)")
        return n_layers * count * self.width

    def host_window(self, counts: list[list[int]]) -> int:
        """Records per pair per round of a host-sized exchange of ``counts`` [src][dst]: the largest
        window ``c`` (at most the send capacity) with ``sum_src min(count, c) <= capacity`` for every
        destination, so each round's blocks fit the shared regions. Every rank computes the same."""
        if self.send_capacity == 0:
            raise ValueError("this slab has no send slab (send_capacity 0): host-sized exchanges need one")
        peers = [[counts[s][d] for s in range(self.world) if s != d] for d in range(self.world)]
        fits = lambda c: all(sum(min(n, c) for n in col) <= self.capacity for col in peers)  # noqa: E731
        lo, hi = 1, max(1, min(self.send_capacity, max((max(col, default=0) for col in peers), default=0)))
        while lo < hi:  # fits() is monotone in c and fits(1) holds (capacity >= world - 1)
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo

    def config(self) -> dict:
        return asdict(self)


def host_offsets(shares: list[int], dst: int) -> list[int]:
    """Record offset of each source's block in ``dst``'s shared region for one host-sized round
    (``shares[src]`` records from src; dst's own entry and the sources before it do not count)."""
    out, acc = [], 0
    for s, n in enumerate(shares):
        out.append(acc)
        if s != dst:
            acc += n
    return out


def rotated_peers(rank: int, world: int) -> list[int]:
    """Peers in the order rank+1, rank+2, ...: each rank starts on a different link, so at any
    moment the copies in flight target distinct destinations and all links stay busy."""
    return [(rank + k) % world for k in range(1, world)]


def chunk_rounds(max_count: int, capacity: int) -> int:
    """Exchange rounds needed to move ``max_count`` records per pair through ``capacity`` slots."""
    return max(1, -(-max_count // capacity))
