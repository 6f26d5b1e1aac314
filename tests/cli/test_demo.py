"""The end-to-end demo: four host-fabric ranks over several decode steps; selected records (with and
without cross-step reuse) and stock DCP against the dense reference, every workspace against a gather
from the unsharded cache, measured bytes against the accounting. Corrupted runs prove --check fails."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from sparkinfer.cli import main
from sparkinfer.cli.demo import run_demo
from sparkinfer.core import costmodel as cm
from sparkinfer.demo.config import DemoConfig, resolve_demo_mode
from sparkinfer.demo.inputs import build_inputs, committed_lens, step_writes
from sparkinfer.demo.pool import ReusePool
from sparkinfer.demo.report import summarize

SMALL = dict(batch=1, context=64, topk=16, fmt="fp8_ds_mla")


@pytest.mark.multiproc
def test_demo_cli_check_passes_and_policy_picks_stock_on_the_rtx_profile(capsys):
    assert main(["demo", "--check", "--steps", "2", "--batch", "1", "--context", "64", "--topk", "16",
                 "--format", "nvfp4_368", "--mode", "auto", "--hw", "rtx_pro_6000_x4",
                 "--replica-window", "0"]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "top-k identical on all ranks: True" in out and "problems: 0" in out
    assert "sharded scoring gives the same top-k: True" in out  # every rank its own positions, merged
    # the modelled RTX node prefers stock at this size; the same decision on every rank, every step
    assert out.count("policy: stock (depth 0)") == 2 and out.count("same on all ranks: True") == 2
    assert "MISMATCH" not in out and "qrep+a2a B" in out


@pytest.mark.multiproc
def test_demo_defaults_take_the_replica_path_and_move_nothing(capsys):
    """At its defaults every record of the run is in every rank's replica store: each step goes
    selected under auto on the RTX profile (which picks stock without replicas, test above), its
    replica exchange moves 0 bytes and skips every group, and the workspaces built from the store
    still equal the unsharded cache (the float64 reference checks the attention)."""
    assert main(["demo", "--check", "--steps", "2", "--batch", "1", "--context", "64", "--topk", "16",
                 "--format", "nvfp4_368"]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and out.count("every record local (replicas)") == 2
    s = run_demo(DemoConfig(steps=2, mode="auto", fmt="nvfp4_368", **{k: v for k, v in SMALL.items() if k != "fmt"}))
    assert s["ok"] and all(r["path"] == "selected" for r in s["rows"])
    # the policy picks depth 0 for a step with nothing to prefetch: 79 one-layer chunks, none exchanged
    assert all(r["bytes"]["replica"] == 0 and r["replica_exchanges"] == (0, 79) for r in s["rows"])


@pytest.mark.multiproc
def test_demo_small_replica_window_moves_only_what_it_misses():
    s = run_demo(DemoConfig(steps=3, mode="selected", replica_window=24, restart_step=1, **SMALL))
    assert s["ok"], s["problems"]
    for r in s["rows"]:
        assert r["bytes_ok"]["replica"] and r["replica_exchanges"] == (22, 0) and r["replica_held"] > 0
        assert 0 < r["bytes"]["replica"] < r["bytes"]["reuse"]


def _check_reuse(rows):
    assert all(all(r["bytes_ok"].values()) and r["copies_ok"] for r in rows)
    assert rows[0]["bytes"]["reuse"] == rows[0]["bytes"]["selected"] and rows[0]["hit_rate"] == 0
    for r in rows[1:]:
        assert 0.3 < r["overlap"] < 0.95  # consecutive steps' unions overlap, as in trained models
        assert r["hit_rate"] > 0.1 and r["bytes"]["reuse"] < 0.9 * r["bytes"]["selected"]


@pytest.mark.multiproc
def test_demo_reuse_under_the_policy_with_eviction():
    """h200_x4: the policy picks selected; the pools fill, later steps move only missing records;
    a small pool forces evictions. Every byte matrix and copy count equals the accounting, every
    workspace the unsharded gather (``ok``)."""
    cap = 79 * 12  # 12 rows per layer (79 with the MTP layer): below a layer's remote union
    s = run_demo(DemoConfig(replica_window=0, steps=3, profile="h200_x4", pool_rows=cap, **SMALL))
    assert s["ok"], s["problems"]
    rows = s["rows"]
    assert all(r["path"] == "selected" and r["decision_agreed"] for r in rows)
    _check_reuse(rows)
    # stock with replicated queries (vLLM's GLM-MoE-DSA default): per (src, dst) pair and layer the
    # a2a carries 4 rows x 2 local heads x (512 + 2) bf16 (LSE packed in 2 elements); 12 pairs, 79 layers
    assert all(r["stock_qrep"] == 12 * 79 * 4 * 2 * 514 * 2 < r["bytes"]["stock"] for r in rows)
    assert max(r["pool_rows"] for r in rows) == cap  # full: commits evicted to make room


@pytest.mark.multiproc
def test_demo_auto_warms_a_cold_pool_by_amortising_over_the_remaining_steps(tmp_path):
    """A node whose links are slow enough that records matter: under auto the policy goes selected
    from the first step, including a step the per-step model rates slower than stock (stale
    new fraction, larger union), because the plan over the remaining steps at the steady reuse share
    (the prior, then the tracker's observed warm miss share) is cheaper; the pools then serve most
    remote records."""
    prof = json.loads((Path(cm.PROFILE_DIR) / "rtx_pro_6000_x4.json").read_text())
    prof.update(name="slow_link", bw_dir_GBps=0.1, bw_bidir_GBps=0.2, exchange_us=60.0, copy_us=0.5)
    path = tmp_path / "slow_link.json"
    path.write_text(json.dumps(prof))
    s = run_demo(DemoConfig(replica_window=0, steps=3, profile=str(path), mode="auto", batch=1, context=128, topk=64, heads=4,
                            fmt="fp8_ds_mla"))
    assert s["ok"], s["problems"]
    rows = s["rows"]
    assert all(r["path"] == "selected" and r["decision_agreed"] for r in rows)
    assert [r["horizon"] for r in rows] == [3, 2, 1]
    warmup = [r for r in rows if r["selected_us"] > r["stock_us"]]
    assert warmup and all(r["horizon"] > 1 and r["plan_selected_us"] < r["plan_stock_us"] for r in warmup)
    assert rows[-1]["selected_us"] < rows[-1]["stock_us"]  # warm: faster per step too
    _check_reuse(rows)


@pytest.mark.multiproc
def test_demo_forced_selected_with_a_shallow_ring_and_a_request_that_ends():
    """mode=selected on the RTX profile (whose model prefers stock); a ring of depth 1 splits each
    4-layer group into two exchanges, which the copy counts and bytes must reflect. Before step 2
    request 0 ends and a new request takes its slot and KV blocks: its entries leave the pools
    (their rows are reused), its records are never served to the new request."""
    s = run_demo(DemoConfig(replica_window=0, steps=3, mode="selected", depth=1, restart_step=2, batch=2, context=64, topk=16,
                            fmt="fp8_ds_mla"))
    assert s["ok"], s["problems"]
    rows = s["rows"]
    assert all(r["path"] == "selected" and r["depth"] <= 1 and r["reason"] == "mode=selected" for r in rows)
    _check_reuse(rows[:2])
    assert rows[2]["restart"]["ended"] == 0 and rows[2]["restart"]["new"] == 2
    assert rows[2]["restart"]["dropped"] > 0
    # the new request has nothing pooled yet: its remote records all move, the other request's mostly not
    assert 0 < rows[2]["hit_rate"] < rows[1]["hit_rate"]


@pytest.mark.multiproc
def test_demo_detects_a_request_end_that_keeps_its_pool_entries():
    s = run_demo(DemoConfig(replica_window=0, steps=2, mode="selected", restart_step=1, forget_drop=True, **SMALL))
    assert not s["ok"]
    assert s["problems"] == ["reuse pools not empty after every request ended"]


@pytest.mark.multiproc
def test_demo_detects_a_corrupt_shard():
    summary = run_demo(DemoConfig(steps=2, corrupt_rank=2, mode="selected", **SMALL))
    assert not summary["ok"]
    assert summary["topk_identical"]  # the indexer is replicated: corrupting main records leaves top-k alone
    probs = "\n".join(summary["problems"])
    assert "workspace differs" in probs and "selected max error" in probs and "stock max error" in probs
    assert all(all(r["bytes_ok"].values()) for r in summary["rows"])  # the bytes moved are still right


def _fake_results(world=4):
    """A run's per-rank results whose numbers agree, to flip one thing at a time."""
    m = (np.ones((world, world), np.int64) - np.eye(world, dtype=np.int64)) * 1000
    step = {"path": "selected", "depth": 3, "stock_us": 2.0, "selected_us": 1.0, "reason": "x", "horizon": 1,
            "plan_stock_us": 2.0, "plan_selected_us": 1.0, "stock_qrep": 6000,
            "decision_agreed": True, "measured": {p: m.tolist() for p in ("stock", "selected", "reuse", "replica")},
            "accounted": {p: m.tolist() for p in ("stock", "selected", "reuse", "replica")}, "union_ratio": 1.5,
            "replica_exchanges": (1, 0), "replica_held": 10,
            "overlap": None, "hit_rate": 0.0, "accepted": [1], "pool_rows": 0, "err_selected": 1e-7,
            "err_stock": 1e-7, "workspace_exact": True, "spec_dropped": 0, "sharded_equal": True,
            "copies": {"selected": (12, 12), "reuse": (9, 9)}, "restart": None}
    return [{"rank": r, "steps": [dict(step)], "times": {}, "tol": 1e-4, "tol_stock": 2e-2, "topk_identical": True,
             "pools_empty": True} for r in range(world)]


def test_summary_flags_a_byte_mismatch_on_one_pair_even_when_totals_agree():
    res = _fake_results()
    assert summarize(DemoConfig(), res)["ok"]
    m = np.array(res[0]["steps"][0]["measured"]["reuse"])
    m[0, 1] += 8
    m[0, 2] -= 8  # same total, wrong pairs
    for r in res:
        r["steps"][0] = dict(r["steps"][0], measured=dict(r["steps"][0]["measured"], reuse=m.tolist()))
    s = summarize(DemoConfig(), res)
    assert not s["ok"] and "reuse bytes measured" in s["problems"][0]


@pytest.mark.parametrize("field,value,msg", [("decision_agreed", False, "different policy decisions"),
                                             ("workspace_exact", False, "workspace differs"),
                                             ("err_stock", 5e-2, "stock max error"),
                                             ("err_selected", 2e-4, "selected max error"),
                                             ("copies", {"selected": (12, 12), "reuse": (9, 8)}, "copies"),
                                             ("spec_dropped", 3, "rejected draft"),
                                             ("sharded_equal", False, "sharded scoring")])
def test_summary_flags_each_failure(field, value, msg):
    res = _fake_results()
    res[3]["steps"][0] = dict(res[3]["steps"][0], **{field: value})
    s = summarize(DemoConfig(), res)
    assert not s["ok"] and msg in s["problems"][0]
    res = _fake_results()
    res[1]["pools_empty"] = False
    assert "pools not empty" in summarize(DemoConfig(), res)["problems"][0]


def test_steps_write_final_records_for_accepted_drafts_and_junk_for_rejected_ones():
    cfg = DemoConfig(steps=4, accept=0.5, **SMALL)
    inp = build_inputs(cfg)
    lens = committed_lens(inp)
    R = 1 + cfg.mtp
    assert lens.shape == (5, 1) and int(lens[0, 0]) == cfg.context - R
    assert torch.equal(lens[1:] - lens[:-1], inp.accept + 1)
    assert int(lens[-1].max()) + cfg.mtp < cfg.max_len + R
    cache = inp.main.clone()
    seen_reject = False
    for s in range(cfg.steps):
        pos, main_w, _ = step_writes(inp, s, lens[s])
        a = int(inp.accept[s, 0])
        for r in range(R):
            want = inp.main[:, 0, pos[0, r]] if r <= a else inp.junk[s, :, 0, r]
            assert torch.equal(main_w[:, 0, r], want)
            seen_reject |= r > a
        cache[:, 0, pos[0]] = main_w[:, 0]
        # everything committed after this step holds its final record (rejected drafts lie past it)
        n = int(lens[s + 1, 0])
        assert torch.equal(cache[:, 0, :n], inp.main[:, 0, :n])
    assert seen_reject


def test_demo_config_rejects_bad_sizes():
    with pytest.raises(ValueError, match="divide"):
        DemoConfig(heads=6)
    with pytest.raises(ValueError, match="topk"):
        DemoConfig(context=16, topk=32)
    with pytest.raises(ValueError, match="steps"):
        DemoConfig(steps=0)
    with pytest.raises(ValueError, match="accept"):
        DemoConfig(accept=1.5)
    with pytest.raises(ValueError, match="restart_step"):
        DemoConfig(steps=2, restart_step=2)


def test_reuse_pool_fill_and_store_round_trip_and_refuse_unheld_rows():
    pool = ReusePool(rank=1, capacity=4, width=3)
    ws = torch.arange(2 * 3 * 3, dtype=torch.uint8).view(6, 3)  # B=2, U=3
    assert pool.store(ws, (np.array([0, 1]), np.array([2, 0]), np.array([3, 0])), 3) == 2
    out = torch.zeros(6, 3, dtype=torch.uint8)
    slots = np.array([[-1, -1, 3], [0, -1, -1]])
    assert pool.fill(out, slots, slots >= 0) == 2
    assert torch.equal(out[2], ws[2]) and torch.equal(out[3], ws[3]) and not out[[0, 1, 4, 5]].any()
    with pytest.raises(RuntimeError, match="does not hold"):
        pool.fill(out, slots, np.ones((2, 3), bool))


def test_mode_is_resolved_once_like_the_policy_does():
    env = {"VLLM_SPARKINFER_MODE": "selected"}
    assert resolve_demo_mode(DemoConfig(), env={}).mode == "auto"  # the profile's
    assert resolve_demo_mode(DemoConfig(), env=env).mode == "selected"
    assert resolve_demo_mode(DemoConfig(mode="stock"), env=env).mode == "stock"
    with pytest.raises(ValueError, match="mode"):
        resolve_demo_mode(DemoConfig(), env={"VLLM_SPARKINFER_MODE": "fastest"})
