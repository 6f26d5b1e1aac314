"""Who scores the replicated indexer's context, decided per step (setting ``indexer_scoring``).

With the indexer replicated (``indexer_layout``), every rank holds every token's key, so a step can
be scored two ways, with the same top-k on every rank either way:

* ``replicated``: every rank scores its requests' whole causal prefix alone; no collective.
* ``sharded``: every rank scores the positions it owns (DCP placement, so the work splits evenly)
  and keeps its top-k candidates; one all-gather over the DCP group per indexer layer brings
  every rank's ``[T, k]`` candidates (int64 keys: score and position packed in the top-k's own
  tie order), merged by one top-k (``sparkinfer.indexer.all_gather_merge``, in buffers made at
  engine start for decode steps). A position's score does not depend on which other positions
  are scored, so the merge is the replicated top-k exactly.

``auto`` takes, per step, the cheaper by the node profile (``costmodel.choose_indexer``: scoring
``1 - 1/DCP`` of the context saved against one all-gather; on the RTX PRO 6000 node sharded pays
above ~22.5K tokens of context at batch 1 with MTP3), and ``replicated`` where no profile is known
(the CPU). Every rank decides from the step's positions, which are the same on every rank, so all
ranks enter the all-gather together. Each way launches its own kernels, so a FULL CUDA graph holds
one: the scoring is part of the step's ``graph_paths.GraphChoice``, a capture run scored as the host
scores that many requests at the engine's longest context (``for_capture``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from sparkinfer.core.topology import DcpLayout

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardedScoring:
    """This rank's share of a sharded step: the positions ``layout`` gives ``rank``."""

    rank: int
    layout: DcpLayout
    all_gather_into: Callable[[torch.Tensor, torch.Tensor], None]  # (out [P * n, ...], t [n, ...]), rank order

    def owned(self, seq_len: int) -> torch.Tensor:
        """int64, ascending: the positions of ``0 .. seq_len-1`` that this rank scores."""
        return self.layout.token_of(self.rank, torch.arange(self.layout.local_len(seq_len, self.rank)))


def _setting(vllm_config) -> str:
    from sparkinfer.config import from_additional_config

    return from_additional_config(vllm_config.additional_config).indexer_scoring


def _replicated(vllm_config) -> bool:
    from sparkinfer.vllm.indexer_layout import indexer_replicated

    return indexer_replicated(vllm_config)


def node_profile(vllm_config):
    """(the cost profile of this node's GPU at the engine's DCP size, the served model's geometry), or
    (None, None) without a GPU or a profile for it."""
    if not torch.cuda.is_available():
        return None, None
    from sparkinfer.core.costmodel import find_profile
    from sparkinfer.core.geometry import ModelGeometry

    profile = find_profile(torch.cuda.get_device_name(), vllm_config.parallel_config.decode_context_parallel_size)
    if profile is None:
        return None, None
    return profile, ModelGeometry.from_hf_config(vllm_config.model_config.hf_text_config)


def _resolve(vllm_config):
    """(the engine's scoring: ``replicated``, ``sharded`` or ``auto``, the node profile and geometry
    ``auto`` decides with, or None): ``auto`` without a profile for this device, and an engine whose
    indexer is not replicated (DCP 1, upstream's sharded keys), score replicated."""
    setting = _setting(vllm_config) if _replicated(vllm_config) else "replicated"
    if setting != "auto":
        return setting, None, None
    profile, geom = node_profile(vllm_config)
    return ("replicated", None, None) if profile is None else ("auto", profile, geom)


class IndexerScoring:
    """One per indexer metadata builder: ``for_step`` gives the step's ``ShardedScoring`` or None."""

    def __init__(self, vllm_config):
        par = vllm_config.parallel_config
        self.dcp = par.decode_context_parallel_size
        setting, self.profile, self.geom = _resolve(vllm_config)
        if setting == "replicated" and _setting(vllm_config) == "auto" and _replicated(vllm_config):
            log.info("sparkinfer indexer_scoring=auto: no node profile for this device, scoring "
                     "replicated (set indexer_scoring=sharded to split it)")
        self.setting = setting
        self._sharded = None
        if setting != "replicated":
            from vllm.distributed.parallel_state import get_dcp_group

            group = get_dcp_group()

            def all_gather_into(out, t):  # into ``out`` itself on NCCL; gloo (CPU) stages it in a temporary
                torch.distributed.all_gather_single(out, t, group=group.device_group)

            self._sharded = ShardedScoring(group.rank_in_group, DcpLayout(self.dcp, par.cp_kv_cache_interleave_size),
                                           all_gather_into)

    @property
    def can_shard(self) -> bool:
        """Whether some step of this engine may be scored sharded."""
        return self._sharded is not None

    def for_step(self, positions) -> ShardedScoring | None:
        """positions int64 [T] (numpy, or a CPU tensor): each query row's causal position; the row
        scores pos + 1 tokens."""
        if self._sharded is None or len(positions) == 0:
            return None
        if self.setting == "sharded":
            return self._sharded
        from sparkinfer.core.costmodel import choose_indexer

        rows_context = float(positions.sum()) + len(positions)
        return self._share(choose_indexer(self.profile, rows_context, len(positions), self.dcp, self.geom))

    def for_capture(self, num_reqs: int, rows: int, longest_context: int) -> ShardedScoring | None:
        """The share a FULL CUDA graph of ``num_reqs`` uniform decode requests of ``rows`` query rows is
        captured with: the fixed setting's, or ``auto``'s choice for them at ``longest_context``
        (``graph_paths.capture_scoring``)."""
        if self._sharded is None or self.setting == "sharded":
            return self._sharded
        from sparkinfer.decode.graph_paths import capture_scoring

        return self._share(capture_scoring(self.profile, self.geom, self.dcp, num_reqs, rows, longest_context))

    def _share(self, pick: str) -> ShardedScoring | None:
        return self._sharded if pick == "sharded" else None


def scoring_of(share: ShardedScoring | None) -> str:
    """The ``graph_paths.SCORINGS`` name of a step's share."""
    return "replicated" if share is None else "sharded"
