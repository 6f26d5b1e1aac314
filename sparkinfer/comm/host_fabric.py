"""Host fabric: processes on one machine, shared-memory segments, one copy thread per rank.

Stands in for the CUDA fabric on CPU machines and in tests, running the same protocol calls:

* receive segment: a file in /dev/shm mapped with ``torch.from_file(shared=True)`` by its owner
  and every peer (layout in ``core/slab.py``); the file is unlinked once all ranks mapped it, so nothing
  leaks even if a process dies;
* send slab: private memory of the rank (only its own copy thread reads it);
* copy thread: the copy engine. ``copy()`` queues (seq, dst, nbytes, offset, layer, src_offset);
  the thread copies the bytes into dst's segment, then release-stores ``arrive[rank] = seq``
  (``landed[layer][rank] = seq`` for one layer's section) there, jobs in queue order;
* side thread: the CUDA fabric's side stream. ``on_side_stream(seq, fn)`` queues ``fn`` (a
  device-sized exchange's Shared-layer sections: stores into peer segments and their flags); it
  runs after the caller's earlier work and concurrently with what the caller does next, jobs in
  queue order, and ``join_side_stream(seq)`` waits for it;
* flags: int64 words with acquire/release atomics (``flags.py``); waits time out after
  ``timeout_s`` and then raise on this rank and write ``abort`` into every peer's segment, so peers
  blocked on this rank raise too, naming who was missing, instead of hanging.
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading
import uuid

import torch
import torch.distributed as dist

from sparkinfer.core.slab import ABORT, ACK, ARRIVE, FLAG_STRIDE, LANDED, SlabLayout

from . import flags
from .fabric import Fabric, FabricError, arrival_barrier, check_same_config, log

SHM_DIR = "/dev/shm"


class HostFabric(Fabric):
    kind = "host"

    def __init__(self, layout: SlabLayout, group=None, timeout_s: float = 30.0):
        if not dist.is_initialized():
            raise RuntimeError("HostFabric needs an initialised torch.distributed process group (gloo)")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        if layout.world != self.world:
            raise ValueError(f"slab layout is for {layout.world} ranks, process group has {self.world}")
        self.layout = layout
        self.device = torch.device("cpu")
        # No move error word: a host move raises at once, in the thread that ran it (a side-thread
        # move's error fails the fabric, as a failed copy does).
        self.move_err = None
        self.timeout_s = float(timeout_s)
        arrival_barrier(group, self.rank, self.world, self.timeout_s)
        check_same_config(group, self.world, {"fabric": self.kind, **layout.config(),
                                                         "timeout_s": self.timeout_s})
        self._closed = False
        self._error: BaseException | None = None
        tag = [uuid.uuid4().hex if self.rank == 0 else None]
        dist.broadcast_object_list(tag, src=self._global(0), group=group)
        paths = [os.path.join(SHM_DIR, f"sparkinfer-comm-{tag[0]}-r{r}") for r in range(self.world)]
        # Plain tensors even when built under torch.inference_mode (vLLM builds it inside a forward):
        # the copy thread runs outside that mode and could not write inference tensors.
        with torch.inference_mode(False):
            self._map_segments(paths, group)
            self._flags = [seg[: layout.flags_bytes].view(torch.int64) for seg in self._segments]
            self._send = torch.zeros(layout.send_bytes, dtype=torch.uint8)
        self._copied = [0] * self.world  # last seq whose copy to dst finished reading the send slab
        self._queued = [0] * self.world  # last seq queued for a copy to dst (device-sized rounds queue none)
        self.copied_bytes = [0] * self.world  # bytes the copy thread has written into each dst (monotonic)
        self.copies = [0] * self.world  # non-empty copies to each dst (monotonic)
        self._cv = threading.Condition()
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._copy_loop, name=f"si-copy-r{self.rank}", daemon=True)
        self._thread.start()
        self._seq_words = (ctypes.c_int64 * layout.depth)()  # per slot: the seq a move's arrival stores
        self._side_jobs: queue.Queue = queue.Queue()
        self._side_done = 0  # last seq whose side work finished (jobs run in seq order)
        self._side = threading.Thread(target=self._side_loop, name=f"si-side-r{self.rank}", daemon=True)
        self._side.start()

    def _map_segments(self, paths: list[str], group) -> None:
        """Map every rank's receive segment (this rank's file created first, then the peers')."""
        layout = self.layout
        try:
            own = torch.from_file(paths[self.rank], shared=True, size=layout.segment_bytes, dtype=torch.uint8)
            dist.barrier(group)
            self._segments = [own if r == self.rank else
                              torch.from_file(paths[r], shared=True, size=layout.segment_bytes, dtype=torch.uint8)
                              for r in range(self.world)]
            dist.barrier(group)
        finally:
            if os.path.exists(paths[self.rank]):
                os.unlink(paths[self.rank])  # every peer has it mapped now (or setup failed)

    def _global(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    # --- regions -------------------------------------------------------------------------------
    def send_region(self, seq, dst):
        off = self.layout.send_offset(seq, dst)
        return self._send[off: off + self.layout.region_bytes]

    def _recv_region_of(self, owner: int, seq: int):
        off = self.layout.recv_offset(seq)
        return self._segments[owner][off: off + self.layout.region_bytes]

    def recv_region(self, seq):
        return self._recv_region_of(self.rank, seq)

    # --- copy engine stand-in ------------------------------------------------------------------
    def _copy_loop(self):
        while True:
            job = self._jobs.get()
            if job is None:
                return
            seq, dst, nbytes, offset, layer, src_offset = job
            try:
                if nbytes:
                    region = self._recv_region_of(dst, seq)[offset: offset + nbytes]
                    region.copy_(self.send_region(seq, dst)[src_offset: src_offset + nbytes])
                    self.copied_bytes[dst] += region.numel()  # counted before arrival: visible once dst saw it
                    self.copies[dst] += layer is None or layer == 0  # a block, however many sections
                kind = ARRIVE if layer is None else LANDED + layer
                flags.store(self._flags[dst], self.layout.flag_index(kind, self.rank), seq)
            except BaseException as e:  # every rank (this one too) stops waiting and raises it
                self._error = e
                log.error("rank %d: copy to rank %d (exchange %d) failed: %r", self.rank, dst, seq, e)
                self._abort(list(range(self.world)), [self.rank])
            if layer is None:  # the region's last copy: the send region of seq is free again
                with self._cv:
                    self._copied[dst] = seq
                    self._cv.notify_all()

    def _side_loop(self):
        while True:
            job = self._side_jobs.get()
            if job is None:
                return
            seq, fn = job
            try:
                if self._error is None:
                    fn()
            except BaseException as e:
                self._error = self._error or e
                if not isinstance(e, FabricError):  # a fabric failure already told the peers
                    log.error("rank %d: side work of exchange %d failed: %r", self.rank, seq, e)
                    self._abort(list(range(self.world)), [self.rank])
            with self._cv:
                self._side_done = seq
                self._cv.notify_all()

    def _check(self):
        if self._closed:
            raise FabricError(f"rank {self.rank}: fabric is closed")
        if self._error is not None:
            raise FabricError(f"rank {self.rank}: fabric failed earlier: {self._error}") from self._error

    def held_bytes(self) -> dict[str, int]:
        """Bytes this rank's slabs hold (its receive segment, its send slab), measured."""
        return {"exchange_recv": self._segments[self.rank].numel(), "exchange_send": self._send.numel()}

    def check(self) -> None:
        """Raise if this fabric failed (its copy thread, a timed-out wait, a peer's abort)."""
        self.poll()

    def poll(self) -> None:
        """``check`` without waiting: this rank's own failure (a copy that failed after its exchange
        returned) and the peers' abort words (a peer whose copy or wait failed) raise FabricError."""
        self._check()
        lay = self.layout
        if any(flags.load(self._flags[self.rank], lay.flag_index(ABORT, p)) for p in range(self.world)):
            self._raise_abort(-1)

    def _wait_copied(self, dst: int, need: int):
        """Until the copy thread finished the copies to dst up to exchange ``need`` (run in order)."""
        need = min(need, self._queued[dst])  # device-sized exchanges queue no copy
        with self._cv:
            if not self._cv.wait_for(lambda: self._copied[dst] >= need, timeout=self.timeout_s):
                self._fail(f"its own copy to rank {dst} (exchange {need}) did not finish", [dst])

    def wait_send_free(self, seq, dst):
        self._check()
        self._wait_copied(dst, seq - self.layout.depth)

    def copy(self, seq, dst, nbytes, offset=0, layer=None, src_offset=0):
        self._check()
        if layer is None:
            self._queued[dst] = seq
        self._jobs.put((seq, dst, nbytes, offset, layer, src_offset))

    def _wait(self, kind: int, seq_target: int, peer: int, what: str, seq: int):
        self._check()
        lay = self.layout
        rc, pending = flags.wait(self._flags[self.rank], lay.flag_index(kind, 0), [peer], FLAG_STRIDE, seq_target,
                                 lay.flag_index(ABORT, 0), self.world, self.timeout_s)
        if rc == flags.WAIT_OK:
            return
        if rc == flags.WAIT_ABORTED:
            self._raise_abort(seq)
        # timed out on `peer`: name every peer that is behind, not just the first one checked
        behind = [p for p in range(self.world) if p != self.rank
                  and flags.load(self._flags[self.rank], lay.flag_index(ARRIVE, p)) < seq]
        self._fail(f"timed out after {self.timeout_s:g} s in exchange {seq} waiting for {what} of rank {peer}",
                   sorted(set(behind) | {peer}))

    def wait_recv_free(self, seq, dst):
        if seq > self.layout.depth:
            self._wait(ACK, seq - self.layout.depth, dst, f"the release of exchange {seq - self.layout.depth}", seq)

    def wait_arrival(self, seq, src, layer=None):
        if layer is None:
            self._wait(ARRIVE, seq, src, "the arrival", seq)
        else:
            self._wait(LANDED + layer, seq, src, f"the arrival of layer section {layer}", seq)

    def release(self, seq, src):
        self._check()
        flags.store(self._flags[src], self.layout.flag_index(ACK, self.rank), seq)

    # --- device-side sizing: this thread writes dst's region (the SM stores of the CUDA fabric) -
    def peer_region(self, seq, dst):
        return self._recv_region_of(dst, seq)

    def wait_peer_free(self, seq, dst):
        self.wait_recv_free(seq, dst)

    def signal_arrival(self, seq, dst, layer=None):
        flags.store_at(self.arrival_flag(seq, dst, layer)[0], seq)

    def arrival_flag(self, seq, dst, layer=None):
        self._check()
        # flags are "every exchange up to seq": older copies to dst still queued go first
        self._wait_copied(dst, seq)
        slot = self.layout.slot(seq)
        self._seq_words[slot] = seq  # read by the move that signals (it runs before seq + depth can start)
        kind = ARRIVE if layer is None else LANDED + layer
        return (self._flags[dst].data_ptr() + 8 * self.layout.flag_index(kind, self.rank),
                ctypes.addressof(self._seq_words) + 8 * slot)

    def on_side_stream(self, seq, fn):
        self._check()
        self._side_jobs.put((seq, fn))

    def join_side_stream(self, seq):
        with self._cv:
            if not self._cv.wait_for(lambda: self._side_done >= seq or self._error is not None,
                                     timeout=self.timeout_s):
                self._fail(f"its own side work of exchange {seq} did not finish", [self.rank])
        self._check()

    # --- failure -------------------------------------------------------------------------------
    def _abort(self, ranks: list[int], missing: list[int]):
        """abort[rank] = 1 + bitmask of ``missing`` in the segments of ``ranks``: their waits return."""
        mask = sum(1 << p for p in missing)
        for r in ranks:
            flags.store(self._flags[r], self.layout.flag_index(ABORT, self.rank), 1 + mask)

    def _fail(self, why: str, missing: list[int]):
        self._abort([r for r in range(self.world) if r != self.rank], missing)
        self._error = FabricError(f"rank {self.rank}: {why}; missing peer(s): {missing}")
        log.error("%s", self._error)
        raise self._error

    def _raise_abort(self, seq: int):
        if self._error is not None:  # this rank's own copy thread failed
            raise FabricError(f"rank {self.rank}: exchange {seq if seq >= 0 else '(earlier)'} failed: "
                              f"{self._error!r}") from self._error
        lay = self.layout
        reports = []
        for p in range(self.world):
            v = flags.load(self._flags[self.rank], lay.flag_index(ABORT, p))
            if v:
                missing = [q for q in range(self.world) if (v - 1) >> q & 1]
                reports.append(f"rank {p} failed" if missing == [p] else
                               f"rank {p} gave up waiting for rank(s) {missing}")
        what = f"exchange {seq}" if seq >= 0 else "an earlier exchange"
        self._error = FabricError(f"rank {self.rank}: {what} aborted by a peer: {'; '.join(reports)}")
        raise self._error

    def close(self):
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        self._side_jobs.put(None)
        self._thread.join(timeout=self.timeout_s)
        self._side.join(timeout=self.timeout_s)
        self._flags = self._segments = None  # unmaps: the files are already unlinked
        self._send = None
