"""CUDA fabric: IPC receive segments, one copy-engine stream per peer, device-side flags.

Same slab layout (``core/slab.py``) and protocol calls as the host fabric; every call enqueues work
instead of blocking, so the exchange overlaps compute:

* receive segment: ``cudaMalloc`` (a whole allocation, so its IPC handle maps exactly it),
  exported with ``cudaIpcGetMemHandle`` and opened by every peer with ``cudaIpcOpenMemHandle``;
* send slab: ordinary device memory of this rank;
* ``copy``: on the pair's own non-blocking stream (its copy engine): wait for the pack event,
  wait (device flag) until dst released the region, one ``cudaMemcpyAsync`` of the packed region
  (or of one layer's section of it) into dst's segment, then a one-thread kernel release-writes
  ``arrive[rank] = seq`` (``landed[layer][rank] = seq`` for a section) there;
* ``wait_arrival`` / ``release``: flag kernels on the compute (current torch) stream; a wait that
  spins past ``timeout_s`` stops, records the missing peer in a pinned host word and returns, and
  the next fabric call raises :class:`FabricError` naming that peer (the GPU never hangs);
* sequence numbers live in device memory, one word per slot, bumped by ``depth`` on the compute
  stream when a round starts, so flag kernels read the right value in any stream order;
* device-side sizing (``peer_region`` / ``wait_peer_free`` / ``arrival_flag``): no copy
  engine; the direct-move kernel on the compute stream stores straight into dst's IPC-mapped
  segment (P2P writes over PCIe) and publishes them itself: its CTAs fence system-wide and count
  themselves on the flag's CTA counter (one per flag, this fabric's), the last release-stores the
  flag ``arrival_flag`` names (``signal_arrival``, a one-thread kernel, only for a flag that follows
  earlier moves and carries no data). Every size is read on the device, so the sequence is
  graph-capturable as is;
* error words: the wait kernels' (pinned host, read by every fabric call) and the move kernels'
  ``move_err`` (device int32, passed to every move as ``err``; ``check`` reads it, ``comm.errors``
  a step later);
* side stream (``on_side_stream`` / ``join_side_stream``): the Shared layers' sections of a
  device-sized exchange are packed and signalled on one more stream, forked from the compute
  stream after F's sections and joined back (an event per slot) when the exchange finishes, so
  F's attention runs while they move. Fork and join are event waits between the two streams,
  which graph capture records as graph edges.

``cuda.bindings`` (package ``cuda-python``, the ``cuda`` extra) is imported only here, when the
fabric is built. Peer access is checked first: a node without P2P (IOMMU on, ACS not cleared)
fails with an explanation instead of a slow or broken run.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache

import torch
import torch.distributed as dist

from sparkinfer import native
from sparkinfer.core.slab import ACK, ARRIVE, FLAG_STRIDE, LANDED, SlabLayout

from .fabric import Fabric, FabricError, PeerAccessError, arrival_barrier, check_same_config
from .flags import describe_error
from .pack import check_error_word

_vp, _i32, _i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64


def _rt():
    try:
        from cuda.bindings import runtime
    except ImportError as e:
        raise RuntimeError("the CUDA fabric needs cuda-python (pip install 'sparkinfer[cuda]')") from e
    return runtime


def _ok(result, what: str):
    """Unpack a cuda.bindings (err, *values) tuple, raising on error."""
    err, *vals = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: CUDA error {int(err)} ({err})")
    return vals[0] if len(vals) == 1 else (vals or None)


@lru_cache(maxsize=None)
def _flags_lib():
    lib = native.cuda_lib()
    if lib is None:
        raise RuntimeError("the CUDA fabric needs the CUDA build of csrc/ (python -m sparkinfer.native.build --cuda)")
    lib.si_comm_seq_bump_cuda.argtypes = [_vp, _i64, _vp]
    lib.si_comm_signal_cuda.argtypes = [_vp, _vp, _vp]
    lib.si_comm_wait_cuda.argtypes = [_vp, _i32, _i64, _vp, _i64, _i32, ctypes.c_longlong, _vp, _vp]
    for f in (lib.si_comm_seq_bump_cuda, lib.si_comm_signal_cuda, lib.si_comm_wait_cuda):
        f.restype = _i32
    return lib


def _call(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what}: launch failed (status {status})")


class _DeviceBytes:
    """``__cuda_array_interface__`` wrapper so torch can view a raw cudaMalloc allocation."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


