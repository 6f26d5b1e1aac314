"""Per-request union of the MTP verification rows' top-k sets.

With MTP the target's verification pass has ``R = 1 + speculative`` query rows
per request, each with its own top-k of ``K`` tokens; adjacent rows overlap
heavily, so fetching each distinct record once per request moves fewer bytes.

Contract (all int32, ``N = R * K``)::

    topk   [B, R, K]  token ids, -1 = pad (any value < -1 is rejected)
    union  [B, N]     request b's distinct tokens in first-occurrence order over
                      the flattened (row, k) index, -1 after the first counts[b]
    remap  [B, R, K]  position of topk[b, r, k] in union[b]; -1 where topk is -1
    counts [B]        distinct tokens of request b

so ``union[b, remap[b, r, k]] == topk[b, r, k]`` for every non-pad entry.
First-occurrence order makes the result a pure function of the input (no
dependence on hashing or thread timing), identical on every rank, and keeps
row 0's tokens as a prefix of the union.

Three implementations give identical results: the torch reference below
(sort based, any device), the host build of ``csrc/include/sparkinfer/union.h``
and its CUDA kernel. ``mtp_union`` picks the CUDA kernel for a CUDA tensor when
the CUDA library is built, otherwise the reference.
"""

from __future__ import annotations

import logging

import torch

from sparkinfer.plan import _native

log = logging.getLogger(__name__)

# Pads sort after every real token: token ids are int32, keys are int64.
_PAD_KEY = 1 << 40


def mtp_union_reference(topk: torch.Tensor, validate: bool = True):
    """Torch reference of the union contract (module docstring); works on any device.

    ``validate=False`` skips the value check (no device sync); every id < 0 then counts as a pad,
    as in the native implementations."""
    b, r, k = _native.check_topk(topk, validate)
    n = r * k
    dev = topk.device
    if b == 0 or n == 0:
        return (torch.full((b, n), -1, dtype=torch.int32, device=dev),
                torch.full((b, r, k), -1, dtype=torch.int32, device=dev),
                torch.zeros(b, dtype=torch.int32, device=dev))
    x = topk.reshape(b, n).long()
    valid = x >= 0
    keys = torch.where(valid, x, torch.full_like(x, _PAD_KEY))
    # Stable sort: within a run of equal tokens the earliest position comes first.
    sorted_keys, order = torch.sort(keys, dim=1, stable=True)
    head = torch.ones_like(sorted_keys, dtype=torch.bool)
    head[:, 1:] = sorted_keys[:, 1:] != sorted_keys[:, :-1]
    head &= sorted_keys != _PAD_KEY
    # first[b, p]: position p is the first occurrence of its token.
    first = torch.zeros_like(valid).scatter_(1, order, head)
    ordinal = torch.cumsum(first, dim=1) - 1  # union position of each first occurrence
    # Every sorted entry takes the ordinal of its run's head.
    cols = torch.arange(n, device=dev).expand(b, n)
    run_start = torch.cummax(torch.where(head, cols, torch.zeros_like(cols)), dim=1).values
    head_pos = order.gather(1, run_start)
    remap_sorted = ordinal.gather(1, head_pos)
    remap = torch.empty_like(x).scatter_(1, order, remap_sorted)
    remap = torch.where(valid, remap, torch.full_like(remap, -1))
    # Scatter first occurrences into their union slot; the rest land in a dump column.
    union = torch.full((b, n + 1), -1, dtype=torch.long, device=dev)
    union.scatter_(1, torch.where(first, ordinal, torch.full_like(ordinal, n)), x)
    counts = first.sum(dim=1)
    return (union[:, :n].to(torch.int32).contiguous(),
            remap.reshape(b, r, k).to(torch.int32),
            counts.to(torch.int32))


def mtp_union(topk: torch.Tensor, validate: bool = True):
    """``union, remap, counts`` of ``topk`` (int32 [B, R, K]); see the module docstring.

    CUDA tensors run the CUDA kernel when the CUDA library is built (else the
    torch reference, logged once); CPU tensors run the torch reference.
    ``validate=False`` skips the check for ids < -1 (a device sync); such ids then count as pads.
    """
    if isinstance(topk, torch.Tensor) and topk.is_cuda:
        if _native.cuda_available():
            return _native.mtp_union_cuda(topk, validate)
        _warn_no_cuda_lib()
    return mtp_union_reference(topk, validate)


def workspace_slots(remap: torch.Tensor, union_width: int) -> torch.Tensor:
    """int32 [B * R, K]: row ``b * union_width + remap[b, r, k]`` of a dense per-request workspace
    (``[B * union_width, ...]``, request b's union in rows b*U ..) for each top-k entry; -1 for pads."""
    B, R, K = remap.shape
    base = torch.arange(B, device=remap.device)[:, None, None] * union_width
    return torch.where(remap >= 0, remap + base, -1).view(B * R, K).to(torch.int32)


_warned = False


def _warn_no_cuda_lib() -> None:
    global _warned
    if not _warned:
        log.warning("mtp_union: CUDA library not built; using the torch reference on the GPU")
        _warned = True


def union_row_masks(remap: torch.Tensor, union_width: int) -> torch.Tensor:
    """int32 [B, union_width]: bit r of entry [b, u] set when row r's top-k holds union[b, u]
    (``remap`` int32 [B, R, K] of ``mtp_union``, R <= 32; bit 31 makes the int32 negative).

    The per-row membership the union attention kernel (``attention.triton_union_decode``) masks
    scores with; a top-k row is a set, so a token listed twice in one row still sets one bit."""
    B, R, K = remap.shape
    if R > 32:
        raise ValueError(f"at most 32 rows fit an int32 row mask, got R = {R}")
    hit = torch.zeros(B, R, union_width + 1, dtype=torch.bool, device=remap.device)
    hit.scatter_(2, torch.where(remap >= 0, remap, union_width).long(), True)  # pads land in a dump column
    weights = torch.ones(R, dtype=torch.int64, device=remap.device) << torch.arange(R, device=remap.device)
    bits = (hit[..., :union_width].long() * weights[None, :, None]).sum(dim=1)
    return torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32)
