"""The indexer's top-k in bounded memory: score the context a tile at a time, merge a running top-k.

For a batch of M query rows (all requests of a step), row m scores the positions of its request's
list: entries ``row_start[m] .. row_start[m] + row_len[m] - 1`` of ``token_slots`` (cache rows) and
``token_ids`` (the ids selection reports and the tie rule orders; default the index j in the list).
Each pass scores list positions [j0, j0 + tile) of every row in one launch, as int64 selection keys
(``topk.pack_keys``), into columns k.. of a work buffer whose first k columns hold the running
top-k keys; a top-k over the buffer keeps the k best (on the Triton path one launch of
``triton_topk.topk_keys``, a radix select; on the torch twin ``torch.topk``). The keys are distinct
per row (the id is in them; only INT64_MIN, "nothing", repeats), so the top-k of (top-k so far, tile) is the top-k
of everything scored so far: after the last pass it equals ``select_topk`` over the whole [M, T]
score matrix, ids and order, bit for bit.

Memory per call: the work buffer int64 [M, k + tile] and 2 M k int64 for the top-k (``TopkWorkspace``;
+ the torch scorer's float64 [M, Hi, tile] temporaries; every byte of a Triton call:
``core.indexer_tiles``, which patch 0008 reserves), whatever the context length: ``tile`` is fixed
by ``tile_bytes`` and M, never by T. Given a workspace and an output a call allocates nothing. Launches per call: one scoring launch and one top-k per pass (plus the copy of the top-k back);
passes = ceil(max_len / tile), from the host's step plan (``max_len``), not from a device read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sparkinfer.core.indexer_tiles import TILE_BYTES, paged_split_rows, pass_workspace_bytes, pick_tile

from .topk import _NONE, pack_keys, unpack_keys
from .validate import check_index_inputs

_INTS = (torch.int32, torch.int64)


@dataclass
class RowLists:
    """The batched entry's per-row data for one step, built on the host once (``plan_rows``).

    row_start int64 [M], row_len int32 [M]: row m's positions are list entries
    row_start[m] + j, j < row_len[m]; token_slots int64 [S] / token_ids int32 [S] (or None: the
    entry index itself / j); max_len: a host int >= every row_len (the number of passes)."""

    row_start: torch.Tensor
    row_len: torch.Tensor
    token_slots: torch.Tensor | None
    token_ids: torch.Tensor | None
    max_len: int

    def to(self, device) -> "RowLists":
        move = lambda t: None if t is None else t.to(device)
        return RowLists(move(self.row_start), move(self.row_len), move(self.token_slots), move(self.token_ids),
                        self.max_len)

    def kwargs(self) -> dict:
        return dict(row_start=self.row_start, row_len=self.row_len, token_slots=self.token_slots,
                    token_ids=self.token_ids, max_len=self.max_len)


class TopkWorkspace:
    """The buffers a tiled top-k call works in, carved from one flat int64 buffer:

        work  int64 [M, k + tile]   the running top-k keys, then a pass's scored keys
        top   int64 [M, k]          the top-k keys of a pass
        at    int64 [M, k]          torch.topk's indices (unused, but topk writes them)

    or, for the Triton top-k, top and at as one candidate buffer int64 [M, 2k] whose head columns
    are top (``triton_topk.topk_keys``: a buffer twice k stops its radix select earlier).

    A serving engine makes one at start, sized for every call of its steps
    (``core.indexer_tiles.engine_workspace_bytes``, what patch 0008 reserves), so that a step's
    calls allocate none of it; a direct call without one gets one of its exact size."""

    def __init__(self, nbytes: int, device):
        self.buffer = torch.empty(nbytes // 8, dtype=torch.int64, device=device)
        self.counts = None  # the paged top-k's split counters (``take_paged``)

    def take(self, m: int, k: int, tile: int):
        """(work, rest) for a call of M rows, top-k, passes of ``tile`` positions: work int64
        [M, k + tile] and the 2 M k int64 after it, which the top-k views as it needs (``_selector``)."""
        n_work = m * (k + tile)
        need = n_work + 2 * m * k
        if need > self.buffer.numel():
            raise ValueError(f"the top-k workspace holds {8 * self.buffer.numel()} bytes, a call of {m} rows, k {k} "
                             f"and passes of {tile} needs {8 * need}: size it with core.indexer_tiles.workspace_bytes "
                             "for the largest rows, k and context of its calls")
        b = self.buffer
        return b[:n_work].view(m, k + tile), b[n_work:need]

    def take_paged(self, m: int, splits: int, k: int, tile: int):
        """(work int64 [M x splits, k + tile], heads int64 [M, splits x k], top int64 [M, k], counts
        int32 [M]; heads and counts None for one split) for a paged top-k call (``triton_paged``;
        bytes: ``core.indexer_tiles.paged_workspace_bytes``). The counts are the rows' split
        counters, which the kernel leaves at 0: made zeroed beside the buffer by the first call of
        several splits, for as many rows as any such call has (``paged_split_rows``), so they stay
        where a captured graph saw them."""
        sizes = (m * splits * (k + tile), m * splits * k if splits > 1 else 0, m * k)
        if sum(sizes) > self.buffer.numel():
            raise ValueError(f"the top-k workspace holds {8 * self.buffer.numel()} bytes, a paged call of {m} rows, "
                             f"k {k} and tiles of {tile} needs {8 * sum(sizes)}: size it with "
                             "core.indexer_tiles.paged_workspace_bytes")
        work, heads, top = torch.split(self.buffer[:sum(sizes)], sizes)
        if splits == 1:
            return work.view(m, k + tile), None, top.view(m, k), None
        if self.counts is None:
            self.counts = torch.zeros(paged_split_rows(), dtype=torch.int32, device=self.buffer.device)
        return work.view(m * splits, k + tile), heads.view(m, splits * k), top.view(m, k), self.counts[:m]


def plan_rows(requests: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]], num_rows: int) -> RowLists:
    """RowLists (host tensors) from, per request, (its rows int [m_r], the cache rows int64 [L_r] of
    the positions it scores, their token ids int [L_r] or None for 0..L_r-1). Rows in no request
    score nothing (row_len 0: all -1)."""
    row_start = torch.zeros(num_rows, dtype=torch.int64)
    row_len = torch.zeros(num_rows, dtype=torch.int32)
    slots, ids, at = [], [], 0
    with_ids = any(r[2] is not None for r in requests)
    for rows, sl, tid in requests:
        rows = rows.cpu().long()
        row_start[rows], row_len[rows] = at, sl.numel()
        slots.append(sl.cpu().long())
        if with_ids:
            ids.append((torch.arange(sl.numel()) if tid is None else tid.cpu()).to(torch.int32))
        at += sl.numel()
    cat = lambda xs, dt: torch.cat(xs) if xs else torch.zeros(0, dtype=dt)
    return RowLists(row_start, row_len, cat(slots, torch.int64), cat(ids, torch.int32) if with_ids else None,
                    max((int(s.numel()) for s in slots), default=0))


def one_list(m: int, n: int, device) -> dict:
    """Row data for M rows that all score the same n positions (one request): row_start, row_len, max_len."""
    return dict(row_start=torch.zeros(m, dtype=torch.int64, device=device),
                row_len=torch.full((m,), n, dtype=torch.int32, device=device), max_len=n)


def indexer_topk(q, w, records, pos, k: int, token_slots=None, *, backend: str = "auto",
                 check_values: bool = True):
    """int32 [M, k] top-k token ids over the causal prefix (the package docstring). One request:
    ``indexer_topk_rows`` with every row's list the T tokens (bounded memory at any T)."""
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    if pos is None:
        raise ValueError("pos is required: row m may only select tokens 0..pos[m]")
    n_tokens = check_index_inputs(q, w, records, pos, token_slots, check_values)
    return indexer_topk_rows(q, w, records, pos, k, **one_list(q.shape[0], n_tokens, q.device),
                             token_slots=token_slots, backend=backend, check_values=False)


