"""Torch reference of the DSA indexer: float64 scores, stable-sort top-k.

    scores[m, t] = sum_h w[m, h] * relu(q[m, h, :] . key[t, :])

with key the fp8 indexer key dequantized by ``get_format("indexer_fp8")``.
Products of an fp32 query and a dequantized key (a 4-bit significand times a
power of two) are exact in float64, so the reference is the scores to about
1e-16 relative; the Triton kernel accumulates in fp32. Selection sorts by
score descending with a stable sort, so equal scores keep the lower token id
first; this is a second, independent implementation of the rule in topk.py.
"""

from __future__ import annotations

import torch

from sparkinfer.formats import get_format

from .validate import check_index_inputs


def indexer_scores_torch(q, w, records, pos=None, token_slots=None, check_values: bool = True) -> torch.Tensor:
    """float64 scores [M, T]; -inf for t > pos[m] (no mask when pos is None). Shapes: see validate.py."""
    n_tokens = check_index_inputs(q, w, records, pos, token_slots, check_values)
    rows = records if token_slots is None else records.index_select(0, token_slots.long())
    keys = get_format("indexer_fp8").decode(rows).double()
    dots = torch.einsum("mhd,td->mht", q.double(), keys)
    scores = (w.double()[:, :, None] * dots.clamp(min=0)).sum(dim=1)
    if pos is not None:
        t = torch.arange(n_tokens, device=scores.device)
        scores = scores.masked_fill(t[None, :] > pos[:, None], float("-inf"))
    return scores


def indexer_topk_torch(q, w, records, pos, k: int, token_slots=None, check_values: bool = True) -> torch.Tensor:
    """int32 [M, k] token ids by score descending then id ascending; -1 pads rows with fewer than k tokens."""
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    scores = indexer_scores_torch(q, w, records, pos, token_slots, check_values)
    order = torch.sort(scores, dim=1, descending=True, stable=True)
    ids = order.indices[:, :k]
    ids = torch.where(order.values[:, :k] == float("-inf"), torch.full_like(ids, -1), ids)
    if ids.shape[1] < k:
        ids = torch.cat([ids, ids.new_full((ids.shape[0], k - ids.shape[1]), -1)], dim=1)
    return ids.to(torch.int32)
