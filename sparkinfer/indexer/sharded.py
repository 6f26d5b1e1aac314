"""Upstream vLLM's sharded indexer under DCP, as the oracle for the replicated one.

Under DCP each rank holds only the indexer keys of the tokens it owns; it
scores those, keeps a local top-k of (score, global token id) candidates, and
the ranks merge all candidates into the global top-k. With the same scoring
and the same tie rule this equals the replicated indexer's top-k, which every
rank computes alone from the whole cache; tests/test_indexer_multiproc.py
checks that across processes.
"""

from __future__ import annotations

import torch

from .topk import select_topk


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


def all_gather_merge(scores: torch.Tensor, ids: torch.Tensor, k: int, all_gather) -> torch.Tensor:
    """The global top-k int32 [M, k] from this rank's candidates (``shard_candidates``'s float32
    [M, k'] scores, int32 [M, k'] ids) and every other rank's: one all-gather of int32 [M, 2k'] (the
    score bits beside the ids). ``all_gather``: int32 [M, 2k'] -> [P * M, 2k'] in rank order."""
    m, kk = scores.shape
    got = all_gather(torch.cat([scores.view(torch.int32), ids.to(torch.int32)], dim=1))
    if got.shape[0] % max(m, 1) or got.shape[1:] != (2 * kk,):
        raise ValueError(f"all_gather must return [P * {m}, {2 * kk}], got {tuple(got.shape)}")
    got = got.view(-1, m, 2 * kk)
    return merge_candidates(got[..., :kk].contiguous().view(torch.float32), got[..., kk:].contiguous(), k)