def indexer_topk_rows(q, w, records, pos, k: int, *, row_start, row_len, max_len: int, token_slots=None,
                      token_ids=None, backend: str = "auto", with_scores: bool = False,
                      tile_bytes: int | None = None, check_values: bool = True,
                      workspace: TopkWorkspace | None = None, out: torch.Tensor | None = None,
                      as_keys: bool = False):
    """Top-k of every row of a step in one batched call -> ids int32 [M, k] (with_scores: and their
    float32 scores [M, k]), best first (score descending, then token id ascending), -1 / -inf
    padded where a row has fewer than k positions with token id <= pos[m]. ``as_keys``: the
    selected int64 keys [M, k] instead (``topk.pack_keys``; INT64_MIN padding), written into
    ``out`` (int64 [M, k]) when given: a sharded step's candidates (``sharded.all_gather_merge``).

    q float32/bf16/float8_e4m3fn [M, Hi, 128], w [M, Hi], records uint8 [R, 132], pos int64 [M]; row_start,
    row_len, token_slots, token_ids, max_len as in ``RowLists`` (all tensors on one device);
    tile_bytes (default TILE_BYTES) bounds a pass's columns and changes no result. On a
    GPU nothing here reads the device unless check_values (the default; a serving step passes
    False after validating its plan once). ``workspace`` (``TopkWorkspace``) and ``out`` (int32
    [M, k], any strides: the ids are written there) make the call allocate nothing.
    """
    from sparkinfer.attention.dispatch import pick_backend

    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    if not isinstance(max_len, int) or max_len < 0:
        raise ValueError(f"max_len must be a non-negative int (the step plan's longest row), got {max_len!r}")
    check_index_inputs(q, w, records, None, token_slots, check_values)
    m = q.shape[0]
    _check_rows(m, records, pos, row_start, row_len, token_slots, token_ids, max_len, check_values)
    backend = pick_backend(backend, q.is_cuda, "indexer")
    hi = q.shape[1]
    tile = pick_tile(m, max_len, 8 if backend == "triton" else 8 * (3 * hi + 4),
                     TILE_BYTES if tile_bytes is None else tile_bytes)
    if workspace is None:
        workspace = TopkWorkspace(pass_workspace_bytes(m, k, tile), q.device)
    work, rest = workspace.take(m, k, tile)
    top, select = _selector(backend, work, rest, k)
    work.fill_(_NONE)
    top.fill_(_NONE)  # what a call without a pass (max_len 0) returns
    groups = None if backend == "triton" else _row_groups(row_start, row_len)
    for j0 in range(0, max_len, tile):
        if backend == "triton":
            from .triton_scores import score_keys_pass

            score_keys_pass(q, w, records, pos, row_start, row_len, token_slots, token_ids, work, j0, k, tile)
        else:
            _torch_keys_pass(q, w, records, pos, groups, token_slots, token_ids, work, j0, k, tile)
        last = j0 + tile >= max_len
        select(last)
        if not last:
            work[:, :k].copy_(top)
    if as_keys:
        return top.clone() if out is None else out.copy_(top)
    return unpack_keys(top, with_scores, out)


