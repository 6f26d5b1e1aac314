"""ReplicatedIndexerCache: every rank holds every token's indexer key for all Full layers.

One object covers all indexer layers (GLM-5.2: the 21 Full target layers plus
the MTP layer). Storage: ``records`` uint8 [num_layers, capacity, 132], one
indexer_fp8 record per (layer, slot); a slot is a cache row chosen by the
caller's slot mapping (as vLLM's slot_mapping), a sequence reads its tokens
through ``token_slots`` (token t of the sequence lives in slot token_slots[t]).

Every rank writes every token (no DCP sharding), so each rank computes the
global top-k alone; given identical inputs all ranks get identical top-k
because scoring is per-token deterministic and selection has a total order
(``select_topk``). Cost: num_layers * 132 bytes per token on every rank
(22 * 132 = 2,904 B for GLM-5.2).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sparkinfer.core.layouts import INDEXER_FP8
from sparkinfer.formats import get_format

from .tiled import indexer_topk


class ReplicatedIndexerCache:
    def __init__(self, layers: Sequence[int], capacity: int, device: str | torch.device = "cpu"):
        """layers: the model layer ids that run the indexer (Full layers, MTP); capacity: slots per layer."""
        layers = tuple(int(x) for x in layers)
        if not layers or len(set(layers)) != len(layers) or min(layers) < 0:
            raise ValueError(f"layers must be distinct non-negative layer ids, got {layers}")
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        self.layers = layers
        self.capacity = capacity
        self._row = {layer: i for i, layer in enumerate(layers)}
        self._fmt = get_format(INDEXER_FP8.name)
        self.records = torch.zeros((len(layers), capacity, INDEXER_FP8.record_bytes), dtype=torch.uint8,
                                   device=device)

    @classmethod
    def for_pattern(cls, pattern, capacity: int, device: str | torch.device = "cpu", *,
                    with_mtp: bool = True) -> "ReplicatedIndexerCache":
        """A cache for the Full layers of an IndexSharePattern, plus the MTP layer (id = num_layers)."""
        layers = list(pattern.full_layers) + ([pattern.num_layers] if with_mtp else [])
        return cls(layers, capacity, device)

    @property
    def bytes_per_token(self) -> int:
        """Indexer bytes each rank stores per token (all layers)."""
        return len(self.layers) * INDEXER_FP8.record_bytes

    def layer_records(self, layer: int) -> torch.Tensor:
        """uint8 [capacity, 132] view of one layer's keys."""
        if layer not in self._row:
            raise ValueError(f"layer {layer} has no indexer cache (indexer layers: {list(self.layers)}); "
                             "Shared layers reuse their Full layer's top-k")
        return self.records[self._row[layer]]

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor) -> None:
        """Quantize keys float32/bf16 [N, 128] to indexer_fp8 and store them at slots int64 [N] (distinct)."""
        dest = self.layer_records(layer)
        if slots.dtype not in (torch.int32, torch.int64) or slots.dim() != 1:
            raise ValueError(f"slots must be int64 [N], got {slots.dtype} {tuple(slots.shape)}")
        if keys.dim() != 2 or keys.shape[0] != slots.shape[0]:
            raise ValueError(f"keys must be [N={slots.shape[0]}, 128], got {tuple(keys.shape)}")
        if slots.numel() == 0:
            return
        if int(slots.min()) < 0 or int(slots.max()) >= self.capacity:
            raise ValueError(f"slots must lie in [0, capacity={self.capacity})")
        if torch.unique(slots).numel() != slots.numel():
            raise ValueError("slots must be distinct within one write")
        dest.index_copy_(0, slots.to(dest.device).long(), self._fmt.encode(keys).to(dest.device))

    def topk(self, layer: int, q, w, pos, k: int, token_slots=None, *, backend: str = "auto") -> torch.Tensor:
        """int32 [M, k] global top-k token ids of one sequence at one Full layer (see ``indexer_topk``)."""
        return indexer_topk(q, w, self.layer_records(layer), pos, k, token_slots, backend=backend)
