"""Which decode steps vLLM's FULL CUDA graphs may replay, and on which path (torch-free).

A FULL graph replays the launches of the step it captured: the same kernels, pointers, shapes and
scalars (docs/design/cuda-graphs.md). Two things decide whether a sparkinfer step can be one:

* **the parts of a step** (``NOT_REPLAY_SAFE``): a part whose launches still follow the step's
  requests (not only its padded batch shape and its choice below) keeps FULL graphs off in every
  engine that runs it. A builder declares what this says of its part (``support``):
  ``UNIFORM_BATCH`` (vLLM captures uniform decode batches of ``1 + num_speculative_tokens`` rows per
  request) or ``NEVER``; the worker refuses a FULL mode that would capture an unsafe part, naming
  why (``model_config_check.graph_problem``). A fix removes its entry here; none is left.
* **the step's choice** (``GraphChoice``): what the host picks per step among launches of its own,
  so a graph replays one choice only: the attention's **path** (``step_path.PATHS``: the exchange,
  vLLM's DCP collectives) and the indexer's **scoring** (``SCORINGS``: sharded adds an all-gather
  and a merge per indexer layer; ``indexer_scoring``). Both are fixed per captured graph: at capture
  each builder takes, for the graph's ``n`` uniform decode requests, the host's choice for ``n``
  requests at the engine's longest context (``capture_path``: past the top-k every request's union
  is the whole top-k, so the path no longer moves with the context; ``capture_scoring``: sharding
  pays with the context, and long contexts are what DCP serves); a step replays its size's FULL
  graph only when the host's choice for it is that graph's, path and scoring both, and runs without
  it otherwise (``replay_mode``: PIECEWISE where vLLM captured that size piecewise, else eager), each
  fallback counted and its reason logged once (``GraphPaths``).

vLLM pads a FULL decode batch up to the next capture size with requests of no rows and token rows
past the real ones; the builders plan those as rows that score, attend, write and move nothing
(``step_plan.batch_rows``), with the launches of an unpadded batch of that size, so any capture
sizes do.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, replace
from typing import Iterable

from sparkinfer.core.costmodel import NodeProfile, choose_indexer
from sparkinfer.core.geometry import ModelGeometry
from sparkinfer.decode.step_path import StepPath

log = logging.getLogger(__name__)

# The builders' parts of a decode step: "attention" (sparse_mla_backend: the cache write and the
# sparse-MLA attention on every path) and "indexer" (replicated_indexer: the DSA indexer where
# sparkinfer runs it, ``indexer_layout.serves_replicated_indexer``, each step scored replicated or
# sharded with its all-gather and merge, fixed per engine or picked per step by ``auto``).
PARTS = ("attention", "indexer")

# What a FULL graph cannot replay yet, part -> why: the one statement the builders' declarations and
# the worker's refusal read. Empty: a step scored sharded makes the same launches at one shape, its
# all-gather's included (tests/vllm/test_vllm_host_reads.py), and ``auto``'s per-step choice of the
# scoring is part of the step's ``GraphChoice``.
NOT_REPLAY_SAFE: dict[str, str] = {}

# The indexer's scorings (``sparkinfer.vllm.indexer_scoring``): every rank scores the whole context,
# or the positions it owns and all-gathers its candidates.
SCORINGS = ("replicated", "sharded")


def support(part: str) -> str:
    """The ``AttentionCGSupport`` member name the builder of ``part`` declares."""
    if part not in PARTS:
        raise ValueError(f"unknown part {part!r}; the parts are {PARTS}")
    return "NEVER" if part in NOT_REPLAY_SAFE else "UNIFORM_BATCH"


def unsafe(parts: Iterable[str]) -> dict[str, str]:
    """The parts of ``parts`` a FULL graph cannot replay yet, with why."""
    return {p: NOT_REPLAY_SAFE[p] for p in parts if p in NOT_REPLAY_SAFE}


@dataclass(frozen=True)
class GraphChoice:
    """What the host chose for a step (or a capture run) beyond its padded batch shape, each with
    launches of its own: the attention's ``path`` (``step_path.PATHS``) and the indexer's ``scoring``
    (``SCORINGS``; None where the engine runs no sparkinfer indexer). None: not chosen (recorded)."""

    path: str | None = None
    scoring: str | None = None


def capture_path(path: StepPath, num_reqs: int, longest_context: int) -> str:
    """The path the FULL graph of ``num_reqs`` uniform decode requests is captured on: the host's choice
    for that many requests at ``longest_context`` (module docstring). A capture run's requests are not
    real ones: it holds no replica, so the graph is never "local"."""
    if num_reqs < 1 or longest_context < 0:
        raise ValueError(f"num_reqs must be >= 1 and longest_context >= 0, got {num_reqs}, {longest_context}")
    return path.choose([path.rows] * num_reqs, [longest_context] * num_reqs).path


def capture_scoring(profile: NodeProfile, geom: ModelGeometry, dcp: int, num_reqs: int, rows: int,
                    longest_context: int) -> str:
    """The scoring the FULL graph of ``num_reqs`` uniform decode requests of ``rows`` query rows is
    captured with, where the engine picks it per step (``indexer_scoring`` auto with the node's
    ``profile``): the host's choice (``choose_indexer``) for those rows at ``longest_context``, row i
    of a request scoring ``longest_context + i + 1`` tokens, as a step's rows do."""
    if num_reqs < 1 or rows < 1 or longest_context < 0:
        raise ValueError(f"num_reqs and rows must be >= 1 and longest_context >= 0, got {num_reqs}, {rows}, "
                         f"{longest_context}")
    scored = num_reqs * sum(longest_context + i + 1 for i in range(rows))
    return choose_indexer(profile, scored, num_reqs * rows, dcp, geom)