def _selector(backend: str, work, rest, k: int):
    """(top int64 [M, k], select(last)): the pass's top-k of ``work`` into top, from the workspace's
    ``rest``, in rank order in the last pass only (the keys are distinct but INT64_MIN, so the order
    is unique; the running top-k's order is never read). Triton: ``triton_topk.topk_keys``, one
    launch, rest as its candidate buffer [M, 2k] with top its head (the unsorted passes select into
    top alone). Torch (the CPU twin): ``torch.topk`` into rest's two [M, k] halves."""
    m = work.shape[0]
    if backend == "triton":
        from .triton_topk import topk_keys

        cand = rest.view(m, 2 * k)
        return cand[:, :k], lambda last: topk_keys(work, k, cand[:, :k], cand, sorted=last)
    top, at = rest.view(2, m, k)
    return top, lambda last: torch.topk(work, k, dim=1, largest=True, sorted=last, out=(top, at))


def _check_rows(m, records, pos, row_start, row_len, token_slots, token_ids, max_len, check_values):
    dev = records.device
    for name, t in (("pos", pos), ("row_start", row_start), ("row_len", row_len)):
        if t.dtype not in _INTS or tuple(t.shape) != (m,) or t.device != dev:
            raise ValueError(f"{name} must be int64 [M={m}] on {dev}, got {t.dtype} {tuple(t.shape)} on {t.device}")
    n_list = records.shape[0] if token_slots is None else token_slots.shape[0]
    if token_ids is not None:
        if token_ids.dtype not in _INTS or tuple(token_ids.shape) != (n_list,) or token_ids.device != dev:
            raise ValueError(f"token_ids must be int32 [S={n_list}] (as token_slots) on {dev}, got "
                             f"{token_ids.dtype} {tuple(token_ids.shape)} on {token_ids.device}")
    if check_values and m > 0:
        if int(row_len.max()) > max_len or int(row_len.min()) < 0:
            raise ValueError(f"row_len must lie in [0, max_len={max_len}], got [{int(row_len.min())}, "
                             f"{int(row_len.max())}]: plan max_len from the step's longest row")
        end = row_start.long() + row_len.long()
        if int(row_start.min()) < 0 or int(end.max()) > n_list:
            raise ValueError(f"row lists must lie in [0, S={n_list}) of token_slots/token_ids (records when none)")
        if token_ids is not None and n_list > 0 and (int(token_ids.min()) < 0 or int(token_ids.max()) >= 2 ** 31):
            raise ValueError("token_ids must lie in [0, 2**31)")


def _row_groups(row_start, row_len):
    """Rows that share a list (one request's rows): [(rows int64, start, length)], host ints (the
    torch reference path only)."""
    pairs = torch.stack([row_start.long().cpu(), row_len.long().cpu()], dim=1)
    uniq, inverse = torch.unique(pairs, dim=0, return_inverse=True)
    return [((inverse == g).nonzero().flatten().to(row_start.device), int(s), int(n))
            for g, (s, n) in enumerate(uniq.tolist()) if n > 0]


def _torch_keys_pass(q, w, records, pos, groups, token_slots, token_ids, work, j0, col0, tile):
    """The torch twin of ``triton_scores.score_keys_pass``: the float64 reference scores of the
    tile rounded to fp32 (what ``indexer_scores(backend="torch")`` gives), packed the same way."""
    from .reference import indexer_scores_torch

    work[:, col0:].fill_(_NONE)
    for rows, start, n in groups:
        j1 = min(n, j0 + tile)
        if j1 <= j0:
            continue
        span = slice(start + j0, start + j1)
        slots = torch.arange(span.start, span.stop, device=work.device) if token_slots is None else token_slots[span]
        ids = torch.arange(j0, j1, device=work.device) if token_ids is None else token_ids[span]
        scores = indexer_scores_torch(q[rows], w[rows], records, None, slots, False).float()
        scores = scores.masked_fill(ids.long()[None, :] > pos[rows].long()[:, None], float("-inf"))
        work[rows, col0:col0 + j1 - j0] = pack_keys(scores, ids)
