"""Cross-step reuse tracker on device tensors: the torch twin of ``core.reuse.ReuseTracker``.

Same rules, same results (held masks, pool slots, stored rows, evictions,
invalidation counts, warm-pool statistics) as the numpy reference, which
``tests/plan/test_reuse_device.py`` checks call by call on hypothesis-generated
sequences. The reference is the documentation of the rules; this file only
says how they are vectorized.

Differences in the interface (not in the rules):

* request ids are ints in ``[0, max_requests)`` (a scheduler slot or counter,
  identical on every rank; the LRU tie-break orders them numerically, as the
  reference does for int ids), layer ids are ints (``[0, num_layers)``, or
  ``[0, 256)`` for a shared pool);
* ``commit`` returns a :class:`DeviceCommit` (dense ``[D, B, U]`` slot tensor)
  instead of per-destination host arrays; ``to_host()`` converts;
* ``slots_layers`` / ``commit_layers`` (per-layer quotas only) take consecutive
  layers with one union each (``[L, B, U]``) in one call, equal to the per-layer
  calls in ascending order: the same ops over ``L`` partitions, so a whole
  step's commit costs one call's kernel launches;
* with ``validate=False`` the per-call path checks shapes only and never waits
  on the device (no ``.item()``, no boolean indexing): what a CUDA graph or a
  stream-ordered decode step needs. ``validate=True`` (default) also checks
  values (token range, repeats, counts, request ids), which reads one flag back.

State (``P`` partitions = ``num_layers`` or 1 for a shared pool, ``D``
destinations, ``Q = capacity // P`` rows per partition), preallocated once::

    keys  int64 [P, D, Q]  packed (request, layer, token), ascending; unused tail = PAD
    rows  int64 [P, D, Q]  pool row (inside the partition) of each key
    used  int64 [P, D, Q]  clock of the last commit that needed the record; DEAD = free entry
    warm  int64 [max_requests, 2]  (pool hits, remote union records) over warm commits

A key is ``request * 2**40 + layer * 2**32 + token``, so the table order is the
reference's (request, layer, token) tie-break order and one (request, layer)
is a contiguous key range. Invalidation marks entries DEAD in place (the key
stays, so the table stays sorted); the next ``commit`` of the partition
compacts them away while merging in the new keys. The slot returned for a
record is ``partition * Q + row``, the reference's pool-row numbering.

Per ``commit`` (its partitions and all destinations at once): rollback = the
table spans ``[committed_len, end of layer)`` of the batch's requests
(``searchsorted`` of their bounds, then a difference array); lookup =
``searchsorted`` of the packed union into each destination's keys;
LRU refresh = ``scatter_reduce(amax)`` of the clock; eviction = a stable sort
of ``used`` (ties keep key order) whose first ``short[d]`` entries go; new rows
= the ``k``-th lowest free row (free rows compacted by a prefix-sum scatter);
insertion = one sort of table + new keys. Cost: ``O((Q + B*U) log)`` per
call, independent of how many requests or layers the pool holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from sparkinfer.core.reuse import CommitResult, ReuseTracker

TOKEN_BITS = 32
LAYER_BITS = 8
REQUEST_BITS = 63 - TOKEN_BITS - LAYER_BITS
TOKEN_END = 1 << TOKEN_BITS  # exclusive bound on token ids
PAD = torch.iinfo(torch.int64).max  # key of an unused table entry (sorts last)
DEAD = torch.iinfo(torch.int64).max  # ``used`` of a free or invalidated entry (evicted last)


def _pack(req, layer, token):
    """Key of (request, layer, token); ``token == TOKEN_END`` or ``layer == 2**LAYER_BITS`` give
    the exclusive end of a range (the sum carries into the next field)."""
    return req * (1 << (TOKEN_BITS + LAYER_BITS)) + layer * TOKEN_END + token


@dataclass(frozen=True)
class DeviceCommit:
    """What one ``commit`` stored, all destinations at once (on the tracker's device).

    slot     int64 [D, B, U]: pool row where destination d stores union record (b, u), -1 where
             it stores nothing (held already, own token, speculative, past the quota, padding)
    evicted  int64 [D]: entries evicted to make room
    (``commit_layers``: a leading layer dimension, [L, D, B, U] and [L, D]; ``layer(i)`` picks one)
    """

    slot: torch.Tensor
    evicted: torch.Tensor

    def layer(self, i: int) -> "DeviceCommit":
        """Layer ``i`` of a ``commit_layers`` result ([L, D, B, U] / [L, D])."""
        return DeviceCommit(self.slot[i], self.evicted[i])

    def to_host(self) -> CommitResult:
        """The reference's ``CommitResult``: per destination (b, u, slot) in request-major order."""
        slot = self.slot.cpu().numpy()
        stored = []
        for s in slot:
            b, u = np.nonzero(s >= 0)
            stored.append((b.astype(np.int64), u.astype(np.int64), s[b, u]))
        return CommitResult(tuple(stored), self.evicted.cpu().numpy().astype(np.int64))


class DeviceReuseTracker:
    """Replicated model of every destination's reuse pool, on ``device``.

    layout        DcpLayout (``world_size``, ``interleave``)
    capacity      pool rows per destination (0 disables reuse)
    num_layers    None: one pool shared by all layers; an int: ``capacity // num_layers`` rows
                  per layer, layer ids in ``[0, num_layers)``
    max_requests  request ids are ints in ``[0, max_requests)``
    validate      check input values too (reads a flag back from the device)
    """

    def __init__(self, layout, capacity: int, num_layers: int | None = None, *, max_requests: int = 1024,
                 device="cpu", validate: bool = True):
        for name, v, lo, hi in (("capacity", capacity, 0, None),
                                ("num_layers", 1 if num_layers is None else num_layers, 1, 1 << LAYER_BITS),
                                ("max_requests", max_requests, 1, 1 << REQUEST_BITS)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo or (hi and v > hi):
                raise ValueError(f"{name} must be an int in [{lo}, {hi or 'inf'}], got {v!r}")
        self.layout = layout
        self.world_size = d = layout.world_size
        self.num_layers = None if num_layers is None else int(num_layers)
        self.parts = 1 if num_layers is None else self.num_layers
        self.quota = q = int(capacity) // self.parts
        self.capacity = q * self.parts
        self.max_requests = int(max_requests)
        self.device = torch.device(device)
        self.validate = bool(validate)
        self.clock = 0  # host int: advances once per commit on every rank alike, never read back
        shape = (self.parts, d, q)
        self._keys = torch.full(shape, PAD, dtype=torch.int64, device=self.device)
        self._rows = torch.zeros(shape, dtype=torch.int64, device=self.device)
        self._used = torch.full(shape, DEAD, dtype=torch.int64, device=self.device)
        self._warm = torch.zeros((self.max_requests, 2), dtype=torch.int64, device=self.device)
        self._arange_q = torch.arange(q, device=self.device)
        self._dst = torch.arange(d, device=self.device).view(1, d, 1, 1)
        self._layer_ids = torch.arange(1 << LAYER_BITS, device=self.device)

    # ------------------------------------------------------------ inputs

    def _span(self, layers) -> tuple[int, int]:
        """(first layer, L) of ``layers``: one layer, or (per-layer quotas only) consecutive ones."""
        layers = list(layers)
        if not layers:
            raise ValueError("layers must name at least one layer")
        for layer in layers:
            self._part(layer)
        if len(layers) > 1 and (self.num_layers is None or layers != list(range(layers[0], layers[0] + len(layers)))):
            raise ValueError(f"several layers at once need per-layer quotas (num_layers) and consecutive "
                             f"ascending layer ids, got {layers!r}")
        return int(layers[0]), len(layers)

    def _part(self, layer) -> int:
        hi = self.num_layers if self.num_layers is not None else 1 << LAYER_BITS
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not 0 <= layer < hi:
            raise ValueError(f"layer must be an int in [0, {hi}), got {layer!r}")
        return 0 if self.num_layers is None else int(layer)

    def _vector(self, name, x, shape):
        x = torch.as_tensor(x, device=self.device)
        if tuple(x.shape) != shape or x.is_floating_point() or x.dtype == torch.bool:
            raise ValueError(f"{name} must be an int tensor {list(shape)}, got {x.dtype} {tuple(x.shape)}")
        return x.to(torch.int64)

    def _inputs(self, layers, req_ids, union, counts, one_layer):
        """Checked (first layer, L, req int64 [B], union int64 [L, B, U], counts int64 [L, B],
        valid bool [L, B, U]); ``one_layer``: union [B, U] and counts [B] of one layer."""
        l0, n = self._span(layers)
        union = torch.as_tensor(union, device=self.device)
        dims = "[B, U]" if one_layer else "[L, B, U]"
        if union.ndim != 3 - one_layer or union.is_floating_point() or union.dtype == torch.bool:
            raise ValueError(f"union must be int {dims}, got {union.dtype} {tuple(union.shape)}")
        union = union.to(torch.int64)
        union = union[None] if one_layer else union
        if union.shape[0] != n:
            raise ValueError(f"union must hold one [B, U] union per layer ({n}), got {tuple(union.shape)}")
        _, b, u = union.shape
        req = self._vector("req_ids", req_ids, (b,))
        counts = self._vector("counts", counts, (b,) if one_layer else (n, b)).view(n, b)
        valid = torch.arange(u, device=self.device) < counts[:, :, None]
        if self.validate:
            self._check_values(req, union, counts, valid)
        return l0, n, req, union, counts, valid

    def _check_values(self, req, union, counts, valid):
        u = union.shape[-1]
        bad_req = ((req < 0) | (req >= self.max_requests)).any()
        srt = torch.sort(req).values
        dup_req = (srt[1:] == srt[:-1]).any()
        bad_cnt = ((counts < 0) | (counts > u)).any()
        bad_tok = (valid & ((union < 0) | (union >= TOKEN_END))).any()
        keyed = torch.where(valid, union, -1 - torch.arange(u, device=self.device))
        srt = torch.sort(keyed, dim=-1).values
        rep = (srt[..., 1:] == srt[..., :-1]).any()
        flags = torch.stack([bad_req, dup_req, bad_cnt, bad_tok, rep]).tolist()  # the one read-back
        for flag, msg in zip(flags, (
                f"req_ids must be ints in [0, max_requests={self.max_requests})",
                "req_ids must be distinct",
                f"counts must lie in [0, U={u}]",
                f"union entries before counts[b] must be token ids in [0, 2**{TOKEN_BITS})",
                "a union row repeats a token (a union lists each token once)")):
            if flag:
                raise ValueError(msg)

    def _tables(self, l0, n):
        """(keys, rows, used, layer ids int64 [L, 1, 1], partitions int64 [L, 1, 1]): views of the
        layers' partitions (consecutive, so no copy)."""
        p0 = self._part(l0)
        span = slice(p0, p0 + n)
        ids = self._layer_ids[l0:l0 + n].view(n, 1, 1)
        return self._keys[span], self._rows[span], self._used[span], ids, self._layer_ids[span].view(n, 1, 1)

    def _find(self, keys, used, keys_q, valid):
        """(clamped table position, hit) int64/bool [L, D, B*U] of every query key in every destination."""
        n, d = keys.shape[:2]
        flat = keys_q.reshape(n, 1, -1).expand(n, d, -1).contiguous()
        pos = torch.searchsorted(keys, flat).clamp_(max=self.quota - 1)
        hit = (keys.gather(2, pos) == flat) & (used.gather(2, pos) != DEAD) & valid.reshape(n, 1, -1)
        return pos, hit

    # ------------------------------------------------------------ queries

    def slots(self, layer, req_ids, union, counts) -> torch.Tensor:
        """int64 [D, B, U]: pool row of each union record its destination holds, else -1.
        ``slots(...) >= 0`` is ``held(...)``: one lookup serves both when both are needed."""
        return self._slots(self._inputs([layer], req_ids, union, counts, True))[0]

    def slots_layers(self, layers, req_ids, unions, counts) -> torch.Tensor:
        """int64 [L, D, B, U]: ``slots`` of consecutive layers (unions [L, B, U], counts [L, B]) in one call."""
        return self._slots(self._inputs(layers, req_ids, unions, counts, False))

    def _slots(self, inputs):
        l0, n, req, union, counts, valid = inputs
        d, (_, b, u) = self.world_size, union.shape
        if self.quota == 0:
            return torch.full((n, d, b, u), -1, dtype=torch.int64, device=self.device)
        keys, rows, used, ids, parts = self._tables(l0, n)
        pos, hit = self._find(keys, used, _pack(req[:, None], ids, torch.where(valid, union, 0)), valid)
        return torch.where(hit, rows.gather(2, pos) + parts * self.quota, -1).view(n, d, b, u)

    def held(self, layer, req_ids, union, counts) -> torch.Tensor:
        """bool [D_dst, B, U]: destination already holds that union record (``build_planes``'s hook)."""
        return self.slots(layer, req_ids, union, counts) >= 0

    def held_group(self, layers, req_ids, union, counts) -> torch.Tensor:
        """bool [D_dst, B, U]: held for *every* layer of ``layers`` (one exchange carrying a Full
        layer and its Shared layers, one union). Consecutive layers with per-layer quotas take one
        lookup call; otherwise the reference's AND over ``held``."""
        layers = list(layers)
        if self.num_layers is None or len(layers) < 2 or layers != list(range(layers[0], layers[0] + len(layers))):
            return ReuseTracker.held_group(self, layers, req_ids, union, counts)
        union, counts = torch.as_tensor(union, device=self.device), torch.as_tensor(counts, device=self.device)
        if union.ndim != 2 or counts.ndim != 1:
            raise ValueError(f"union must be int [B, U] and counts int [B], got {tuple(union.shape)} and "
                             f"{tuple(counts.shape)}")
        n = len(layers)
        return (self.slots_layers(layers, req_ids, union.expand(n, -1, -1), counts.expand(n, -1)) >= 0).all(0)

    def steady_new_fraction(self, req: int, prior: float) -> float:
        """The reference's warm-pool miss share of ``req`` (host float; reads two ints back)."""
        hits, remote = self._warm[self._request(req)].tolist()
        return prior if remote == 0 else 1.0 - hits / remote

    def occupancy(self) -> np.ndarray:
        """int64 [D]: pool rows in use per destination (host)."""
        return (self._used != DEAD).sum(dim=(0, 2)).cpu().numpy().astype(np.int64)

    def holdings(self, dst: int, req: int, layer) -> np.ndarray:
        """Sorted tokens ``dst`` holds for (req, layer) (host)."""
        part = self._part(layer)
        keys, used = self._keys[part, dst], self._used[part, dst]
        lo = _pack(self._request(req), int(layer), 0)
        sel = (used != DEAD) & (keys >= lo) & (keys < lo + TOKEN_END)
        return (keys[sel] - lo).cpu().numpy().astype(np.int64)

    # ------------------------------------------------------------ updates

    def commit(self, layer, req_ids, union, counts, committed_len) -> DeviceCommit:
        """After a step's acceptance: store what each destination received for ``layer`` (the
        reference's ``commit``: rollback at ``committed_len``, LRU refresh, warm statistics,
        request-major insertion up to the quota, LRU eviction, lowest free rows)."""
        return self._commit(self._inputs([layer], req_ids, union, counts, True), committed_len).layer(0)

    def commit_layers(self, layers, req_ids, unions, counts, committed_len) -> DeviceCommit:
        """``commit`` of consecutive layers (unions [L, B, U], counts [L, B]) in one call: the same
        as committing them one by one in ascending order (their partitions are disjoint)."""
        return self._commit(self._inputs(layers, req_ids, unions, counts, False), committed_len)

    def _commit(self, inputs, committed_len) -> DeviceCommit:
        l0, n, req, union, counts, valid = inputs
        d, (_, b, u), q = self.world_size, union.shape, self.quota
        committed = self._vector("committed_len", committed_len, (b,))
        now = torch.arange(self.clock + 1, self.clock + 1 + n, device=self.device).view(n, 1, 1)
        self.clock += n
        if q == 0:
            return DeviceCommit(torch.full((n, d, b, u), -1, dtype=torch.int64, device=self.device),
                                torch.zeros((n, d), dtype=torch.int64, device=self.device))
        keys, rows, used, ids, parts = self._tables(l0, n)  # [L, D, Q] views
        # table positions of each request's range of the layer, and of its first uncommitted token
        first = _pack(req, ids[:, :, 0], 0)[:, None, :].expand(n, d, b).contiguous()  # [L, D, B]
        spec = (first + committed.clamp(0, TOKEN_END)).contiguous()
        at_first, at_spec, at_end = (torch.searchsorted(keys, x) for x in (first, spec, first + TOKEN_END))
        used.masked_fill_(_in_spans(at_spec, at_end, q), DEAD)  # rollback

        keys_q = _pack(req[:, None], ids, torch.where(valid, union, 0))  # [L, B, U]
        pos, hit = self._find(keys, used, keys_q, valid)
        used.scatter_reduce_(2, pos, torch.where(hit, now, -1), reduce="amax")  # records used now
        alive = used != DEAD

        # warm statistics: only (destination, request) pairs that already hold records of the layer
        cum = torch.nn.functional.pad(alive.cumsum(2), (1, 0))
        has = cum.gather(2, at_end) > cum.gather(2, at_first)  # [L, D, B]
        owner = self.layout.owner_and_local(torch.where(valid, union, 0))[0]
        remote = valid[:, None] & (owner[:, None] != self._dst)  # [L, D, B, U]
        hit4 = hit.view(n, d, b, u)
        warm = torch.stack([(remote & hit4).sum(3), remote.sum(3)], 3) * has[..., None]
        self._warm.index_add_(0, req, warm.sum((0, 1)))

        # new records in request-major union order, up to the quota
        want = (remote & ~hit4 & (union < committed[:, None])[:, None]).view(n, d, b * u)
        rank = want.cumsum(2)  # 1-based
        kept = want & (rank <= q)
        short = (kept.sum(2) - (q - alive.sum(2))).clamp_(min=0)  # [L, D]

        # evict the short least recently used; a stable sort keeps key order among equal clocks
        order = torch.sort(used, dim=2, stable=True).indices
        victim = torch.zeros_like(alive).scatter_(2, order, self._arange_q < short[..., None])
        alive &= ~victim
        # free rows in ascending order (column Q collects the taken ones); the rank-th new record
        # takes the rank-th lowest free row
        free = torch.zeros_like(rows).scatter_add_(2, rows, alive.to(torch.int64)) == 0
        to = torch.where(free, free.cumsum(2) - 1, q)
        free_rows = torch.zeros((n, d, q + 1), dtype=torch.int64, device=self.device)
        free_rows.scatter_(2, to, self._arange_q.expand(n, d, q))
        new_row = free_rows.gather(2, (rank - 1).clamp_(0, q - 1))
        slot = torch.where(kept, new_row + parts * q, -1).view(n, d, b, u)

        # merge: survivors and new keys, one sort, first Q entries (at most Q are real)
        all_keys = torch.cat([torch.where(alive, keys, PAD), torch.where(kept, keys_q.view(n, 1, -1), PAD)], 2)
        srt, idx = torch.sort(all_keys, dim=2, stable=True)  # stable: the faster CPU path
        idx = idx[..., :q]
        all_rows = torch.cat([rows, new_row], 2)
        all_used = torch.cat([torch.where(alive, used, DEAD), torch.where(kept, now, DEAD)], 2)
        keys.copy_(srt[..., :q])
        rows.copy_(all_rows.gather(2, idx))
        used.copy_(all_used.gather(2, idx))
        return DeviceCommit(slot, short)

    def _request(self, req) -> int:
        if isinstance(req, bool) or not isinstance(req, (int, np.integer)) or not 0 <= req < self.max_requests:
            raise ValueError(f"request id must be an int in [0, {self.max_requests}), got {req!r}")
        return int(req)

    def invalidate_from(self, req: int, position: int, layers=None) -> int:
        """Drop ``req``'s records at positions ``>= position`` (rejected drafts, rollback)."""
        return self.invalidate_range(req, position, None, layers)

    def invalidate_range(self, req: int, start: int, end: int | None = None, layers=None) -> int:
        """Drop ``req``'s records at positions in ``[start, end)`` of ``layers`` (default all).
        Returns entries dropped (host int: one read-back; an event path, not per layer)."""
        req = self._request(req)
        start = min(max(int(start), 0), TOKEN_END)
        end = TOKEN_END if end is None else min(max(int(end), 0), TOKEN_END)
        if layers is None:
            layer_ids = None
        else:
            layer_ids = [int(la) for la in layers]
            for la in layer_ids:
                self._part(la)
        keys, used = self._keys, self._used
        if layer_ids is not None and self.num_layers is not None:  # only their partitions
            sel = torch.tensor(sorted(set(layer_ids)), dtype=torch.int64, device=self.device)
            keys, used = keys.index_select(0, sel), used.index_select(0, sel)
        tok = keys % TOKEN_END
        layer = (keys // TOKEN_END) % (1 << LAYER_BITS)
        hit = (used != DEAD) & (keys // (1 << (TOKEN_BITS + LAYER_BITS)) == req) & (tok >= start) & (tok < end)
        if layer_ids is not None:
            hit &= torch.isin(layer, torch.tensor(layer_ids, dtype=torch.int64, device=self.device))
        if layer_ids is not None and self.num_layers is not None:
            self._used.index_copy_(0, sel, used.masked_fill(hit, DEAD))
        else:
            self._used.masked_fill_(hit, DEAD)
        return int(hit.sum())

    def drop_request(self, req: int) -> int:
        """Request finished or preempted: free all its entries and its warm statistics."""
        self._warm[self._request(req)] = 0
        return self.invalidate_range(req, 0, None)


def _in_spans(start: torch.Tensor, end: torch.Tensor, q: int) -> torch.Tensor:
    """bool [..., q]: column inside one of the disjoint spans ``[start[..., i], end[..., i])`` (a
    difference array: +1 at each start, -1 at each end, prefix sum)."""
    delta = torch.zeros(start.shape[:-1] + (q + 1,), dtype=torch.int32, device=start.device)
    delta.scatter_add_(-1, start, torch.ones_like(start, dtype=torch.int32))
    delta.scatter_add_(-1, end, torch.full_like(end, -1, dtype=torch.int32))
    return delta[..., :q].cumsum(-1) > 0
