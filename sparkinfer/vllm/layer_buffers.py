"""Buffers a layer's forward writes and consumes before the next layer runs, shared across layers.

A decode step's layers produce outputs of a few recurring shapes (the target's rows, the drafter's
rows): the attention output and LSE, the decode kernel's scratch, the top-k's cache rows. A fresh
tensor per call is a trip through the caching allocator per layer (on CPU, an allocation the probe
of ``host_reads`` books). Here they are kept per name, device and shape, the last ``KEPT`` shapes
of each, and handed out again: a call's buffers are overwritten by the next call of the same name
and shape. So only what the layer consumes before that next call may live here (an attention
output is up-projected or LSE-merged in its layer); the launches are stream-ordered, so on a GPU
the layer's reads come before the next layer's writes. Only the forward's forms use them (the
ones given ``checks``; the indexer's q quantization, which vLLM's indexer calls with its own
arguments, inside vLLM's forward context: ``in_forward``): a direct call returns tensors of its own.
"""

from __future__ import annotations

import sys
from collections import OrderedDict

import torch

KEPT = 4  # shapes kept per name and device: a step's target rows and its drafter's, and a batch change
_held: dict = {}  # (name, device) -> OrderedDict(key -> buffers), most recent last


def shared(name: str, key: tuple, device, make):
    """The buffers ``make()`` returns for (``name``, ``key``) on ``device``, made once while the key recurs."""
    per = _held.setdefault((name, str(torch.device(device))), OrderedDict())
    held = per.pop(key, None)
    if held is None:
        held = make()
    per[key] = held
    while len(per) > KEPT:
        per.popitem(last=False)
    return held


def decode_buffers(m: int, h: int, k: int, device, q_dtype=torch.float32):
    """(``DecodeWorkspace``, out [M, H, 512], lse float32 [M, H]) of a Triton decode call of M rows, H
    heads and K indices; out in bf16 for bf16 queries (the merge kernel rounds it: no cast after the
    layer's attention; the workspace then has its partials even for one split), else float32."""
    from sparkinfer.attention.triton_decode import DecodeWorkspace, default_num_splits
    from sparkinfer.core.layouts import LATENT_DIM

    out_dtype = torch.bfloat16 if q_dtype == torch.bfloat16 else torch.float32

    def make():
        splits = default_num_splits(m, h, k, torch.device(device))
        return (DecodeWorkspace.allocate(m, h, k, splits, device, out_dtype == torch.bfloat16),
                torch.empty((m, h, LATENT_DIM), dtype=out_dtype, device=device),
                torch.empty((m, h), dtype=torch.float32, device=device))

    return shared("decode", (m, h, k, out_dtype), device, make)


def topk_rows_buffer(m: int, k: int, device) -> torch.Tensor:
    """int64 [M, K]: the cache rows of a layer's top-k (``triton_paging.topk_rows``)."""
    return shared("topk_rows", (m, k), device, lambda: torch.empty((m, k), dtype=torch.int64, device=device))


def in_forward() -> bool:
    """Whether vLLM is running a forward (its forward context is set); False where vLLM is not loaded."""
    context = sys.modules.get("vllm.forward_context")
    return context is not None and context.is_forward_context_available()


def indexer_q_buffers(n: int, d: int, group_size: int, device):
    """(q float8_e4m3fn [N, D], scales float32 [N, D // group_size]): the indexer's quantized q, which
    the layer's indexer op consumes (the scales are folded into its weights first)."""
    return shared("indexer_q", (n, d, group_size), device, lambda: (
        torch.empty((n, d), dtype=torch.float8_e4m3fn, device=device),
        torch.empty((n, d // group_size), dtype=torch.float32, device=device)))
