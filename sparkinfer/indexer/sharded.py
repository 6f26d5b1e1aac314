"""Upstream vLLM's sharded indexer under DCP, as the oracle for the replicated one.

Under DCP each rank holds only the indexer keys of the tokens it owns; it
scores those, keeps a local top-k of (score, global token id) candidates, and
the ranks merge all candidates into the global top-k. With the same scoring
and the same tie rule this equals the replicated indexer's top-k, which every
rank computes alone from the whole cache; tests/indexer/test_indexer_multiproc.py
checks that across processes.

``merge_candidates`` merges (score, id) candidates, the reference; the engine's
sharded scoring merges them as the int64 keys its top-k already selects on
(``all_gather_merge`` over ``MergeBuffers``: one all-gather, one top-k, no
allocation), tested equal to it and to the replicated top-k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .topk import select_topk, unpack_keys


def shard_candidates(q, w, local_records, local_token_ids, pos, k: int, *, token_slots=None,
                     backend: str = "auto"):
    """One rank's candidates: local_records uint8 [L, 132] hold the keys of global tokens
    local_token_ids int64 [L] (with ``token_slots`` int64 [L]: rows token_slots of local_records,
    a page pool, hold them); q, w, pos as in ``indexer_topk``.

    Returns (scores float32 [M, k], ids int32 [M, k] global token ids), best first,
    -inf / -1 where the rank has fewer than k tokens in a row's causal prefix.
    """
    from .tiled import indexer_topk_rows, one_list

    n_local = local_records.shape[0] if token_slots is None else token_slots.shape[0]
    if local_token_ids.shape != (n_local,):
        raise ValueError(f"local_token_ids must be [L={n_local}], got {tuple(local_token_ids.shape)}")
    if pos is None or pos.shape != (q.shape[0],):
        raise ValueError(f"pos must be int64 [M={q.shape[0]}]")
    ids, best = indexer_topk_rows(q, w, local_records, pos, k, **one_list(q.shape[0], n_local, q.device),
                                  token_slots=token_slots, token_ids=local_token_ids, backend=backend,
                                  with_scores=True)
    return best, ids


def merge_candidates(scores: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """Global top-k from every rank's candidates: scores float32 [P, M, k'], ids int32 [P, M, k'] -> int32 [M, k]."""
    if scores.dim() != 3 or ids.shape != scores.shape:
        raise ValueError(f"scores and ids must both be [P, M, k], got {tuple(scores.shape)} and {tuple(ids.shape)}")
    p, m, kk = scores.shape
    flat_scores = scores.permute(1, 0, 2).reshape(m, p * kk)
    flat_ids = ids.permute(1, 0, 2).reshape(m, p * kk).to(torch.int64)
    flat_scores = flat_scores.masked_fill(flat_ids < 0, float("-inf"))  # padding never wins
    return select_topk(flat_scores, k, flat_ids.clamp(min=0))


class MergeBuffers:
    """The buffers of a sharded merge, carved from one flat int64 buffer for calls of up to ``rows``
    rows of ``world`` ranks' top-``k`` candidates (keys in ``topk.pack_keys`` order):

        mine      int64 [M, k]           this rank's candidates (the all-gather's input)
        gathered  int64 [world * M, k]   every rank's, in rank order
        flat      int64 [M, world * k]   a row's candidates from every rank side by side
        top, at   int64 [M, k]           the top-k keys, torch.topk's indices (unused by the Triton one)

    A serving engine makes one at start for its decode steps' rows, so that their merge allocates
    nothing (``core.reservations``: ``indexer_merge``); a call of more rows (a prefill chunk, never
    captured) gets buffers of its exact size."""

    def __init__(self, world: int, rows: int, k: int, device):
        from sparkinfer.core.indexer_tiles import merge_bytes

        self.world, self.rows, self.k = world, rows, k
        self.buffer = torch.empty(merge_bytes(world, rows, k) // 8, dtype=torch.int64, device=device)

    def take(self, m: int) -> "MergeViews":
        if m > self.rows:
            return MergeBuffers(self.world, m, self.k, self.buffer.device).take(m)
        w, k, b = self.world, self.k, self.buffer
        sizes = (m * k, w * m * k, w * m * k, m * k, m * k)
        offsets = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        mine, gathered, flat, top, at = (b[offsets[i]:offsets[i + 1]] for i in range(len(sizes)))
        return MergeViews(mine.view(m, k), gathered.view(w * m, k), flat.view(m, w * k), top.view(m, k),
                          at.view(m, k))


@dataclass
class MergeViews:
    """One merge's views of ``MergeBuffers`` (shapes there)."""

    mine: torch.Tensor
    gathered: torch.Tensor
    flat: torch.Tensor
    top: torch.Tensor
    at: torch.Tensor


def all_gather_merge(views: MergeViews, all_gather_into, out: torch.Tensor | None = None,
                     backend: str = "torch") -> torch.Tensor:
    """The global top-k int32 [M, k] (written into ``out``, an int32 [M, k] view, when given) from
    this rank's candidate keys, in ``views.mine``, and every other rank's: one all-gather of int64
    [M, k] (``all_gather_into(gathered [P * M, k], mine [M, k])``, rank order), then one top-k over
    each row's P x k candidates: ``torch.topk``, or with ``backend="triton"`` one launch of
    ``triton_topk.topk_keys`` into ``views.top`` (its own candidate buffer: CAP = k). Keys are
    distinct and padding is INT64_MIN, so the answer is the top-k of the union on every rank
    (``merge_candidates`` is the same merge from scores and ids)."""
    if backend not in ("torch", "triton"):
        raise ValueError(f"backend must be 'torch' or 'triton', got {backend!r}")
    m, k = views.mine.shape
    p = views.gathered.shape[0] // max(m, 1)
    all_gather_into(views.gathered, views.mine)
    views.flat.view(m, p, k).copy_(views.gathered.view(p, m, k).transpose(0, 1))
    if backend == "triton":
        from .triton_topk import topk_keys

        topk_keys(views.flat, k, views.top)
    else:
        torch.topk(views.flat, k, dim=1, largest=True, sorted=True, out=(views.top, views.at))
    return unpack_keys(views.top, False, out)
