"""Sizes of the demo step: GLM-5.2's layer pattern and record formats, scaled-down heads and context."""

from __future__ import annotations

from dataclasses import dataclass

from sparkinfer.core.layouts import LATENT_DIM, ROPE_DIM
from sparkinfer.core.topology import GLM52_PATTERN, IndexSharePattern


@dataclass(frozen=True)
class DemoConfig:
    fmt: str = "nvfp4_ds_mla:bf16-rope-432"
    world: int = 4          # TP4 = DCP4: one group of four ranks
    heads: int = 8          # attention heads of the scaled model (GLM-5.2: 64); heads / world per rank
    index_heads: int = 4    # indexer heads (GLM-5.2: 32)
    mtp: int = 3            # speculative tokens: 1 + mtp query rows per request
    batch: int = 2
    context: int = 256      # tokens per request already in the cache
    topk: int = 32          # GLM-5.2: 2048
    interleave: int = 1     # DCP cp_kv_cache_interleave_size
    depth: int = 3          # prefetch ring: layers ahead of the current one
    block_size: int = 16
    seed: int = 0
    corrupt_rank: int = -1  # >= 0: flip bytes in that rank's shard (proves --check can fail)

    def __post_init__(self):
        if self.heads % self.world:
            raise ValueError(f"heads {self.heads} must divide by the TP size {self.world}")
        if self.topk > self.context:
            raise ValueError(f"topk {self.topk} exceeds the context {self.context}")
        if self.mtp + 1 > self.context:
            raise ValueError("context must hold the MTP verification rows")

    @property
    def pattern(self) -> IndexSharePattern:
        """The 78 target layers plus the MTP layer (index 78, a Full layer with its own indexer)."""
        return IndexSharePattern.parse(GLM52_PATTERN + "F", len(GLM52_PATTERN) + 1)

    @property
    def rows(self) -> int:
        return self.batch * (1 + self.mtp)

    @property
    def union_width(self) -> int:
        return (1 + self.mtp) * self.topk

    @property
    def local_heads(self) -> int:
        return self.heads // self.world

    @property
    def scale(self) -> float:
        return (LATENT_DIM + ROPE_DIM) ** -0.5
