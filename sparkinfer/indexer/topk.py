"""Deterministic top-k over indexer scores: score descending, then token id ascending.

Each (score, id) pair is packed into one int64 key whose order is exactly that
rule: the high 32 bits are the fp32 score's bits mapped to a signed integer
that sorts like the float (-0.0 is first folded into +0.0 so equal scores give
equal bits), the low 32 bits are (2**32 - 1 - id) so a lower id ranks higher.
All keys are distinct, so ``torch.topk`` over them has one answer on every
device and thread count, which is what makes every rank's top-k identical.
``select_topk`` uses torch.topk; the tiled GPU path selects the same keys with
one Triton launch a pass (``triton_topk.topk_keys``, bit-identical values).

Entries with score -inf (outside the causal prefix, or a padded candidate)
are never selected; rows with fewer selectable entries than k are padded
with -1 at the end.
"""

from __future__ import annotations

import torch

_NONE = torch.iinfo(torch.int64).min
_LOW = (1 << 32) - 1


def pack_keys(scores: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """int64 selection keys (the module docstring's order) of scores float32 [M, N] and token_ids int
    [N] or [M, N] in [0, 2**31); INT64_MIN where a score is -inf. The Triton scorer packs the same
    keys in its epilogue (``triton_scores``: KEYS)."""
    bits = (scores + 0.0).view(torch.int32)  # + 0.0 turns -0.0 into +0.0
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(torch.int64)
    keys = (ordered << 32) | (_LOW - token_ids.to(torch.int64))
    return keys.masked_fill(scores == float("-inf"), _NONE)


def unpack_keys(top: torch.Tensor, with_scores: bool, out: torch.Tensor | None = None):
    """The selected int64 keys [M, k] -> ids int32 [M, k] (-1 at INT64_MIN; written into ``out``, an
    int32 [M, k] view, when given: no temporary), and with_scores their float32 scores (-inf at the
    padding)."""
    ids = torch.empty(top.shape, dtype=torch.int32, device=top.device) if out is None else out
    # the key's low word 2**32 - 1 - id, narrowed to int32 (two's complement), is -1 - id, and 0 at
    # INT64_MIN: its complement is the id, or -1
    ids.copy_(top).bitwise_not_()
    if not with_scores:
        return ids
    ordered = (top >> 32).to(torch.int32)
    picked = torch.where(ordered >= 0, ordered, ordered ^ 0x7FFFFFFF).view(torch.float32)
    return ids, picked.masked_fill(ids < 0, float("-inf"))


def select_topk(scores: torch.Tensor, k: int, token_ids: torch.Tensor | None = None, *, with_scores: bool = False):
    """scores float32 [M, N] (no NaN), token_ids int [N] or [M, N] in [0, 2**31) (default 0..N-1) -> int32 [M, k].

    Returns the ids of the k best entries per row in rank order (score
    descending, id ascending), -1 where a row has fewer than k entries above -inf.
    with_scores=True also returns their float32 scores [M, k] (-inf at the padding),
    unpacked from the keys.
    """
    if scores.dim() != 2 or scores.dtype != torch.float32:
        raise ValueError(f"scores must be float32 [M, N], got {scores.dtype} {tuple(scores.shape)}")
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    m, n = scores.shape
    if token_ids is None:
        token_ids = torch.arange(n, device=scores.device)
    if token_ids.shape not in ((n,), (m, n)):
        raise ValueError(f"token_ids must be [N={n}] or [M, N]={(m, n)}, got {tuple(token_ids.shape)}")
    keys = pack_keys(scores, token_ids)
    take = min(k, n)
    top = torch.topk(keys, take, dim=1, largest=True, sorted=True).values if take > 0 else keys[:, :0]
    if take < k:
        top = torch.cat([top, top.new_full((m, k - take), _NONE)], dim=1)
    return unpack_keys(top, with_scores)
