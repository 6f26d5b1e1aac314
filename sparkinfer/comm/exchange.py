"""The selected-record exchange protocol, written once for every fabric.

Inputs (every rank holds identical planes: they come from the replicated indexer):

* planes: ``count`` int32 [D, D] (records src sends to dst; the diagonal is a rank's own
  records), ``req`` / ``local`` / ``slot`` int32 [D, D, C] (request, local ordinal on the owner,
  destination workspace row ``b * U + u``; -1 pad), ``overflow`` bool (the planner dropped
  records because some count > C);
* shard: this rank's paged record cache (``pack.Shard``);
* layers: int32 [J] cache layers carried together (a Full layer and the Shared layers that reuse
  its top-k: one destination map, one copy per pair, one barrier);
* workspace: uint8 [J, B*U, width], dense per request in union order.

One exchange = one or more rounds; round ``seq`` on rank r:

1. pack: for each dst in rotated order (r+1, r+2, ...), wait until the send region of
   (slot, dst) is free, then gather the records ``count[r, dst]`` into it ([J, n, width]);
2. copy: wait until dst released the receive region this write reuses (exchange seq - depth),
   then one copy per (r, dst) into r's part of dst's shared receive region (``core/slab.py``),
   followed by ``arrive[r] = seq`` there;
3. own records: copied straight from the shard into the workspace (no slab);
4. arrive + unpack: for each src, wait for ``arrive[src] >= seq``, scatter its part of the region
   into the workspace rows ``slot[src, r]``;
5. release: once every source's part was unpacked, ``ack[r] = seq`` in each src's segment: src
   may reuse the region (exchange seq + depth). The sources share the region, so no source may
   write it again before the destination consumed all of it.

Sequence numbers are monotonic per (src, dst), so a region is never overwritten before its
consumer released it, and ``depth`` exchanges can be in flight (``start`` ... ``finish``).

Per-layer arrival (``layer_arrival``, the default). A layered exchange carries a Full
layer and the Shared layers after it, but each layer is needed at its own attention: F right
away, Shared layer j after the compute of the j layers before it. So step 2 copies each block's
layer sections ``[n, width]`` (the packed block is layer-major, so section j is contiguous), each
followed by ``landed[j][r] = seq``: section 0 right after the block is packed (where the whole
block used to go), the others once every destination's block is packed, layer by layer across
destinations (section j of every pair, then section j + 1), and one 0-byte copy per pair for
``arrive[r] = seq`` after the last. ``finish_layer(pending, j)`` waits for
sections 0..j only and unpacks them; ``finish`` unpacks the rest, waits for the arrivals, releases.
The bytes and the workspace rows are those of the one packed copy; only the completion is split:
F waits for F's records and the Shared sections land while F computes. Cost: ``J`` copies and
signals per pair instead of one (``docs/design/transport.md``, "Prefetch that overlaps").
A device-sized exchange (below) splits the same way: F's sections are stored into every
destination's region on the caller's stream, each publishing ``landed[0]``; the Shared layers'
sections and the arrivals go to the fabric's side stream (``Fabric.on_side_stream``: a CUDA stream
forked after F's sections, a thread on the host fabric), layer by layer across destinations, so
F's attention runs while they move. ``finish`` joins that side work back before the planes it reads
can be rewritten, and any later exchange whose flags could overtake it joins it first.

Sizing. With ``sizing="host"`` (the default) the count plane is read on the host once per
exchange: each copy-engine copy moves exactly the packed bytes, the sources' blocks lie one after
the other in the destination's region (offsets from the counts, ``slab.host_offsets``), and an
exchange whose blocks do not fit is moved in rounds (below). That read waits for the planner's
kernels, and a CUDA graph cannot replay a copy whose size changes, so ``sizing="device"`` never
reads a plane on the host: steps 1-2 become "wait until dst released the region, gather the
records straight into dst's region at their workspace rows ``slot[r, dst]`` (SM stores over P2P on
the CUDA fabric; the region is shaped like dst's workspace, and a union row has exactly one owner,
so the sources never collide); that move itself publishes them (``arrive[r] = seq``, or a layer's
``landed``, release-stored after a system-scope fence in the kernel that wrote the records:
``Fabric.arrival_flag``)", and unpacking copies those rows from
the region into the workspace. Every kernel reads its count from the plane in place, and there is
exactly one round. That requires planes whose capacity covers every possible count (``C >= B *
U``, the workspace rows: a pair can never carry more than the whole union) and a region of at least
as many rows, checked from shapes alone, so a device-sized exchange can never overflow. After one
eager call it issues the same fabric calls and kernels with the same buffers on every call (no
allocation, no host read: ``tests/comm/test_comm_exchange.py`` checks both), which is what CUDA-graph
capture and replay need. Its stats carry timings only: the record counts stay on the device.

Errors: every move gets the fabric's ``move_err`` as its error word (``pack``, "Errors"): on the
CUDA fabric a bad count or index is recorded there and read a step later (``comm.errors``); on the
host fabric (None) the move raises at once.

Capacity: a destination's region carries ``capacity`` records per layer per round over all its
sources. A host-sized exchange whose blocks exceed that (or a pair over the send capacity) is moved
in rounds of ``slab.host_window`` records per pair (one log line the first time; every rank computes
the same rounds from the same planes). Planes that already overflowed (``planes.overflow``) cannot
be exchanged without losing records: :class:`ExchangeOverflow` is raised on every rank and the
caller runs the stock DCP path for that step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from sparkinfer.core.slab import chunk_rounds, host_offsets, rotated_peers

from . import pack as P
from .fabric import Fabric, log


class ExchangeOverflow(RuntimeError):
    """The planes dropped records (count > plane capacity): use the stock path for this step."""


@dataclass
class ExchangeStats:
    rounds: int = 0
    records_sent: int = 0   # records this rank copied to peers (all layers)
    records_recv: int = 0
    records_local: int = 0  # own records moved shard -> workspace
    bytes_sent: int = 0
    pack_s: float = 0.0
    copy_s: float = 0.0     # issuing copies, including waits for free regions
    direct_s: float = 0.0
    wait_s: float = 0.0     # waiting for arrivals
    unpack_s: float = 0.0

    def add(self, other: "ExchangeStats") -> None:
        for k in self.__dataclass_fields__:
            setattr(self, k, getattr(self, k) + getattr(other, k))


@dataclass
class Pending:
    """An exchange between ``start`` and ``finish``."""

    planes: object
    shard: P.Shard
    layers: torch.Tensor
    workspace: torch.Tensor
    counts: list | None  # host copy of planes.count; None with device sizing
    seq: int
    lo: int
    hi: int
    stats: ExchangeStats = field(default_factory=ExchangeStats)
    done: bool = False
    layered: bool = False  # per-layer arrival: sections land (and are unpacked) one layer at a time
    unpacked: int = 0      # layers of the current round unpacked into the workspace


def _check_planes(planes, world: int, device) -> int:
    count = planes.count
    C = planes.req.shape[-1]
    if count.shape != (world, world) or count.dtype != torch.int32:
        raise ValueError(f"planes.count must be int32 [{world}, {world}], got {count.dtype} {tuple(count.shape)}")
    for name in ("req", "local", "slot"):
        t = getattr(planes, name)
        # each (src, dst) list contiguous; a plan's lists may share memory (decode.group_plan)
        if t.shape != (world, world, C) or t.dtype != torch.int32 or t.stride(2) != 1:
            raise ValueError(f"planes.{name} must be int32 [{world}, {world}, {C}] with contiguous lists, "
                             f"got {t.dtype} {tuple(t.shape)} strides {t.stride()}")
        if t.device != device:
            raise ValueError(f"planes.{name} is on {t.device}, the shard on {device}")
    return C


SIZINGS = ("host", "device")


def _check_sizing(sizing: str) -> str:
    if sizing not in SIZINGS:
        raise ValueError(f"sizing must be one of {SIZINGS}, got {sizing!r}")
    return sizing


class SelectedExchange:
    """Runs the protocol above on a fabric; allocates nothing per call on its own (slabs live in
    the fabric). ``sizing``: "host" or "device" (module docstring), the default of every call;
    ``layer_arrival``: exchanges of several layers signal each layer's section (module docstring);
    False: one copy (or store) and one arrival per pair (a layer's wait waits for all of them).

    Sequence numbers and the in-flight queue are per fabric, so one fabric has one exchange."""

    def __init__(self, fabric: Fabric, sizing: str = "host", layer_arrival: bool = True):
        if getattr(fabric, "_driver", None) is not None:
            raise ValueError("this fabric already has a SelectedExchange (sequence numbers are per fabric): "
                             "reuse it; sizing can be chosen per call")
        fabric._driver = self
        self.sizing = _check_sizing(sizing)
        self.layer_arrival = bool(layer_arrival)
        self.fabric = fabric
        self.layout = fabric.layout
        self.rank, self.world = fabric.rank, fabric.world
        self.seq = 0
        self.chunked = 0  # exchanges that needed more than one round
        self._in_flight: list[Pending] = []  # started, not finished; oldest first
        self._region_shards: list = []  # per slot, the device-sized unpack's view of the region
        self._zeros: torch.Tensor | None = None  # int32 zeros, its request column
        self._side_seq = 0  # newest exchange whose side work was not joined yet (0: none)
        # J -> int32 arange(J) for every exchange's layer count, made here so no step allocates one
        self._ranges = {J: torch.arange(J, dtype=torch.int32, device=fabric.device)
                        for J in range(1, self.layout.max_layers + 1)}

    def exchange(self, planes, shard: P.Shard, layers, workspace: torch.Tensor,
                 sizing: str | None = None) -> ExchangeStats:
        return self.finish(self.start(planes, shard, layers, workspace, sizing))

    def start(self, planes, shard: P.Shard, layers, workspace: torch.Tensor, sizing: str | None = None) -> Pending:
        """Pack and issue the copies of an exchange (and move own records); ``finish`` completes it."""
        lay, r = self.layout, self.rank
        sizing = self.sizing if sizing is None else _check_sizing(sizing)
        if planes.overflow:
            log.warning("exchange: planes overflowed their capacity (records were dropped by the planner); "
                        "raising ExchangeOverflow so the caller runs the stock path")
            raise ExchangeOverflow(f"rank {r}: planes overflow their capacity {planes.req.shape[-1]}; "
                                   "selected-record exchange refused for this step (use the stock path)")
        if not isinstance(layers, torch.Tensor):
            if sizing == "device":
                raise ValueError("a device-sized exchange takes layers as an int32 tensor on the shard's device "
                                 "(building one per call would allocate)")
            layers = torch.tensor(list(layers), dtype=torch.int32, device=shard.device)
        J = layers.shape[0]
        if shard.width != lay.width:
            raise ValueError(f"shard record width {shard.width} != exchange width {lay.width}")
        if not 1 <= J <= lay.max_layers:
            raise ValueError(f"{J} layers in one exchange; the slab holds 1..{lay.max_layers}")
        C = _check_planes(planes, self.world, shard.device)
        if sizing == "device":
            return self._start_device_sized(planes, shard, layers, workspace, C)
        counts = planes.count.cpu().tolist()
        if any(c < 0 or c > C for row in counts for c in row):
            raise ValueError(f"planes.count outside [0, {C}] while overflow is False: {counts}")
        off_diag = max((counts[s][d] for s in range(self.world) for d in range(self.world) if s != d), default=0)
        window = lay.host_window(counts) if self.world > 1 else max(1, off_diag)
        rounds = chunk_rounds(off_diag, window)
        # Round seq reuses the slot of seq - depth, so the exchanges in flight plus the new rounds
        # must fit in depth slots: finish the oldest ones first (same decision on every rank). A
        # release acknowledges every older sequence number too, so rounds finished right here must
        # not overtake an older exchange still in flight: a chunked exchange finishes them all.
        while self._in_flight and (rounds > 1 or len(self._in_flight) + rounds > lay.depth):
            self.finish(self._in_flight[0])
        self._join_side()  # the copy thread's flags must not overtake side work still queued
        stats = ExchangeStats()
        if rounds > 1:
            if self.chunked == 0:
                log.warning("exchange: %d records for one pair do not fit the receive regions (%d records per "
                            "destination, %d per send region): moving them in %d rounds of %d (raise the capacity "
                            "to avoid this)", off_diag, lay.capacity, lay.send_capacity, rounds, window)
            self.chunked += 1
        t = time.perf_counter()
        own = planes.count[r, r] if rounds == 1 else counts[r][r]
        P.direct(shard, layers, planes.req[r, r], planes.local[r, r], planes.slot[r, r], own, C, workspace,
                 err=self.fabric.move_err)
        stats.direct_s = time.perf_counter() - t
        stats.records_local = counts[r][r] * J
        for k in range(rounds):
            lo, hi = k * window, min((k + 1) * window, C)
            pending = self._start_round(Pending(planes, shard, layers, workspace, counts, 0, lo, hi,
                                                layered=self.layer_arrival and J > 1), rounds == 1)
            if k + 1 < rounds:
                stats.add(self._finish_round(pending, False))
        pending.stats.add(stats)
        pending.stats.rounds = rounds
        self._in_flight.append(pending)
        return pending

    def _start_device_sized(self, planes, shard: P.Shard, layers, workspace: torch.Tensor, C: int) -> Pending:
        lay, r, f = self.layout, self.rank, self.fabric
        rows = workspace.shape[1]
        if rows > lay.capacity:
            raise ValueError(f"workspace rows {rows} (B * U) exceed the slab capacity {lay.capacity}: a device-sized "
                             "exchange writes every record at its workspace row of the receive region (raise the "
                             "slab capacity)")
        if C < rows:
            raise ValueError(f"planes capacity {C} < workspace rows {rows} (B * U): a device-sized "
                             "exchange needs C >= B * U so that no count can overflow (build the planes with it)")
        while self._in_flight and len(self._in_flight) + 1 > lay.depth:
            self.finish(self._in_flight[0])
        J = layers.shape[0]
        p = Pending(planes, shard, layers, workspace, None, 0, 0, C, layered=self.layer_arrival and J > 1)
        t = time.perf_counter()
        P.direct(shard, layers, planes.req[r, r], planes.local[r, r], planes.slot[r, r], planes.count[r, r], C,
                 workspace, err=f.move_err)
        p.stats.direct_s = time.perf_counter() - t
        if not p.layered:
            self._join_side()  # its arrive must not overtake side work still queued
        self.seq += 1
        p.seq = seq = self.seq
        head = slice(0, 1) if p.layered else slice(0, J)  # what goes on the caller's stream
        sections = []  # (dst, its plane lists, its region as [J, capacity, width]) for the side stream
        for dst in rotated_peers(r, self.world):
            t = time.perf_counter()
            f.wait_peer_free(seq, dst)
            t1 = time.perf_counter()
            lists = (planes.req[r, dst], planes.local[r, dst], planes.slot[r, dst], planes.count[r, dst])
            region = self._as_workspace(f.peer_region(seq, dst), J)
            # the move publishes what it wrote itself: fence, then release-store the flag
            P.direct(shard, layers[head], *lists, C, region[head], err=f.move_err,
                     arrive=f.arrival_flag(seq, dst, 0 if p.layered else None))
            sections.append((dst, lists, region))
            p.stats.copy_s += t1 - t
            p.stats.pack_s += time.perf_counter() - t1
        if p.layered:
            t = time.perf_counter()
            f.on_side_stream(seq, self._side_sections(seq, shard, layers, sections, C))
            self._side_seq = seq
            p.stats.pack_s += time.perf_counter() - t
        p.stats.rounds = 1
        self._in_flight.append(p)
        return p

    def _join_side(self, upto: int | None = None) -> None:
        """What is issued next follows the side work of exchanges up to ``upto`` (default: all so
        far). Flags are "up to seq", so a later exchange's flag must not be written before an
        older one's sections; and the side work reads the planes, which the next step rewrites."""
        if self._side_seq:
            upto = self._side_seq if upto is None else min(upto, self._side_seq)
            self.fabric.join_side_stream(upto)
            if upto == self._side_seq:
                self._side_seq = 0

    def _side_sections(self, seq: int, shard: P.Shard, layers: torch.Tensor, sections: list, C: int):
        """The side work of a layered device-sized exchange: the Shared layers' sections, layer by
        layer across destinations (every destination's section j before j + 1, as the host-sized
        copies), each published by its own move (``landed[j]``), then every destination's ``arrive``. The views are
        made here, on the caller's thread, so the side work only launches kernels."""
        f, J = self.fabric, layers.shape[0]
        work = [(j, dst, layers[j:j + 1], lists, region[j:j + 1])
                for j in range(1, J) for dst, lists, region in sections]

        def run():
            for j, dst, layer, lists, region in work:
                P.direct(shard, layer, *lists, C, region, err=f.move_err, arrive=f.arrival_flag(seq, dst, j))
            for dst, _, _ in sections:  # no data of its own: the sections' moves published theirs
                f.signal_arrival(seq, dst)
        return run

    def _as_workspace(self, region: torch.Tensor, J: int) -> torch.Tensor:
        """A receive region as a device-sized exchange fills it: uint8 [J, capacity, width]."""
        lay = self.layout
        return region[: J * lay.capacity * lay.width].view(J, lay.capacity, lay.width)

    def _region_shard(self, seq: int, C: int):
        """(shard over this rank's receive region of ``seq``'s slot as ``max_layers`` layers of
        ``capacity`` one-row blocks with the identity block table, int32 zeros [>= C] as its request
        column): the device-sized unpack is then the ``direct`` move region row ``slot`` ->
        workspace row ``slot``. Built at the first call, then reused (the hot path allocates
        nothing once the zeros cover the planes' capacity)."""
        lay, dev = self.layout, self.fabric.device
        if not self._region_shards:
            identity = torch.arange(lay.capacity, dtype=torch.int32, device=dev)[None]
            self._region_shards = [P.Shard(tuple(self._as_workspace(self.fabric.recv_region(k), lay.max_layers)),
                                           identity, 1) for k in range(lay.depth)]
        if self._zeros is None or self._zeros.shape[0] < C:
            self._zeros = torch.zeros(max(C, lay.capacity), dtype=torch.int32, device=dev)
        return self._region_shards[lay.slot(seq)], self._zeros

    def index_bytes(self) -> int:
        """Bytes of the device-sized unpack's index tables (identity block table and zero column)."""
        return 0 if not self._region_shards else 4 * (self.layout.capacity + self._zeros.shape[0])

    def _count(self, p: Pending, src: int, dst: int, whole: bool):
        """Records of (src, dst) in this round: the plane entry itself (device-side, graph-safe) for
        a single round, the round's share as a host int otherwise."""
        if whole:
            return p.planes.count[src, dst]
        return max(0, min(p.counts[src][dst], p.hi) - p.lo)

    def _shares(self, p: Pending, dst: int) -> list[int]:
        """Records each source moves to ``dst`` in round ``p`` (host sizing)."""
        return [max(0, min(p.counts[s][dst], p.hi) - p.lo) for s in range(self.world)]

    def _start_round(self, p: Pending, whole: bool) -> Pending:
        f, lay, r, J = self.fabric, self.layout, self.rank, p.layers.shape[0]
        self.seq += 1
        p.seq = seq = self.seq
        cap = p.hi - p.lo
        blocks = []  # (dst, records, byte offset in dst's region) of the layered copies
        for dst in rotated_peers(r, self.world):
            shares = self._shares(p, dst)
            n, offset = shares[r], host_offsets(shares, dst)[r] * J * lay.width
            t = time.perf_counter()
            f.wait_send_free(seq, dst)
            if n:
                P.pack(p.shard, p.layers, p.planes.req[r, dst, p.lo:p.hi], p.planes.local[r, dst, p.lo:p.hi],
                       self._count(p, r, dst, whole), cap, f.send_region(seq, dst), err=f.move_err)
            t1 = time.perf_counter()
            f.wait_recv_free(seq, dst)
            if p.layered:  # the first layer's section goes at once, as the whole block would
                blocks.append((dst, n, offset))
                if n:
                    f.copy(seq, dst, lay.nbytes(1, n), offset, layer=0)
            else:
                f.copy(seq, dst, lay.nbytes(J, n), offset)
            p.stats.pack_s += t1 - t
            p.stats.copy_s += time.perf_counter() - t1
            p.stats.records_sent += n * J
            p.stats.bytes_sent += lay.nbytes(J, n)
        if p.layered:  # then layer by layer across destinations: every destination's layer j before j + 1
            t = time.perf_counter()
            for j in range(1, J):
                for dst, n, offset in blocks:
                    if n:
                        section = lay.nbytes(1, n)
                        f.copy(seq, dst, section, offset + j * section, layer=j, src_offset=j * section)
            for dst, _, offset in blocks:
                f.copy(seq, dst, 0, offset)  # arrive: the whole region landed
            p.stats.copy_s += time.perf_counter() - t
        return p

    def _unpack(self, p: Pending, upto: int, whole: bool) -> None:
        """Wait for and unpack layers ``p.unpacked .. upto - 1`` of every source's part of the round
        (all ``J`` layers at once unless the round is layered); no release."""
        f, r, J, W = self.fabric, self.rank, p.layers.shape[0], self.layout.width
        if p.unpacked >= upto:
            return
        # arrivals are awaited in the order peers write to us (src = r-1 starts on us first)
        peers = list(reversed(rotated_peers(r, self.world)))
        region = f.recv_region(p.seq)
        if p.counts is not None:
            shares = self._shares(p, r)
            offsets = host_offsets(shares, r)
        for j in range(p.unpacked, upto) if p.layered else [None]:
            for src in peers:
                if j is not None and p.counts is not None and not shares[src]:
                    continue  # no section from src: nothing to wait for before the region's arrive
                t = time.perf_counter()
                f.wait_arrival(p.seq, src, j)
                t1 = time.perf_counter()
                if p.counts is None:  # device sizing: the unpack kernel reads the count (0 is a no-op)
                    shard, zeros = self._region_shard(p.seq, p.hi)
                    layers, ws = ((self._ranges[J], p.workspace) if j is None else
                                  (self._ranges[J][j:j + 1], p.workspace[j:j + 1]))
                    P.direct(shard, layers, zeros, p.planes.slot[src, r], p.planes.slot[src, r],
                             p.planes.count[src, r], p.hi, ws, err=f.move_err)
                elif shares[src]:
                    n, off = shares[src], offsets[src] * J * W
                    slot, count = p.planes.slot[src, r, p.lo:p.hi], self._count(p, src, r, whole)
                    if j is None:
                        P.unpack(region[off: off + J * n * W], J, count, n, slot, p.workspace, err=f.move_err)
                    else:  # the block is layer-major: section j is [n, width] at j * n * width
                        sec = off + j * n * W
                        P.unpack(region[sec: sec + n * W], 1, count, n, slot, p.workspace[j: j + 1],
                                 err=f.move_err)
                p.stats.wait_s += t1 - t
                p.stats.unpack_s += time.perf_counter() - t1
                p.stats.records_recv += (0 if p.counts is None else shares[src]) * (J if j is None else 1)
        p.unpacked = upto if p.layered else J

    def _finish_round(self, p: Pending, whole: bool) -> ExchangeStats:
        f, r = self.fabric, self.rank
        self._unpack(p, p.layers.shape[0], whole)
        if p.layered and p.counts is None:  # what follows waits for its side work
            self._join_side(p.seq)
        peers = list(reversed(rotated_peers(r, self.world)))
        if p.layered:  # the region's arrive follows its last section (and stands for 0-record sources)
            for src in peers:
                t = time.perf_counter()
                f.wait_arrival(p.seq, src)
                p.stats.wait_s += time.perf_counter() - t
        for src in peers:  # the sources share the region: released once all of it was consumed
            f.release(p.seq, src)
        return p.stats

    def finish_layer(self, pending: Pending, j: int) -> None:
        """Layer ``j`` (index into the exchange's layers) of ``pending`` is in the workspace: wait only
        for sections 0..j (they land in that order) and unpack them; the region stays held until
        ``finish``. Without per-layer arrival this is ``finish`` (the whole region)."""
        if not 0 <= j < pending.layers.shape[0]:
            raise ValueError(f"layer index {j} outside the exchange's {pending.layers.shape[0]} layers")
        if pending.done:
            return
        if not any(p is pending for p in self._in_flight):
            raise RuntimeError("finish_layer() of an exchange that was never started on this SelectedExchange")
        if not pending.layered:
            self.finish(pending)
            return
        self._unpack(pending, j + 1, pending.stats.rounds == 1)

    def finish(self, pending: Pending) -> ExchangeStats:
        """Wait for the peers' regions of ``pending``, unpack them, release the regions.

        Exchanges complete in start order (a release acknowledges every older sequence number
        too), so older unfinished exchanges are finished first; finishing twice is a no-op."""
        if not pending.done and not any(p is pending for p in self._in_flight):
            raise RuntimeError("finish() of an exchange that was never started on this SelectedExchange")
        while not pending.done:
            oldest = self._in_flight.pop(0)
            self._finish_round(oldest, oldest.stats.rounds == 1)
            oldest.done = True
        return pending.stats
