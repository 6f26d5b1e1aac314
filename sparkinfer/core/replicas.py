"""Replica records: the committed records every rank keeps although it does not own them (torch-free).

Under TP every rank computes every new token's latent and rope (the hidden states are replicated
and ``kv_a_proj_with_mqa`` is a replicated projection), so every rank can encode every token's
record at the cache write. Stock DCP keeps only the owned share; the replica store keeps the most
recent ``window`` positions of each request too, at no PCIe cost. A record in the window is local
on every rank: the exchange does not move it.

The rule is arithmetic on what every rank already has (the scheduler's per-step rows and
contexts, and a stable request key), so all ranks reach the same answer with no message:

* A request owns one **slot** of the store: a ring of ``window`` rows per layer; position ``p`` is
  written at row ``slot * window + p % window`` (every position, own ones too: attention then reads
  one place for the whole window; it costs ``1 / D`` more store than keeping remote ones only).
* Per slot the rule tracks ``lo`` (first position of the current contiguous run of writes) and
  ``hi`` (one past the highest position ever written in it). Writes of a step cover ``[start,
  start + n)``; a write that starts at 0 (a new or re-prefilled request), before ``lo`` or after
  ``hi`` (a gap) begins a new run.
* After the step's writes, the rows hold every committed position in ``[max(lo, hi - window),
  start)``: a row is only ever overwritten by a position ``window`` or more above it, and every
  position below ``start`` was last written by the write the scheduler accepted (rejected drafts
  sit at positions ``>= start`` and are rewritten before they become committed). Those positions
  are **held**; positions ``>= start`` are the step's own rows (local anyway).
* Slots are assigned lowest-free first; a new request that finds none evicts the least recently
  written slot (ties: lowest slot) that the step does not use. More requests in one step than
  slots: the extra ones get no slot (nothing held), never a wrong one.
* ``drop(key)`` forgets a request (end, abort, preemption, freed blocks).

Keys must not be shared by two live requests; a key reused by a later request is safe because the
later request's first write starts at position 0 (without prefix caching every request's first
step does), which starts a new run. Engines with prefix caching must not use this rule (a request
may then begin at a context > 0 under a recycled key).

Store layout (owned by the executor): per layer ``uint8 [slots * window, record_bytes]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StepReplicas:
    """One step's replica map, per request of the step (arrays of length B, in step order).

    slot   int64: the request's store slot, -1 for none
    lo     int64: first held position; ``[lo, start)`` is in the store (``lo == start``: nothing)
    start  int64: the step's first position (the context before the step)
    n      int64: positions the step writes
    """

    window: int
    slot: np.ndarray
    lo: np.ndarray
    start: np.ndarray
    n: np.ndarray

    @property
    def held_counts(self) -> np.ndarray:
        """int64 [B]: committed positions held per request."""
        return self.start - self.lo

    @property
    def all_local(self) -> bool:
        """Every request holds its whole context: the step needs no record from another rank."""
        return bool((self.lo == 0).all())

    def held_mask(self, union: np.ndarray, counts: np.ndarray | None = None) -> np.ndarray:
        """bool [B, U]: union token (int [B, U], -1 pad; ``counts`` optional) is a held replica."""
        union = np.asarray(union)
        held = (union >= self.lo[:, None]) & (union < self.start[:, None])
        if counts is not None:
            held &= np.arange(union.shape[1])[None, :] < np.asarray(counts)[:, None]
        return held

    def rows(self, b: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """int64: store row of position ``pos`` of request ``b`` (arrays of one shape)."""
        return self.slot[b] * self.window + np.asarray(pos) % self.window

    def write_rows(self) -> np.ndarray:
        """int64 [sum(n)]: store row of each token row the step writes, request-major, -1 where it
        is not kept (no slot, or a chunk longer than the window: only its last ``window`` stay, so
        one write never hits a row twice)."""
        b = np.repeat(np.arange(len(self.n)), self.n)
        pos = np.concatenate([np.arange(s, s + n) for s, n in zip(self.start, self.n)]) if len(self.n) else \
            np.zeros(0, np.int64)
        keep = (self.slot[b] >= 0) & (pos >= (self.start + self.n - self.window)[b])
        return np.where(keep, self.rows(b, pos), -1).astype(np.int64)


class ReplicaWindow:
    """The replica rule for one engine: ``window`` positions per request, ``slots`` requests.

    ``window`` 0 disables replicas (every step holds nothing).
    """

    def __init__(self, window: int, slots: int):
        for name, v, lo in (("window", window, 0), ("slots", slots, 1)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
                raise ValueError(f"replica {name} must be an int >= {lo}, got {v!r}")
        self.window, self.slots = int(window), int(slots)
        self._slot_of: dict = {}  # key -> slot
        self._key = [None] * self.slots  # slot -> key
        self._lo = np.zeros(self.slots, np.int64)
        self._hi = np.zeros(self.slots, np.int64)
        self._used = np.full(self.slots, -1, np.int64)  # step clock of the last write
        self.clock = 0

    def _allocate(self, key, busy: set) -> int:
        free = [s for s in range(self.slots) if self._key[s] is None]
        if free:
            slot = free[0]
        else:
            candidates = [s for s in range(self.slots) if s not in busy]
            if not candidates:
                return -1
            slot = min(candidates, key=lambda s: (self._used[s], s))
            del self._slot_of[self._key[slot]]
        self._key[slot] = key
        self._slot_of[key] = slot
        self._used[slot] = -1
        return slot

    def begin_step(self, keys, starts, lens) -> StepReplicas:
        """Record a step that writes positions ``[starts[b], starts[b] + lens[b])`` of request
        ``keys[b]`` and return what every rank holds for it (after the step's writes)."""
        keys = list(keys)
        starts = np.asarray(starts, np.int64).reshape(-1)
        lens = np.asarray(lens, np.int64).reshape(-1)
        B = len(keys)
        if starts.shape != (B,) or lens.shape != (B,):
            raise ValueError(f"{B} keys need {B} starts and lens, got {starts.shape} and {lens.shape}")
        if len(set(keys)) != B:
            raise ValueError("a request key appears twice in one step")
        if B and ((starts < 0).any() or (lens < 0).any()):
            raise ValueError("starts and lens must be >= 0")
        self.clock += 1
        slot = np.full(B, -1, np.int64)
        lo = starts.copy()
        if self.window == 0:
            return StepReplicas(0, slot, lo, starts, lens)
        busy = {self._slot_of[k] for k in keys if k in self._slot_of}
        for b, key in enumerate(keys):
            s, n = int(starts[b]), int(lens[b])
            k = self._slot_of.get(key)
            if k is None:
                k = self._allocate(key, busy)
                if k < 0:
                    continue
                busy.add(k)
                self._lo[k], self._hi[k] = s, s + n
            elif s == 0 or s < self._lo[k] or s > self._hi[k]:
                self._lo[k], self._hi[k] = s, s + n
            else:
                self._hi[k] = max(self._hi[k], s + n)
            self._used[k] = self.clock
            slot[b] = k
            lo[b] = min(s, max(self._lo[k], self._hi[k] - self.window))
        return StepReplicas(self.window, slot, lo, starts, lens)

    def drop(self, key) -> bool:
        """Forget request ``key`` (end, abort, preemption, freed blocks); True if it had a slot."""
        k = self._slot_of.pop(key, None)
        if k is None:
            return False
        self._key[k] = None
        self._used[k] = -1
        return True


def window_for_budget(budget_bytes: int, slots: int, layers: int, record_bytes: int) -> int:
    """Positions per request a store of ``budget_bytes`` per rank holds for ``slots`` requests."""
    if min(slots, layers, record_bytes) < 1:
        raise ValueError(f"slots, layers and record_bytes must be >= 1, got {slots}, {layers}, {record_bytes}")
    return max(0, int(budget_bytes) // (slots * layers * record_bytes))


def store_bytes(window: int, slots: int, layers: int, record_bytes: int) -> int:
    """Bytes per rank of a replica store (every layer's rings)."""
    return int(window) * int(slots) * int(layers) * int(record_bytes)


def write_hbm_bytes(record_bytes: int, layers: int) -> int:
    """Extra device-memory bytes written per new token per rank by the replica writes (every layer's
    record, beside the owner's shard write that stock DCP does anyway)."""
    return int(record_bytes) * int(layers)
