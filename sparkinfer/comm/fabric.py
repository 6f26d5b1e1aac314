"""The fabric interface the exchange protocol runs on, and the shared lifecycle checks.

A fabric owns the slabs of one rank and the mechanics of moving one packed region to a peer.
The protocol (``exchange.py``) calls, for exchange number ``seq``::

    wait_send_free(seq, dst)   the send region of (slot, dst) is no longer read by an older copy
    wait_recv_free(seq, dst)   dst released the receive region this copy will overwrite
    copy(seq, dst, nbytes, offset, layer=None, src_offset=0)
                               one copy of send region bytes [src_offset, src_offset + nbytes) ->
                               dst's shared receive region at byte ``offset`` (this rank's part of
                               it), then arrive[rank] = seq (``layer`` None: the whole region
                               landed) or landed[layer][rank] = seq (one layer's section of it;
                               the region's arrive follows as a copy of 0 bytes). Copies of one
                               pair run in call order.
    wait_arrival(seq, src, layer=None)  src's region (or its layer-``layer`` section) for seq has
                               landed here
    release(seq, src)          this rank consumed src's region: ack for src
    close()

With device-side sizing (no record count ever reaches the host; see ``exchange.py``) the
sender writes straight into the destination's receive region instead of its send slab::

    wait_peer_free(seq, dst)   as wait_recv_free, ordered before the caller's next writes
    peer_region(seq, dst)      dst's shared receive region for the slot of seq, writable here
    signal_arrival(seq, dst, layer=None)
                               arrive[rank] = seq in dst's segment (``layer``: landed[layer][rank]),
                               after the writes before it
    arrival_flag(seq, dst, layer=None)
                               (flag, seq) int64 addresses for the kernel that writes dst's region
                               to publish it itself (``pack.direct(..., arrive=)``): that flag, and
                               a word holding seq; on the CUDA fabric a third, the flag's CTA
                               counter (``pack`` docstring, "Arrival"); what is issued next follows
                               the copies still queued to dst, as in ``signal_arrival``
    on_side_stream(seq, fn)    run ``fn`` (more ``peer_region`` writes and ``signal_arrival``s of
                               exchange seq) after everything issued so far, without holding up
                               what the caller issues next: the Shared layers' sections
    join_side_stream(seq)      what the caller issues next follows the side work of exchanges <= seq

    move_err                   the int32 error word the exchange passes to its moves (``err=``,
                               ``pack`` docstring, "Errors"): the CUDA fabric's device word, read a
                               step later (``comm.errors``); None on the host fabric, whose moves
                               raise at once
    copied_bytes, copies       list[int] per dst: bytes this rank's copies moved there and how many
                               non-empty copies (monotonic; the demo checks them against the byte
                               accounting)

Host fabric: these block the calling thread or queue work on the copy thread (side work: on a
side thread). CUDA fabric: they enqueue stream waits, copies and flag writes (side work: on a side
stream forked from and joined back into the compute stream), so the same call sequence is
asynchronous and graph-capturable. No protocol decision lives in a fabric.
"""

from __future__ import annotations

import abc
import itertools
import logging
import time

import torch

from sparkinfer.core.slab import SlabLayout

log = logging.getLogger("sparkinfer.comm")


class FabricError(RuntimeError):
    """A peer failed or timed out; the fabric is unusable afterwards (close it)."""


class PeerAccessError(RuntimeError):
    """The GPUs of the group cannot reach each other peer-to-peer (raised on every rank alike)."""


class Fabric(abc.ABC):
    kind: str
    rank: int
    world: int
    layout: SlabLayout
    device: torch.device
    move_err: torch.Tensor | None

    @abc.abstractmethod
    def send_region(self, seq: int, dst: int) -> torch.Tensor:
        """uint8 [region_bytes] view of this rank's send slab for (slot of seq, dst)."""

    @abc.abstractmethod
    def recv_region(self, seq: int) -> torch.Tensor:
        """uint8 [region_bytes] view of this rank's shared receive region for the slot of seq."""

    @abc.abstractmethod
    def wait_send_free(self, seq: int, dst: int) -> None: ...

    @abc.abstractmethod
    def wait_recv_free(self, seq: int, dst: int) -> None: ...

    @abc.abstractmethod
    def copy(self, seq: int, dst: int, nbytes: int, offset: int = 0, layer: int | None = None,
             src_offset: int = 0) -> None: ...

    @abc.abstractmethod
    def wait_arrival(self, seq: int, src: int, layer: int | None = None) -> None: ...

    @abc.abstractmethod
    def release(self, seq: int, src: int) -> None: ...

    @abc.abstractmethod
    def peer_region(self, seq: int, dst: int) -> torch.Tensor:
        """uint8 [region_bytes] view of dst's shared receive region for the slot of seq."""

    @abc.abstractmethod
    def wait_peer_free(self, seq: int, dst: int) -> None: ...

    @abc.abstractmethod
    def signal_arrival(self, seq: int, dst: int, layer: int | None = None) -> None: ...

    @abc.abstractmethod
    def arrival_flag(self, seq: int, dst: int, layer: int | None = None) -> tuple[int, ...]: ...

    @abc.abstractmethod
    def on_side_stream(self, seq: int, fn) -> None: ...

    @abc.abstractmethod
    def join_side_stream(self, seq: int) -> None: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def check_same_config(group, world: int, config: dict) -> None:
    """All-gather ``config`` over ``group``; raise the same ValueError on every rank if any differ."""
    import torch.distributed as dist

    gathered: list = [None] * world
    dist.all_gather_object(gathered, config, group=group)
    ref = gathered[0]
    for r, cfg in enumerate(gathered[1:], start=1):
        for key in sorted(set(ref) | set(cfg)):
            if ref.get(key) != cfg.get(key):
                raise ValueError(f"fabric configuration mismatch: field {key!r} is {ref.get(key)!r} on rank 0 "
                                 f"but {cfg.get(key)!r} on rank {r} (every rank must build the same exchange)")


_constructions = itertools.count()  # every rank builds its fabrics in the same order


def arrival_barrier(group, rank: int, world: int, timeout_s: float) -> None:
    """Wait until every rank of ``group`` arrived at this fabric construction, or raise on every
    rank naming the missing ones.

    Uses the process group's key-value store (check, not a collective), so each waiting rank can
    tell who is missing; a rank that gives up leaves an abort key, so a late rank raises too
    instead of blocking in the next collective.
    """
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    members = "all" if group is None else "-".join(map(str, dist.get_process_group_ranks(group)))
    name = f"sparkinfer/comm/{members}/{next(_constructions)}"
    store.set(f"{name}/{rank}", "1")
    deadline = time.monotonic() + timeout_s
    while True:
        if store.check([f"{name}/abort"]):
            raise FabricError(f"rank {rank}: fabric construction aborted by a peer: "
                              f"{store.get(f'{name}/abort').decode()}")
        missing = [r for r in range(world) if not store.check([f"{name}/{r}"])]
        if not missing:
            return
        if time.monotonic() > deadline:
            why = f"rank(s) {missing} did not arrive within {timeout_s:g} s"
            store.set(f"{name}/abort", f"rank {rank} gave up: {why}")
            raise FabricError(f"rank {rank}: fabric construction timed out: {why}; missing peer(s): {missing}")
        time.sleep(0.01)
