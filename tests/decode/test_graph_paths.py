"""Which decode steps replay from vLLM's FULL CUDA graphs (``sparkinfer.decode.graph_paths``), the
worker's refusal of the graphs that would not (``model_config_check.graph_problem``) and the graphs
the dry run resolves (``profile_graphs``). Torch-free, no vLLM."""

import itertools

import pytest

from sparkinfer.config import SparkinferConfig
from sparkinfer.decode import graph_paths as gp
from sparkinfer.decode.step_path import PATHS, StepPath
from sparkinfer.vllm.model_config_check import (FULL_DECODE_MODES, VLLM_DEFAULT_SPLITS, Graphs, graph_problem,
                                                profile_graphs)

MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")


@pytest.mark.parametrize("mode, graph_path, step_path, piecewise",
                         itertools.product(MODES, (None, *PATHS), (None, *PATHS), (False, True)))
def test_a_full_graph_replays_only_the_path_it_was_captured_on(mode, graph_path, step_path, piecewise):
    """Every dispatched mode, captured path, step path and piecewise availability: only a FULL
    dispatch changes, and it stands exactly when the step's path is the graph's; otherwise the step
    runs PIECEWISE where that size was captured piecewise, else eagerly, with a reason."""
    run, why = gp.replay_mode(mode, graph_path, step_path, piecewise)
    if mode != "FULL":
        assert (run, why) == (mode, None)
    elif graph_path is not None and graph_path == step_path:
        assert (run, why) == ("FULL", None)
    else:
        assert run == ("PIECEWISE" if piecewise else "NONE") and why
        if graph_path is not None and step_path is not None:
            assert step_path in why and graph_path in why


def test_fallbacks_are_counted_per_reason_and_logged_once(caplog):
    g = gp.GraphPaths()
    g.capture(16, "selected")
    g.capture(8, "stock")
    caplog.set_level("INFO", logger=gp.__name__)
    g.step_path = "selected"
    assert g.replay("FULL", 16, True) == "FULL"
    g.step_path = "local"
    assert [g.replay("FULL", 16, True) for _ in range(3)] == ["PIECEWISE"] * 3
    assert g.replay("FULL", 8, False) == "NONE"  # FULL_DECODE_ONLY: no piecewise graph, eager
    assert g.replay("PIECEWISE", 16, True) == "PIECEWISE"  # not a FULL dispatch: untouched
    assert sorted(g.fallbacks.values()) == [1, 3]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all("local" in line for line in lines), lines


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


def test_the_statement_drives_each_builders_declaration():
    for part in gp.PARTS:
        assert gp.support(part) == ("NEVER" if part in gp.NOT_REPLAY_SAFE else "UNIFORM_BATCH")
    assert set(gp.NOT_REPLAY_SAFE) <= set(gp.PARTS)
    assert gp.unsafe(["attention"]) == {p: r for p, r in gp.NOT_REPLAY_SAFE.items() if p == "attention"}
    with pytest.raises(ValueError):
        gp.support("exchange")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("parts", [("attention",), ("attention", "indexer"), ("attention", "indexer", "indexer_per_step")])
def test_graph_problem_refuses_full_decode_graphs_for_what_is_not_replay_safe(mode, parts, monkeypatch):
    """FULL decode modes are refused exactly while a part the engine runs is named in
    ``NOT_REPLAY_SAFE`` (its reason quoted); FULL graphs of mixed batches always. Holds with and
    without an indexer entry in the statement; with today's, an engine at a fixed scoring (its parts
    ``attention, indexer``, sharded included) passes and one picking the scoring per step does not. The capture sizes are not read: vLLM's defaults and
    sizes that pad a decode batch into a larger graph both pass (the builders plan the padding,
    ``step_plan.batch_rows``; tests/vllm/test_engine_start.py holds the worker's check on vLLM's
    resolved default sizes)."""
    for statement in (gp.NOT_REPLAY_SAFE, {}):
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
def test_the_dry_run_resolves_full_decode_graphs_only_where_every_part_supports_them(requested, split):
    """vLLM's resolution for the builders' least support: with a NEVER part (the indexer whose scoring
    is picked per step) no FULL decode mode survives; without one, FULL becomes a FULL decode mode."""
    for parts in (("attention",), ("attention", "indexer"), ("attention", "indexer", "indexer_per_step")):
        g = profile_graphs(requested, split, eager=False, breakable=False, parts=parts)
        uniform = all(gp.support(p) == "UNIFORM_BATCH" for p in parts)
        if not uniform:
            assert g.mode not in FULL_DECODE_MODES
        elif (requested or "FULL_AND_PIECEWISE") in ("FULL", *FULL_DECODE_MODES):
            assert g.mode in FULL_DECODE_MODES
        eager = profile_graphs(requested, split, eager=True, breakable=False, parts=parts)
        assert eager.mode == "NONE"
