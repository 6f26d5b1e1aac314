"""LSE merge of partial attention results (what stock DCP does across ranks).

Each partial p attended a disjoint subset of one row's keys and returned its
normalised output o_p and log-sum-exp lse_p = log sum_{j in p} exp(s_j). Then

    lse = log sum_p exp(lse_p)
    out = sum_p exp(lse_p - lse) * o_p

equals attention over the union of the subsets. A partial with no key has
lse_p = -inf and weight 0; if every partial is empty, lse = -inf and out = 0.
"""

from __future__ import annotations

import torch


def merge_lse(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partials: outs float [P, M, H, D], lses float [P, M, H] -> (float32 [M, H, D], float32 [M, H])."""
    if outs.dim() != 4:
        raise ValueError(f"outs must be [P, M, H, D], got shape {tuple(outs.shape)}")
    if lses.dim() != 3 or tuple(lses.shape) != tuple(outs.shape[:3]):
        raise ValueError(f"lses must be [P, M, H] = {tuple(outs.shape[:3])}, got {tuple(lses.shape)}")
    if outs.shape[0] < 1:
        raise ValueError("merge_lse needs at least one partial (P >= 1)")
    if not (outs.is_floating_point() and lses.is_floating_point()):
        raise ValueError(f"outs and lses must be floating point, got {outs.dtype} and {lses.dtype}")
    if outs.device != lses.device:
        raise ValueError(f"outs on {outs.device} but lses on {lses.device}")
    lses = lses.float()
    lse = torch.logsumexp(lses, dim=0)
    # Subtract a finite anchor so empty rows (lse = -inf) give weights exp(-inf) = 0, not NaN.
    anchor = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    weights = torch.exp(lses - anchor)
    out = (weights.unsqueeze(-1) * outs.float()).sum(dim=0)
    return out, lse
