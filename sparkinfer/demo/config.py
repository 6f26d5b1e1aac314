"""Sizes of the demo run: GLM-5.2's layer pattern and record formats, scaled-down heads and context."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

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
    steps: int = 3          # consecutive decode steps of the same requests
    accept: float = 0.7     # per-draft MTP acceptance probability (accepted prefix drawn from the seed)
    drift: float = 0.6      # step-to-step drift of the indexer queries: ~0.7 top-k overlap (a trained model's)
    mode: str | None = None  # auto | stock | selected; None: the profile's, or VLLM_SPARKINFER_MODE
    profile: str = "rtx_pro_6000_x4"  # node profile the per-step policy models
    pool_rows: int = 0      # reuse pool rows per rank, split evenly over the layers; 0: every record the
                            # run can hold (no eviction)
    reuse_prior: float = 0.3  # the policy's prior for the share of a request's remote union a warm pool
                              # misses, until the tracker has observed it (~0.7 step-to-step overlap)
    replica_window: int = -1  # replica store positions per request (sparkinfer.core.replicas): -1 = the
                              # whole run fits (every record local), 0 = off
    restart_step: int = -1  # >= 1: before that step request 0 ends and a new request (new prompt, same
                            # length) takes its batch slot and its KV blocks
    corrupt_rank: int = -1  # >= 0: flip bytes in that rank's shard (proves --check can fail)
    forget_drop: bool = False  # skip drop_request at the restart (proves --check catches a stale pool)

    def __post_init__(self):
        if self.heads % self.world:
            raise ValueError(f"heads {self.heads} must divide by the TP size {self.world}")
        if self.topk > self.context:
            raise ValueError(f"topk {self.topk} exceeds the context {self.context}")
        if self.mtp + 1 > self.context:
            raise ValueError("context must hold the MTP verification rows")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if not 0.0 <= self.accept <= 1.0:
            raise ValueError(f"accept must be a probability in [0, 1], got {self.accept}")
        if self.restart_step != -1 and not 1 <= self.restart_step < self.steps:
            raise ValueError(f"restart_step must be -1 (none) or in [1, steps={self.steps}), got {self.restart_step}")
        if self.replica_window < -1:
            raise ValueError(f"replica_window must be -1 (whole context), 0 (off) or > 0, got {self.replica_window}")
        if self.pool_rows < 0:
            raise ValueError(f"pool_rows must be >= 0, got {self.pool_rows}")
        if not 0.0 <= self.reuse_prior <= 1.0:
            raise ValueError(f"reuse_prior must be in [0, 1], got {self.reuse_prior}")

    @property
    def pattern(self) -> IndexSharePattern:
        """The 78 target layers plus the MTP layer (index 78, a Full layer with its own indexer)."""
        return IndexSharePattern.parse(GLM52_PATTERN + "F", len(GLM52_PATTERN) + 1)

    @property
    def max_len(self) -> int:
        """Cache positions the run can reach: the context plus 1 + mtp tokens per later step."""
        return self.context + (self.steps - 1) * (1 + self.mtp)

    @property
    def reuse_capacity(self) -> int:
        """Pool rows per rank: ``pool_rows``, or every remote union record of every layer and step."""
        return self.pool_rows or self.pattern.num_layers * self.batch * self.union_width * self.steps

    @property
    def window(self) -> int:
        """Replica positions per request: ``replica_window``, or (-1) every position the run reaches."""
        return self.max_len + 1 + self.mtp if self.replica_window == -1 else self.replica_window

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


def resolve_demo_mode(cfg: DemoConfig, env=None) -> DemoConfig:
    """``cfg`` with ``mode`` resolved once, in the parent, as the policy resolves it (``--mode``, else
    ``VLLM_SPARKINFER_MODE``, else the profile's): the ranks then cannot see different environments
    (a forkserver keeps the environment it started with)."""
    from sparkinfer.core.costmodel import load_profile
    from sparkinfer.core.policy import resolve_mode

    return replace(cfg, mode=resolve_mode(load_profile(cfg.profile), os.environ if env is None else env, cfg.mode))
