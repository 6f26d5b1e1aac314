"""Cross-step record reuse: which remote records each destination already holds (torch-free).

A committed token's record at a given layer never changes, and consecutive
decode steps of a request select heavily overlapping top-k sets. So a
destination rank that received token ``t``'s record for layer ``l`` of
request ``r`` in an earlier step can keep it in a reuse pool and the next
exchange only moves what is missing.

Every rank runs one :class:`ReuseTracker` that models the pools of *all*
destinations of the DCP group. Its inputs are data every rank already has
(the replicated indexer makes top-k and union identical on all ranks; the
scheduler's committed lengths and request events are identical too), and its
state is a pure function of the sequence of calls, so all ranks agree on what
every destination holds without exchanging a message. ``held()`` is the
``held`` mask ``build_planes`` takes (``held_group`` for one exchange carrying
several layers); ``steady_new_fraction`` is the observed warm-pool miss share the
policy amortises a cold pool's warm-up against.

Invariants (``tests/core/test_reuse.py`` checks them with hypothesis):

1. Only committed positions are held: ``commit`` stores a union token only if
   ``t < committed_len[b]``; speculative positions are overwritten when a draft
   is rejected, so a position ``>= committed_len`` is also dropped from the
   pool at ``commit`` (a rollback) and by ``invalidate_from``.
2. A destination never holds its own tokens (they are in its shard).
3. ``drop_request`` (request end, preemption) and ``invalidate_range`` (a KV
   block freed or reused) remove every entry of those positions.
4. Each destination's pool has a hard budget of ``capacity`` rows, either
   shared by all layers (``num_layers=None``) or split evenly, ``quota =
   capacity // num_layers`` rows per layer. Occupancy never exceeds the
   budget, slots are unique, and eviction is deterministic, inside the
   partition being committed: least recently used first, ties by (request,
   layer, token). Layers are visited cyclically every step, so a shared LRU
   pool smaller than the sum of the layers' unions evicts each layer's
   records just before they are needed again (measured: no reuse at all);
   per-layer quotas keep each layer's stable core.
5. ``held`` is True only where the record is in the destination's pool, so
   the exchange's planes carry exactly the missing records.

Pool layout (owned by the executor, described here because the slots are
assigned here): per destination rank, ``uint8 [capacity, record_bytes]`` (with
``num_layers``, layer ``l`` owns rows ``[l * quota, (l + 1) * quota)``);
``slots()`` gives the pool row of every held union record (copy it into the
workspace instead of receiving it) and ``commit`` returns the rows where the
records received this step are to be stored.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_EMPTY = np.zeros(0, np.int64)


@dataclass
class _Entries:
    """One (destination, request, layer): parallel arrays, sorted by token."""

    tokens: np.ndarray
    slots: np.ndarray
    used: np.ndarray  # clock of the last step that needed the record

    def keep(self, mask: np.ndarray) -> np.ndarray:
        """Keep entries where ``mask``; return the freed slots."""
        freed = self.slots[~mask]
        self.tokens, self.slots, self.used = self.tokens[mask], self.slots[mask], self.used[mask]
        return freed


@dataclass(frozen=True)
class CommitResult:
    """Records one ``commit`` stored, per destination: arrays of (b, u, pool slot)."""

    stored: tuple  # per dst: (b int64 [n], u int64 [n], slot int64 [n])
    evicted: np.ndarray  # int64 [D]: entries evicted to make room

    @property
    def stored_count(self) -> np.ndarray:
        return np.array([len(s[2]) for s in self.stored], np.int64)


class ReuseTracker:
    """Replicated model of every destination's reuse pool.

    layout           DcpLayout (``world_size``, ``owner_and_local``)
    capacity         pool rows per destination rank (a hard memory budget:
                     ``capacity * record_bytes`` bytes per rank); 0 disables reuse
    num_layers       None: one pool shared by all layers (any hashable layer id);
                     an int: layer ids are ints in ``[0, num_layers)``, each gets
                     ``capacity // num_layers`` rows (use it when the budget is below
                     the sum of the layers' unions)
    """

    def __init__(self, layout, capacity: int, num_layers: int | None = None):
        for name, v, lo in (("capacity", capacity, 0), ("num_layers", 1 if num_layers is None else num_layers, 1)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
        self.layout = layout
        self.world_size = layout.world_size
        self.num_layers = None if num_layers is None else int(num_layers)
        parts = 1 if num_layers is None else self.num_layers
        self.quota = int(capacity) // parts  # rows per partition
        self.capacity = self.quota * parts
        self.clock = 0
        self._warm: dict = {}  # req -> (hits, remote union records) over warm commits
        self._entries: list[dict] = [dict() for _ in range(self.world_size)]  # (req, layer) -> _Entries
        self.parts = parts
        # bool [D, capacity]: pool row free; a commit takes the lowest free rows of its partition
        self._is_free = np.ones((self.world_size, self.capacity), bool)

    @classmethod
    def from_budget(cls, layout, budget_bytes: int, record_bytes: int,
                    num_layers: int | None = None) -> "ReuseTracker":
        if record_bytes <= 0:
            raise ValueError(f"record_bytes must be > 0, got {record_bytes}")
        return cls(layout, int(budget_bytes) // int(record_bytes), num_layers)

    # ------------------------------------------------------------ queries

    def occupancy(self) -> np.ndarray:
        """int64 [D]: pool rows in use per destination."""
        return (self.capacity - self._is_free.sum(axis=1)).astype(np.int64)

    def holdings(self, dst: int, req, layer) -> np.ndarray:
        """Sorted tokens ``dst`` holds for (req, layer)."""
        e = self._entries[dst].get((req, layer))
        return _EMPTY if e is None else e.tokens.copy()

    def _lookup(self, layer, req_ids, union, counts):
        union, counts = _check_union(union, counts, req_ids)
        self._check_layer(layer)
        d = self.world_size
        b, u = union.shape
        slots = np.full((d, b, u), -1, np.int64)
        valid = np.arange(u)[None, :] < counts[:, None]
        for dst in range(d):
            for i, req in enumerate(req_ids):
                e = self._entries[dst].get((req, layer))
                if e is None or len(e.tokens) == 0 or counts[i] == 0:
                    continue
                toks = union[i, :counts[i]]
                pos = np.searchsorted(e.tokens, toks)
                pos_c = np.minimum(pos, len(e.tokens) - 1)
                hit = e.tokens[pos_c] == toks
                slots[dst, i, :counts[i]] = np.where(hit, e.slots[pos_c], -1)
        return slots, valid

    def slots(self, layer, req_ids, union, counts) -> np.ndarray:
        """int64 [D, B, U]: pool row of each union record its destination holds, else -1."""
        return self._lookup(layer, req_ids, union, counts)[0]

    def held(self, layer, req_ids, union, counts) -> np.ndarray:
        """bool [D_dst, B, U]: destination already holds that union record (``build_planes``'s hook).

        union    int [B, U] token ids in union order, entries past counts[b] ignored
        counts   int [B]
        req_ids  B hashable request ids (stable across steps)
        """
        return self._lookup(layer, req_ids, union, counts)[0] >= 0

    def held_group(self, layers, req_ids, union, counts) -> np.ndarray:
        """bool [D_dst, B, U]: held for *every* layer of ``layers`` (one exchange carrying a Full
        layer and its Shared layers, which share one union, moves a record unless all hold it)."""
        layers = list(layers)
        if not layers:
            raise ValueError("layers must name at least one layer")
        out = self.held(layers[0], req_ids, union, counts)
        for layer in layers[1:]:
            out &= self.held(layer, req_ids, union, counts)
        return out

    def steady_new_fraction(self, req, prior: float) -> float:
        """Share of ``req``'s remote union records a *warm* pool did not hold, observed over its
        commits so far (a commit is warm for a (destination, layer) that already held records of
        the request); ``prior`` until there is an observation. The policy's steady-state reuse."""
        hits, remote = self._warm.get(req, (0, 0))
        return prior if remote == 0 else 1.0 - hits / remote

    # ------------------------------------------------------------ updates

    def commit(self, layer, req_ids, union, counts, committed_len) -> CommitResult:
        """After a step's acceptance: store what each destination received for ``layer``.

        committed_len  int [B]: positions ``< committed_len[b]`` are final. Union
                       tokens at or past it were speculative and are not stored;
                       held entries at or past it (a rollback) are dropped.
        Records a destination used from its pool this step count as used now.
        Returns where each newly stored record goes in its destination's pool.
        """
        union, counts = _check_union(union, counts, req_ids)
        committed_len = np.asarray(committed_len, np.int64)
        if committed_len.shape != (len(req_ids),):
            raise ValueError(f"committed_len must be int [B={len(req_ids)}], got shape {committed_len.shape}")
        self.clock += 1
        now = self.clock
        for i, req in enumerate(req_ids):
            self.invalidate_from(req, int(committed_len[i]), layers=(layer,))
        slots, valid = self._lookup(layer, req_ids, union, counts)
        owner = np.asarray(self.layout.owner_and_local(np.where(valid, union, 0))[0], np.int64)
        stored, evicted = [], np.zeros(self.world_size, np.int64)
        for dst in range(self.world_size):
            # refresh what was used, collect what is new, in request-major union order
            new_b, new_u = [], []
            for i, req in enumerate(req_ids):
                e = self._entries[dst].get((req, layer))
                row = slots[dst, i]
                if e is not None:
                    e.used[np.isin(e.slots, row[row >= 0])] = now
                    remote = valid[i] & (owner[i] != dst)
                    h, r = self._warm.get(req, (0, 0))
                    self._warm[req] = (h + int((remote & (row >= 0)).sum()), r + int(remote.sum()))
                want = valid[i] & (row < 0) & (owner[i] != dst) & (union[i] < committed_len[i])
                idx = np.nonzero(want)[0]
                new_b.append(np.full(len(idx), i, np.int64))
                new_u.append(idx)
            nb = np.concatenate(new_b) if new_b else _EMPTY
            nu = np.concatenate(new_u) if new_u else _EMPTY
            nb, nu = nb[:self.quota], nu[:self.quota]
            part = self._part(layer)
            evicted[dst] = self._make_room(dst, part, len(nb))
            got = self._take(dst, part, len(nb))
            for i in np.unique(nb):
                sel = nb == i
                self._insert(dst, (req_ids[i], layer), union[i, nu[sel]], got[sel], now)
            stored.append((nb, nu, got))
        return CommitResult(tuple(stored), evicted)

    def _insert(self, dst, key, tokens, slots, now):
        e = self._entries[dst].get(key)
        tokens = np.asarray(tokens, np.int64)
        if e is None:
            e = self._entries[dst][key] = _Entries(_EMPTY, _EMPTY, _EMPTY)
        t = np.concatenate([e.tokens, tokens])
        order = np.argsort(t, kind="stable")
        e.tokens = t[order]
        e.slots = np.concatenate([e.slots, slots])[order]
        e.used = np.concatenate([e.used, np.full(len(tokens), now, np.int64)])[order]

    def _make_room(self, dst: int, part: int, n: int) -> int:
        """Evict least recently used entries of ``dst``'s partition until ``n`` of its rows are free."""
        short = n - int(self._free_rows(dst, part).size)
        if short <= 0:
            return 0
        keys = sorted((k for k in self._entries[dst] if self._part(k[1]) == part), key=_key_order)
        used = np.concatenate([self._entries[dst][k].used for k in keys])
        key_id = np.concatenate([np.full(len(self._entries[dst][k].used), j) for j, k in enumerate(keys)])
        tok = np.concatenate([self._entries[dst][k].tokens for k in keys])
        victims = np.lexsort((tok, key_id, used))[:short]  # last key is primary: used, key, token
        drop = np.zeros(len(used), bool)
        drop[victims] = True
        start = 0
        for k in keys:
            e = self._entries[dst][k]
            n_k = len(e.tokens)
            self._release(dst, e.keep(~drop[start:start + n_k]))
            start += n_k
        self._prune(dst)
        return short

    def _free_rows(self, dst: int, part: int) -> np.ndarray:
        """Sorted free pool rows of ``dst``'s partition ``part``."""
        lo = part * self.quota
        return np.flatnonzero(self._is_free[dst, lo:lo + self.quota]) + lo

    def _take(self, dst: int, part: int, n: int) -> np.ndarray:
        got = self._free_rows(dst, part)[:n].astype(np.int64)
        self._is_free[dst, got] = False
        return got

    def _release(self, dst, slots):
        self._is_free[dst, slots] = True

    def _part(self, layer) -> int:
        """The pool partition of ``layer``: 0 for a shared pool, else the layer itself."""
        return 0 if self.num_layers is None else int(layer)

    def _check_layer(self, layer):
        if self.num_layers is None:
            return
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be an int in [0, {self.num_layers}), got {layer!r}")

    def _prune(self, dst):
        for k in [k for k, e in self._entries[dst].items() if len(e.tokens) == 0]:
            del self._entries[dst][k]

    def invalidate_from(self, req, position: int, layers=None) -> int:
        """Drop ``req``'s records at positions ``>= position`` (rejected drafts, rollback)."""
        return self.invalidate_range(req, position, None, layers)

    def invalidate_range(self, req, start: int, end: int | None = None, layers=None) -> int:
        """Drop ``req``'s records at positions in ``[start, end)`` (a freed or reused KV block).

        ``layers`` limits it to those layers (default: all). Returns entries dropped.
        """
        dropped = 0
        for dst in range(self.world_size):
            for (r, layer), e in self._entries[dst].items():
                if r != req or (layers is not None and layer not in layers):
                    continue
                hit = e.tokens >= start
                if end is not None:
                    hit &= e.tokens < end
                if hit.any():
                    self._release(dst, e.keep(~hit))
                    dropped += int(hit.sum())
            self._prune(dst)
        return dropped

    def drop_request(self, req) -> int:
        """Request finished or preempted: free all its entries and its observed reuse. Returns
        entries dropped."""
        self._warm.pop(req, None)
        return self.invalidate_range(req, 0, None)


def _key_order(key):
    req, layer = key
    return (str(type(req)), req, str(type(layer)), layer)


def _check_union(union, counts, req_ids):
    union = np.asarray(union, np.int64)
    counts = np.asarray(counts, np.int64)
    if union.ndim != 2:
        raise ValueError(f"union must be int [B, U], got shape {union.shape}")
    if counts.shape != (union.shape[0],) or len(req_ids) != union.shape[0]:
        raise ValueError(f"counts [{counts.shape}] and req_ids ({len(req_ids)}) must have B={union.shape[0]} entries")
    if len(set(req_ids)) != len(req_ids):
        raise ValueError("req_ids must be distinct")
    if np.any(counts < 0) or np.any(counts > union.shape[1]):
        raise ValueError(f"counts must lie in [0, U={union.shape[1]}]")
    valid = np.arange(union.shape[1])[None, :] < counts[:, None]
    if np.any(union[valid] < 0):
        raise ValueError("union entries before counts[b] must be token ids >= 0")
    # distinct negatives for unused entries, then any equal neighbours after a row sort are repeats
    keyed = np.where(valid, union, -1 - np.arange(union.shape[1])[None, :])
    srt = np.sort(keyed, axis=1)
    rep = np.nonzero((srt[:, 1:] == srt[:, :-1]).any(axis=1))[0]
    if len(rep):
        raise ValueError(f"union row {int(rep[0])} repeats a token (a union lists each token once)")
    return union, counts
