"""Byte layout of the exchange slabs (torch-free; both fabrics map the same layout).

Per rank, for ``depth`` in-flight exchanges ("slots"; exchange number ``seq`` uses slot
``seq % depth``) and ``world`` peers, each region holding up to ``max_layers * capacity`` records of
``width`` bytes, packed layer-major ``[J, n, width]`` with the actual count ``n``::

    send slab (private to the rank)      [depth][world dst][region_bytes]
    receive segment (peers write it)     flags | [depth][world src][region_bytes]
    flags: three int64 words per peer, each on its own 64-byte line so peers never share a line
        arrive[src]  last exchange seq whose region from src has fully landed here
        ack[dst]     last exchange seq whose region from this rank dst has consumed (slot reusable)
        abort[src]   nonzero once src gave up (1 + bitmask of the peers it was missing)

Regions start on 256-byte boundaries so 16-byte vector copies and DMA stay aligned.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

FLAG_STRIDE = 8  # int64 words between flags (64-byte lines)
REGION_ALIGN = 256
ARRIVE, ACK, ABORT = 0, 1, 2


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class SlabLayout:
    world: int
    width: int
    capacity: int    # records per (source, destination) pair per layer per exchange round
    max_layers: int  # layers one exchange may carry
    depth: int = 2   # exchanges in flight before a slot is reused

    def __post_init__(self):
        for name in ("world", "width", "capacity", "max_layers", "depth"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"SlabLayout.{name} must be a positive int, got {v!r}")
        if self.world > 63:
            raise ValueError(f"world size {self.world} > 63 is not supported (peer bitmasks are int64)")

    @property
    def region_bytes(self) -> int:
        return _align(self.max_layers * self.capacity * self.width, REGION_ALIGN)

    def slot(self, seq: int) -> int:
        return seq % self.depth

    def send_offset(self, seq: int, dst: int) -> int:
        return (self.slot(seq) * self.world + dst) * self.region_bytes

    @property
    def send_bytes(self) -> int:
        return self.depth * self.world * self.region_bytes

    def flag_index(self, kind: int, peer: int) -> int:
        """int64 word index of flag ``kind`` (ARRIVE/ACK/ABORT) for ``peer`` in a receive segment."""
        return (kind * self.world + peer) * FLAG_STRIDE

    @property
    def flags_bytes(self) -> int:
        return _align(3 * self.world * FLAG_STRIDE * 8, REGION_ALIGN)

    def recv_offset(self, seq: int, src: int) -> int:
        return self.flags_bytes + (self.slot(seq) * self.world + src) * self.region_bytes

    @property
    def segment_bytes(self) -> int:
        return self.flags_bytes + self.depth * self.world * self.region_bytes

    def nbytes(self, n_layers: int, count: int) -> int:
        """Bytes of one packed region carrying ``count`` records of ``n_layers`` layers."""
        if not 0 <= count <= self.capacity or not 0 <= n_layers <= self.max_layers:
            raise ValueError(f"region of {n_layers} layers x {count} records exceeds the slab "
                             f"({self.max_layers} layers x {self.capacity} records)")
        return n_layers * count * self.width

    def config(self) -> dict:
        return asdict(self)


def rotated_peers(rank: int, world: int) -> list[int]:
    """Peers in the order rank+1, rank+2, ...: each rank starts on a different link, so at any
    moment the copies in flight target distinct destinations and all links stay busy."""
    return [(rank + k) % world for k in range(1, world)]


def chunk_rounds(max_count: int, capacity: int) -> int:
    """Exchange rounds needed to move ``max_count`` records per pair through ``capacity`` slots."""
    return max(1, -(-max_count // capacity))