def replay_mode(mode: str, graph: GraphChoice | None, step: GraphChoice, piecewise: bool) -> tuple[str, str | None]:
    """(the runtime mode a step runs in, why it does not replay its FULL graph or None).

    ``mode``: what vLLM dispatched (a ``CUDAGraphMode`` name); ``graph``: what the step's FULL graph
    was captured on (None: nothing recorded); ``step``: the host's choice for this step;
    ``piecewise``: vLLM captured this size piecewise too. Only a FULL dispatch is changed: it stands
    exactly when the step's path and scoring are the graph's."""
    if mode != "FULL":
        return mode, None
    fallback = "PIECEWISE" if piecewise else "NONE"
    if step.path is None:
        return fallback, "no path was chosen for this step"
    if graph is None or graph.path is None:
        return fallback, "no path was recorded when this size's FULL graph was captured"
    if graph.path != step.path:
        return fallback, f"the step takes the {step.path} path, this size's FULL graph was captured on {graph.path}"
    if graph.scoring != step.scoring:
        return fallback, (f"the step's indexer scores {step.scoring or '(no scoring chosen)'}, this size's FULL "
                          f"graph was captured scoring {graph.scoring or '(no scoring recorded)'}")
    return mode, None


class GraphPaths:
    """One worker's captured FULL graphs' choices (by their token count) and the step being built's:
    the builders record them, each its own field (``capture``, ``choose``), the runner's hook
    (``sparkinfer.vllm.graph_dispatch``) asks ``replay``."""

    def __init__(self):
        self.captured: dict[int, GraphChoice] = {}
        self.step = GraphChoice()  # the target model step's choice, set by its metadata builds
        self.fallbacks: Counter = Counter()  # reason -> steps that ran without their FULL graph

    def capture(self, num_tokens: int, **choice: str) -> None:
        """A capture (or FULL warm-up) run of ``num_tokens`` tokens was built on ``choice`` (``path=`` or
        ``scoring=``, each builder its own)."""
        self.captured[num_tokens] = replace(self.captured.get(num_tokens, GraphChoice()), **choice)

    def choose(self, **choice: str) -> None:
        """The target model step being built takes ``choice`` (``path=`` or ``scoring=``)."""
        self.step = replace(self.step, **choice)

    def replay(self, mode: str, num_tokens: int, piecewise: bool) -> str:
        """The runtime mode of the step being run (``replay_mode``); a fallback is counted under its
        reason, logged the first time."""
        run, why = replay_mode(mode, self.captured.get(num_tokens), self.step, piecewise)
        if why is not None:
            if why not in self.fallbacks:
                log.info("sparkinfer: a decode step of %d tokens runs %s, not its FULL CUDA graph: %s",
                         num_tokens, run, why)
            self.fallbacks[why] += 1
        return run
