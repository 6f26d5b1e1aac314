"""Which decode steps replay from vLLM's FULL CUDA graphs (``sparkinfer.decode.graph_paths``), the
worker's refusal of the graphs that would not (``model_config_check.graph_problem``) and the graphs
the dry run resolves (``profile_graphs``). Torch-free, no vLLM."""

import itertools

import pytest

from sparkinfer.config import SparkinferConfig
from sparkinfer.core import costmodel as cm
from sparkinfer.core.geometry import GLM52
from sparkinfer.decode import graph_paths as gp
from sparkinfer.decode.step_path import PATHS, StepPath
from sparkinfer.vllm.model_config_check import (FULL_DECODE_MODES, VLLM_DEFAULT_SPLITS, Graphs, graph_problem,
                                                profile_graphs)

MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")


CHOICES = [None, *(gp.GraphChoice(path, scoring) for path in (None, *PATHS) for scoring in (None, *gp.SCORINGS))]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("piecewise", (False, True))
def test_a_full_graph_replays_only_the_path_and_scoring_it_was_captured_on(mode, piecewise):
    """Every dispatched mode, captured choice (none recorded, a path or a scoring unrecorded), step
    choice and piecewise availability: only a FULL dispatch changes, and it stands exactly when the
    step has a path and its path and scoring both equal the graph's (an engine without sparkinfer's
    indexer records no scoring on either side); otherwise the step runs PIECEWISE where that size was
    captured piecewise, else eagerly, with a reason naming what differs."""
    for graph, step in itertools.product(CHOICES, CHOICES[1:]):
        run, why = gp.replay_mode(mode, graph, step, piecewise)
        if mode != "FULL":
            assert (run, why) == (mode, None)
            continue
        same = graph is not None and step.path is not None and (graph.path, graph.scoring) == (step.path, step.scoring)
        if same:
            assert (run, why) == ("FULL", None)
            continue
        assert run == ("PIECEWISE" if piecewise else "NONE") and why
        if step.path is None or graph is None or graph.path is None:
            assert "no path" in why
        elif graph.path != step.path:
            assert step.path in why and graph.path in why
        else:  # the same path, another scoring (or one side unrecorded)
            assert "scor" in why and all(s in why for s in (step.scoring, graph.scoring) if s is not None)


def test_the_pair_rule_case_by_case():
    """The four cases of the pair rule, spelled out: match, scoring mismatch, attention mismatch, unrecorded."""
    graph = gp.GraphChoice("selected", "sharded")
    assert gp.replay_mode("FULL", graph, gp.GraphChoice("selected", "sharded"), True) == ("FULL", None)
    run, why = gp.replay_mode("FULL", graph, gp.GraphChoice("selected", "replicated"), True)
    assert run == "PIECEWISE" and "replicated" in why and "sharded" in why
    run, why = gp.replay_mode("FULL", graph, gp.GraphChoice("stock", "sharded"), False)
    assert run == "NONE" and "stock" in why and "selected" in why
    assert gp.replay_mode("FULL", None, gp.GraphChoice("selected", "sharded"), True)[0] == "PIECEWISE"
    # a graph whose capture recorded the path but not the indexer's scoring replays no scored step
    unrecorded = gp.replay_mode("FULL", gp.GraphChoice("selected"), gp.GraphChoice("selected", "sharded"), True)
    assert unrecorded[0] == "PIECEWISE" and "no scoring recorded" in unrecorded[1]


def test_fallbacks_are_counted_per_reason_and_logged_once(caplog):
    g = gp.GraphPaths()
    g.capture(16, path="selected")
    g.capture(16, scoring="sharded")  # the indexer's builder, beside the attention's: one pair
    g.capture(8, path="stock")
    assert g.captured == {16: gp.GraphChoice("selected", "sharded"), 8: gp.GraphChoice("stock")}
    caplog.set_level("INFO", logger=gp.__name__)
    g.choose(scoring="sharded")  # whichever builder runs first, the step's pair is both builders'
    g.choose(path="selected")
    assert g.replay("FULL", 16, True) == "FULL"
    g.choose(path="local")
    assert [g.replay("FULL", 16, True) for _ in range(3)] == ["PIECEWISE"] * 3
    g.choose(path="stock")
    assert g.replay("FULL", 8, False) == "NONE"  # FULL_DECODE_ONLY: no piecewise graph, eager
    assert g.replay("PIECEWISE", 16, True) == "PIECEWISE"  # not a FULL dispatch: untouched
    g.choose(path="selected", scoring="replicated")
    assert g.replay("FULL", 16, True) == "PIECEWISE"
    assert sorted(g.fallbacks.values()) == [1, 1, 3]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and "local" in lines[0] and "scor" in lines[1] and "replicated" in lines[2], lines
    with pytest.raises(TypeError):
        g.choose(exchange="on")


def _path(mode="selected", dcp=4, max_batch=8, policy=None):
    return StepPath(SparkinferConfig(mode=mode, prefetch_depth=2), dcp=dcp, record_format=True, rows=4,
                    max_batch=max_batch, policy=policy)


@pytest.mark.parametrize("num_reqs", range(1, 12))
@pytest.mark.parametrize("mode, dcp", [("selected", 4), ("auto", 4), ("stock", 4), ("selected", 1)])
def test_a_graph_is_captured_on_the_hosts_choice_at_the_longest_context(num_reqs, mode, dcp):
    """The captured path is what the host takes for that many uniform decode requests at the longest
    context, never "local" (a capture run holds no replica): selected within the workspace's
    max_batch in mode selected, stock past it, at DCP1 and in mode stock (auto without a profile)."""
    p = _path(mode, dcp)
    got = gp.capture_path(p, num_reqs, 100_000)
    assert got == p.choose([4] * num_reqs, [100_000] * num_reqs).path
    assert got == ("selected" if mode == "selected" and dcp > 1 and num_reqs <= 8 else "stock")
    with pytest.raises(ValueError):
        gp.capture_path(p, 0, 100)