class CudaFabric(Fabric):
    kind = "cuda"

    def __init__(self, layout: SlabLayout, group=None, timeout_s: float = 30.0):
        if not torch.cuda.is_available():
            raise RuntimeError("CudaFabric needs a CUDA device")
        if not dist.is_initialized():
            raise RuntimeError("CudaFabric needs an initialised torch.distributed process group")
        rt = _rt()
        self._rt = rt
        self.group, self.layout = group, layout
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        if layout.world != self.world:
            raise ValueError(f"slab layout is for {layout.world} ranks, process group has {self.world}")
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.timeout_s = float(timeout_s)
        arrival_barrier(group, self.rank, self.world, self.timeout_s)
        check_same_config(group, self.world, {"fabric": self.kind, **layout.config(),
                                                         "timeout_s": self.timeout_s})
        self._closed = False
        self._preflight_peer_access()
        lib = _flags_lib()
        self._lib = lib
        n = layout.segment_bytes
        self._seg_ptr = int(_ok(rt.cudaMalloc(n), "cudaMalloc(receive segment)"))
        _ok(rt.cudaMemset(self._seg_ptr, 0, n), "cudaMemset")
        handle = _ok(rt.cudaIpcGetMemHandle(self._seg_ptr), "cudaIpcGetMemHandle")
        handles: list = [None] * self.world
        dist.all_gather_object(handles, bytes(handle.reserved), group=group)
        self._peer_ptr = {}
        for r in range(self.world):
            if r == self.rank:
                continue
            h = rt.cudaIpcMemHandle_t()
            h.reserved = handles[r]
            self._peer_ptr[r] = int(_ok(rt.cudaIpcOpenMemHandle(h, rt.cudaIpcMemLazyEnablePeerAccess),
                                        f"cudaIpcOpenMemHandle(rank {r})"))
        self._own = torch.as_tensor(_DeviceBytes(self._seg_ptr, n), device=self.device)
        # Views of the peers' segments: only their addresses are used (kernels store through P2P).
        self._peer_seg = {r: torch.as_tensor(_DeviceBytes(p, n)) for r, p in self._peer_ptr.items()}
        self._send = torch.zeros(layout.send_bytes, dtype=torch.uint8, device=self.device)
        flags = rt.cudaStreamNonBlocking
        self._streams = {r: int(_ok(rt.cudaStreamCreateWithFlags(flags), "cudaStreamCreate"))
                         for r in self._peer_ptr}
        ev = rt.cudaEventDisableTiming
        self._packed = [[_ok(rt.cudaEventCreateWithFlags(ev), "cudaEventCreate") for _ in range(self.world)]
                        for _ in range(layout.depth)]
        self._copied = [[_ok(rt.cudaEventCreateWithFlags(ev), "cudaEventCreate") for _ in range(self.world)]
                        for _ in range(layout.depth)]
        # seq word of slot k starts one lap behind its first sequence number (k, or depth for k = 0)
        first = [k if k else layout.depth for k in range(layout.depth)]
        self._seq = torch.tensor([f - layout.depth for f in first], dtype=torch.int64, device=self.device)
        self._started = 0  # highest seq whose slot word was bumped
        self._last_copy = {}  # dst -> event of the last copy-engine copy issued to it
        self._recorded = set()  # (slot, dst) whose _copied event was ever recorded: only those are
        # waited on, so a purely device-sized run (and its graph capture) waits on no foreign event
        # bytes of the copies issued to each dst (monotonic; eager calls only: a replayed CUDA graph
        # re-runs the copies without this Python code)
        self.copied_bytes = [0] * self.world
        self.copies = [0] * self.world  # non-empty copies issued to each dst (monotonic)
        self._side = torch.cuda.Stream(self.device)
        self._side_done = [torch.cuda.Event() for _ in range(layout.depth)]  # per slot: its side work ended
        self._err = torch.zeros(1, dtype=torch.int32).pin_memory()
        self.move_err, self._arrive_counters = self._move_words(layout, self.device)
        khz = _ok(rt.cudaDeviceGetAttribute(rt.cudaDeviceAttr.cudaDevAttrClockRate, self.device.index),
                  "cudaDeviceGetAttribute(clock rate)")
        self._timeout_cycles = int(self.timeout_s * khz * 1000)
        dist.barrier(group)

    def _preflight_peer_access(self):
        """Every rank checks P2P to every peer's GPU; the verdicts are all-gathered, so the whole
        group raises the same PeerAccessError (nobody goes on into IPC setup alone)."""
        devs: list = [None] * self.world
        dist.all_gather_object(devs, self.device.index, group=self.group)
        problem = None
        for r, d in enumerate(devs):
            if d != self.device.index and not _ok(self._rt.cudaDeviceCanAccessPeer(self.device.index, d),
                                                  "cudaDeviceCanAccessPeer"):
                problem = f"GPU {self.device.index} (rank {self.rank}) cannot access GPU {d} (rank {r}) peer-to-peer"
                break
        verdicts: list = [None] * self.world
        dist.all_gather_object(verdicts, problem, group=self.group)
        problems = [v for v in verdicts if v is not None]
        if problems:
            raise PeerAccessError(
                f"{'; '.join(problems)}: the CUDA fabric needs P2P: IOMMU off or passthrough, PCIe ACS redirect "
                "cleared, nvidia_uvm uvm_disable_hmm=1 (`sparkinfer preflight` checks them). Use the stock DCP path "
                "on this node.")

    # --- helpers -------------------------------------------------------------------------------
    def _stream(self):
        return native.stream_handle(self.device)

    def _stream_int(self) -> int:
        return self._stream().value or 0  # the legacy default stream is handle 0 (None in ctypes)

    def _seq_ptr(self, seq: int) -> int:
        return self._seq.data_ptr() + 8 * self.layout.slot(seq)

    def _flag_addr(self, base: int, kind: int, peer: int) -> int:
        return base + 8 * self.layout.flag_index(kind, peer)

    @staticmethod
    def _move_words(layout: SlabLayout, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(move_err, arrival counters): the move kernels' error word and the zeroed CTA counters of
        the arrival flags they publish (``comm.pack``), one per flag a move can publish (ARRIVE and
        LANDED + j of every destination: ``_counter_index``). Each fabric makes its own, so two never
        share a word or a counter, and makes them at construction, before any graph capture. The
        error word lives on the device, not in pinned memory as the wait word: every move's CTAs
        read it, which must not cost a PCIe round trip."""
        return (torch.zeros(1, dtype=torch.int32, device=device),
                torch.zeros((1 + layout.max_layers) * layout.world, dtype=torch.int32, device=device))

    def _counter_index(self, kind: int, dst: int) -> int:
        """Index of the CTA counter of the flag ``kind`` (ARRIVE or LANDED + layer) this rank
        publishes in ``dst``'s segment: the kinds a move can publish, ``world`` destinations each."""
        row = 0 if kind == ARRIVE else 1 + kind - LANDED
        return row * self.world + dst

    def _check(self):
        if self._closed:
            raise FabricError(f"rank {self.rank}: fabric is closed")
        code = int(self._err[0])
        if code:  # the documented error word (flags.decode_error): op, check, status and peer
            raise FabricError(f"rank {self.rank}: {describe_error(code)} "
                              f"(wait timeout {self.timeout_s:g} s)")

    def held_bytes(self) -> dict[str, int]:
        """Bytes this rank's slabs hold (the cudaMalloc'd receive segment, the send slab)."""
        return {"exchange_recv": self._own.numel(), "exchange_send": self._send.numel()}

    def poll(self) -> None:
        """Raise FabricError if a device-side wait timed out (the pinned word its kernel stores into:
        read without a sync, so a timeout shows at the latest one step later)."""
        self._check()

    def check(self) -> None:
        """Wait for this rank's queued fabric work and raise on any error word it set (a timed-out
        device wait, a pack kernel's bad index): engine start and the proof, never inside a step."""
        torch.cuda.synchronize(self.device)
        self._check()
        check_error_word(self.move_err)

    # --- protocol calls ------------------------------------------------------------------------
    def send_region(self, seq, dst):
        off = self.layout.send_offset(seq, dst)
        return self._send[off: off + self.layout.region_bytes]

    def recv_region(self, seq):
        off = self.layout.recv_offset(seq)
        return self._own[off: off + self.layout.region_bytes]

    def _begin_round(self, seq) -> bool:
        """Bump the slot's sequence word on the first call of round ``seq``; False if already done."""
        if seq <= self._started:
            return False
        # Every pair stream must have finished the slot's previous round (its arrive signal still
        # reads the slot's sequence word) before the word advances.
        slot, stream = self.layout.slot(seq), self._stream_int()
        for peer in self._peer_ptr:
            if (slot, peer) in self._recorded:
                _ok(self._rt.cudaStreamWaitEvent(stream, self._copied[slot][peer], 0), "cudaStreamWaitEvent")
        _call(self._lib.si_comm_seq_bump_cuda(self._seq_ptr(seq), self.layout.depth, self._stream()), "seq bump")
        self._started = seq
        return True

    def wait_send_free(self, seq, dst):
        self._check()
        if not self._begin_round(seq):
            _ok(self._rt.cudaStreamWaitEvent(self._stream_int(), self._copied[self.layout.slot(seq)][dst], 0),
                "cudaStreamWaitEvent")

    def wait_recv_free(self, seq, dst):
        self._check()
        slot = self.layout.slot(seq)
        ev = self._packed[slot][dst]
        _ok(self._rt.cudaEventRecord(ev, self._stream_int()), "cudaEventRecord")
        _ok(self._rt.cudaStreamWaitEvent(self._streams[dst], ev, 0), "cudaStreamWaitEvent")
        if seq > self.layout.depth:
            _call(self._lib.si_comm_wait_cuda(self._flag_addr(self._seg_ptr, ACK, dst), 1, FLAG_STRIDE,
                                              self._seq_ptr(seq), self.layout.depth, dst, self._timeout_cycles,
                                              self._err.data_ptr(), self._streams[dst]), "release wait")

    def copy(self, seq, dst, nbytes, offset=0, layer=None, src_offset=0):
        self._check()
        s = self._streams[dst]
        if nbytes:
            src = self._send.data_ptr() + self.layout.send_offset(seq, dst) + src_offset
            dst_ptr = self._peer_ptr[dst] + self.layout.recv_offset(seq) + offset
            _ok(self._rt.cudaMemcpyAsync(dst_ptr, src, nbytes, self._rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice, s),
                "cudaMemcpyAsync")
            self.copied_bytes[dst] += nbytes
            self.copies[dst] += layer is None or layer == 0  # a block, however many sections
        kind = ARRIVE if layer is None else LANDED + layer
        _call(self._lib.si_comm_signal_cuda(self._flag_addr(self._peer_ptr[dst], kind, self.rank),
                                            self._seq_ptr(seq), s), "arrive signal")
        ev = self._copied[self.layout.slot(seq)][dst]
        _ok(self._rt.cudaEventRecord(ev, s), "cudaEventRecord")
        self._last_copy[dst] = ev
        self._recorded.add((self.layout.slot(seq), dst))

    def wait_arrival(self, seq, src, layer=None):
        self._check()
        kind = ARRIVE if layer is None else LANDED + layer
        _call(self._lib.si_comm_wait_cuda(self._flag_addr(self._seg_ptr, kind, src), 1, FLAG_STRIDE,
                                          self._seq_ptr(seq), 0, src, self._timeout_cycles, self._err.data_ptr(),
                                          self._stream()), "arrival wait")

    def release(self, seq, src):
        self._check()
        _call(self._lib.si_comm_signal_cuda(self._flag_addr(self._peer_ptr[src], ACK, self.rank),
                                            self._seq_ptr(seq), self._stream()), "release signal")

    def peer_region(self, seq, dst):
        off = self.layout.recv_offset(seq)
        return self._peer_seg[dst][off: off + self.layout.region_bytes]

    def wait_peer_free(self, seq, dst):
        self._check()
        self._begin_round(seq)
        if seq > self.layout.depth:  # on the compute stream: the pack kernel writes the region next
            _call(self._lib.si_comm_wait_cuda(self._flag_addr(self._seg_ptr, ACK, dst), 1, FLAG_STRIDE,
                                              self._seq_ptr(seq), self.layout.depth, dst, self._timeout_cycles,
                                              self._err.data_ptr(), self._stream()), "release wait")

    def signal_arrival(self, seq, dst, layer=None):
        flag, seq_word, _ = self.arrival_flag(seq, dst, layer)  # one thread: no CTA counter
        _call(self._lib.si_comm_signal_cuda(flag, seq_word, self._stream()), "arrive signal")

    def arrival_flag(self, seq, dst, layer=None):
        """(flag, seq, counter) addresses: the flag in dst's segment, the slot's sequence word and
        the flag's zeroed CTA counter, which a move kernel needs to publish it (``pack`` docstring)."""
        self._check()
        # flags are "every exchange up to seq": join the last copy-engine copy to dst first (a join
        # into the issuing stream, no fork of a copy stream)
        if dst in self._last_copy:
            _ok(self._rt.cudaStreamWaitEvent(self._stream_int(), self._last_copy[dst], 0), "cudaStreamWaitEvent")
        kind = ARRIVE if layer is None else LANDED + layer
        counter = self._arrive_counters.data_ptr() + 4 * self._counter_index(kind, dst)
        return self._flag_addr(self._peer_ptr[dst], kind, self.rank), self._seq_ptr(seq), counter

    def on_side_stream(self, seq, fn):
        self._check()
        self._side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._side):
            fn()
        self._side_done[self.layout.slot(seq)].record(self._side)

    def join_side_stream(self, seq):
        torch.cuda.current_stream(self.device).wait_event(self._side_done[self.layout.slot(seq)])

    def close(self):
        """Drain the copy streams, close the peers' IPC mappings, free the segment (before the
        process group goes away: peers must not hold a mapping of freed memory)."""
        if self._closed:
            return
        self._closed = True
        rt = self._rt
        torch.cuda.synchronize(self.device)
        self._side.synchronize()
        for s in self._streams.values():
            rt.cudaStreamSynchronize(s)
            rt.cudaStreamDestroy(s)
        for row in self._packed + self._copied:
            for ev in row:
                rt.cudaEventDestroy(ev)
        self._peer_seg = {}
        for p in self._peer_ptr.values():
            rt.cudaIpcCloseMemHandle(p)
        self._own = None
        if dist.is_initialized():
            dist.barrier(self.group)  # every peer closed its mapping of our segment
        rt.cudaFree(self._seg_ptr)
