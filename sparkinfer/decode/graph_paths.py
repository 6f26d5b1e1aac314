"""Which decode steps vLLM's FULL CUDA graphs may replay, and on which path (torch-free).

A FULL graph replays the launches of the step it captured: the same kernels, pointers, shapes and
scalars (docs/design/cuda-graphs.md). Two things decide whether a sparkinfer step can be one:

* **the parts of a step** (``NOT_REPLAY_SAFE``): a part whose launches still follow the step's
  requests (not only its padded batch shape) keeps FULL graphs off in every engine that runs it.
  A builder declares what this says of its part (``support``): ``UNIFORM_BATCH`` (vLLM captures
  uniform decode batches of ``1 + num_speculative_tokens`` rows per request) or ``NEVER``; the
  worker refuses a FULL mode that would capture an unsafe part, naming why
  (``model_config_check.graph_problem``). A fix removes its entry here.
* **the step's path** (``step_path.PATHS``): each path launches its own kernels (the exchange, vLLM's
  DCP collectives), so a graph replays one path only. The path is fixed per captured graph: at
  capture the builder takes, for the graph's ``n`` uniform decode requests, the path the host takes
  for ``n`` requests at the engine's longest context (``capture_path``: past the top-k every
  request's union is the whole top-k, so the choice no longer moves with the context, and long
  contexts are what DCP serves); a step replays its size's FULL graph only when the host's choice
  for it is that path, and runs without it otherwise (``replay_mode``: PIECEWISE where vLLM
  captured that size piecewise, else eager), each fallback counted and its reason logged once
  (``GraphPaths``).

vLLM pads a FULL decode batch up to the next capture size with requests of no rows and token rows
past the real ones; the builders plan those as rows that score, attend, write and move nothing
(``step_plan.batch_rows``), with the launches of an unpadded batch of that size, so any capture
sizes do.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Iterable

from sparkinfer.decode.step_path import StepPath

log = logging.getLogger(__name__)

# The builders' parts of a decode step: "attention" (sparse_mla_backend: the cache write and the
# sparse-MLA attention on every path), "indexer" (replicated_indexer: the DSA indexer where sparkinfer
# runs it, ``indexer_layout.serves_replicated_indexer``, every step scored one way: replicated, or
# sharded with its all-gather and merge) and "indexer_per_step" (the same indexer in an engine that
# picks the scoring per step, ``indexer_scoring.chooses_per_step``).
PARTS = ("attention", "indexer", "indexer_per_step")

# What a FULL graph cannot replay yet, part -> why: the one statement the builders' declarations and
# the worker's refusal read. A step scored sharded makes the same launches at one shape, its
# all-gather's included (tests/vllm/test_vllm_host_reads.py), so a fixed scoring replays either way.
NOT_REPLAY_SAFE = {
    "indexer_per_step": ("sparkinfer's indexer picks its scoring per step (indexer_scoring auto on a node with a "
                         "cost profile: sharded or replicated from the step's contexts, an all-gather in one step "
                         "and none in the next), and the choice is not part of the step's graph path yet; "
                         "indexer_scoring = replicated or sharded scores every step one way"),
}


def support(part: str) -> str:
    """The ``AttentionCGSupport`` member name the builder of ``part`` declares."""
    if part not in PARTS:
        raise ValueError(f"unknown part {part!r}; the parts are {PARTS}")
    return "NEVER" if part in NOT_REPLAY_SAFE else "UNIFORM_BATCH"


def unsafe(parts: Iterable[str]) -> dict[str, str]:
    """The parts of ``parts`` a FULL graph cannot replay yet, with why."""
    return {p: NOT_REPLAY_SAFE[p] for p in parts if p in NOT_REPLAY_SAFE}


def capture_path(path: StepPath, num_reqs: int, longest_context: int) -> str:
    """The path the FULL graph of ``num_reqs`` uniform decode requests is captured on: the host's choice
    for that many requests at ``longest_context`` (module docstring). A capture run's requests are not
    real ones: it holds no replica, so the graph is never "local"."""
    if num_reqs < 1 or longest_context < 0:
        raise ValueError(f"num_reqs must be >= 1 and longest_context >= 0, got {num_reqs}, {longest_context}")
    return path.choose([path.rows] * num_reqs, [longest_context] * num_reqs).path


def replay_mode(mode: str, graph_path: str | None, step_path: str | None, piecewise: bool) -> tuple[str, str | None]:
    """(the runtime mode a step runs in, why it does not replay its FULL graph or None).

    ``mode``: what vLLM dispatched (a ``CUDAGraphMode`` name); ``graph_path``: the path the step's FULL
    graph was captured on (None: none recorded); ``step_path``: the host's choice for this step;
    ``piecewise``: vLLM captured this size piecewise too. Only a FULL dispatch is changed."""
    if mode != "FULL":
        return mode, None
    fallback = "PIECEWISE" if piecewise else "NONE"
    if step_path is None:
        return fallback, "no path was chosen for this step"
    if graph_path is None:
        return fallback, "no path was recorded when this size's FULL graph was captured"
    if graph_path == step_path:
        return mode, None
    return fallback, f"the step takes the {step_path} path, this size's FULL graph was captured on {graph_path}"


class GraphPaths:
    """One worker's captured FULL graphs' paths (by their token count) and the step being built: the
    builder records both, the runner's hook (``sparkinfer.vllm.graph_dispatch``) asks ``replay``."""

    def __init__(self):
        self.captured: dict[int, str] = {}
        self.step_path: str | None = None  # the target model step's path, set by its metadata build
        self.fallbacks: Counter = Counter()  # reason -> steps that ran without their FULL graph

    def capture(self, num_tokens: int, path: str) -> None:
        self.captured[num_tokens] = path

    def replay(self, mode: str, num_tokens: int, piecewise: bool) -> str:
        """The runtime mode of the step being run (``replay_mode``); a fallback is counted under its
        reason, logged the first time."""
        run, why = replay_mode(mode, self.captured.get(num_tokens), self.step_path, piecewise)
        if why is not None:
            if why not in self.fallbacks:
                log.info("sparkinfer: a decode step of %d tokens runs %s, not its FULL CUDA graph: %s",
                         num_tokens, run, why)
            self.fallbacks[why] += 1
        return run