@pytest.mark.parametrize("profile", ["rtx_pro_6000_x4", "h200_x4"])
@pytest.mark.parametrize("rows", [1, 4])
def test_a_graph_is_scored_as_the_host_scores_its_requests_at_the_longest_context(profile, rows):
    """The captured scoring is ``choose_indexer`` for ``n`` requests of ``rows`` rows at the context
    (row i scoring context + i + 1 tokens, summed in closed form here), and it flips to sharded exactly
    at the cost model's own edge for that batch (``sharded_scoring_from``): a graph at the longest
    context of a DCP4 engine is sharded, one captured where contexts are short replicated."""
    p = cm.load_profile(profile)
    for n in (1, 2, 5, 16):
        edge = cm.sharded_scoring_from(p, n, rows, 4, GLM52)
        for context in (0, 1000, edge - 1, edge, edge + 1, 262_140):
            if context < 0:
                continue
            got = gp.capture_scoring(p, GLM52, 4, n, rows, context)
            assert got == cm.choose_indexer(p, n * rows * context + n * rows * (rows + 1) // 2, n * rows, 4, GLM52)
            assert got == ("sharded" if context >= edge else "replicated"), (n, context, edge)
        assert gp.capture_scoring(p, GLM52, 4, n, rows, 262_140) == "sharded"
    with pytest.raises(ValueError):
        gp.capture_scoring(p, GLM52, 4, 0, rows, 100)


# a stand-in entry: the statement is empty today, and what it drives must still hold when a part is not
# replay-safe
UNSAFE_INDEXER = {"indexer": "the indexer's launches would follow the step's contexts (a stand-in reason)"}


@pytest.mark.parametrize("statement", [gp.NOT_REPLAY_SAFE, UNSAFE_INDEXER])
def test_the_statement_drives_each_builders_declaration(statement, monkeypatch):
    monkeypatch.setattr(gp, "NOT_REPLAY_SAFE", statement)
    for part in gp.PARTS:
        assert gp.support(part) == ("NEVER" if part in statement else "UNIFORM_BATCH")
    assert set(statement) <= set(gp.PARTS)
    assert gp.unsafe(["attention"]) == {} and gp.unsafe(gp.PARTS) == statement
    with pytest.raises(ValueError):
        gp.support("exchange")


def test_no_part_is_left_unsafe():
    """``indexer_scoring = auto``'s per-step choice is part of the step's ``GraphChoice``: every part
    declares UNIFORM_BATCH, so the DCP4 engines (auto, a node profile) take FULL decode graphs."""
    assert gp.NOT_REPLAY_SAFE == {} and {gp.support(p) for p in gp.PARTS} == {"UNIFORM_BATCH"}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("parts", [("attention",), ("attention", "indexer")])
def test_graph_problem_refuses_full_decode_graphs_for_what_is_not_replay_safe(mode, parts, monkeypatch):
    """FULL decode modes are refused exactly while a part the engine runs is named in
    ``NOT_REPLAY_SAFE`` (its reason quoted); FULL graphs of mixed batches always. Holds with today's
    empty statement (every engine passes, the indexer at any scoring) and with a stand-in indexer
    entry (an engine running sparkinfer's indexer refused, one without it not). The capture sizes are
    not read: vLLM's defaults and sizes that pad a decode batch into a larger graph both pass (the
    builders plan the padding, ``step_plan.batch_rows``; tests/vllm/test_engine_start.py holds the
    worker's check on vLLM's resolved default sizes)."""
    for statement in (gp.NOT_REPLAY_SAFE, UNSAFE_INDEXER):
        monkeypatch.setattr(gp, "NOT_REPLAY_SAFE", statement)
        g = Graphs(mode, VLLM_DEFAULT_SPLITS, True, True, False, parts)
        why = graph_problem(g)
        bad = {p: r for p, r in statement.items() if p in parts}
        if mode in ("NONE", "PIECEWISE"):
            assert why is None
        elif mode == "FULL":
            assert "mixed" in why
        elif bad:
            assert all(r in why for r in bad.values()), why
        else:
            assert why is None


@pytest.mark.parametrize("requested", [None, *MODES])
@pytest.mark.parametrize("split", [None, (), ("vllm::unified_mla_attention_with_output",)])
def test_the_dry_run_resolves_full_decode_graphs_only_where_every_part_supports_them(requested, split, monkeypatch):
    """vLLM's resolution for the builders' least support: with a NEVER part (the stand-in unsafe
    indexer) no FULL decode mode survives; without one (today), FULL becomes a FULL decode mode."""
    for statement in (gp.NOT_REPLAY_SAFE, UNSAFE_INDEXER):
        monkeypatch.setattr(gp, "NOT_REPLAY_SAFE", statement)
        for parts in (("attention",), ("attention", "indexer")):
            g = profile_graphs(requested, split, eager=False, breakable=False, parts=parts)
            uniform = all(gp.support(p) == "UNIFORM_BATCH" for p in parts)
            if not uniform:
                assert g.mode not in FULL_DECODE_MODES
            elif (requested or "FULL_AND_PIECEWISE") in ("FULL", *FULL_DECODE_MODES):
                assert g.mode in FULL_DECODE_MODES
            eager = profile_graphs(requested, split, eager=True, breakable=False, parts=parts)
            assert eager.mode == "NONE"
