"""Capacity planning: the spec's per-token figures, tokens-that-fit against brute force, CLI."""

import json
import subprocess
from dataclasses import replace
import sys

import pytest

from sparkinfer.cli import main as cli_main
from sparkinfer.cli import plan as plan_cli
from sparkinfer.core.capacity import GIB, CapacityProfile, capacity_plan, freed_tokens
from sparkinfer.core.geometry import GLM52, ModelGeometry


def profile(**kw):
    base = dict(tp=4, dcp=4, mtp=3, record_format="nvfp4_368", indexer="replicated",
                kv_bytes=10 * GIB)
    base.update(kw)
    return CapacityProfile(**base)


@pytest.mark.parametrize("fmt,main", [("nvfp4_368", 7268), ("nvfp4_ds_mla:bf16-rope-432", 8532),
                                      ("656", 12956)])
def test_spec_figures(fmt, main):
    p = capacity_plan(profile(record_format=fmt))
    assert p.main_bytes_per_token == main
    assert p.indexer_bytes_per_token == 2904 and p.indexer_bytes_per_token_avg == 2904
    assert p.bytes_per_token == main + 2904
    s = capacity_plan(profile(record_format=fmt, indexer="sharded"))
    assert s.indexer_bytes_per_token_avg == 22 * 132 / 4 and s.indexer_bytes_per_token == 0


def test_geometry_counts():
    assert GLM52.cached_layers(True) == 79 and GLM52.indexer_layers(True) == 22
    assert GLM52.cached_layers(False) == 78 and GLM52.indexer_layers(False) == 21
    p = capacity_plan(profile(mtp=0, dcp=2))
    assert (p.main_layers, p.indexer_layers) == (78, 21)
    assert p.main_bytes_per_token == 78 * 368 / 2


def brute_kv_tokens(prof):
    """Deal tokens one by one (vLLM's placement), tracking every rank's bytes; the answer is
    the longest whole-block prefix for which every rank stays within the budget."""
    geo = prof.geometry
    rb = {"nvfp4_368": 368, "432": 432, "656": 656}[prof.record_format]
    main = geo.cached_layers(prof.mtp > 0) * rb
    idx = geo.indexer_layers(prof.mtp > 0) * 132
    used = [0] * prof.dcp
    granule = prof.block_size * prof.dcp
    best, t = 0, 0
    while True:
        for _ in range(granule):
            owner = (t // prof.interleave) % prof.dcp
            if prof.indexer == "replicated":
                used = [u + idx for u in used]
                used[owner] += main
            else:
                used[owner] += main + idx
            t += 1
        if max(used) > prof.kv_bytes:
            return best
        best = t


@pytest.mark.parametrize("tp,dcp,interleave,block,fmt,indexer,kv", [
    (4, 4, 1, 64, "nvfp4_368", "replicated", 5_000_000),
    (4, 4, 1, 64, "432", "sharded", 5_000_000),
    (4, 4, 3, 5, "656", "replicated", 3_000_000),
    (8, 8, 2, 16, "nvfp4_368", "sharded", 4_000_000),
    (4, 2, 64, 1, "432", "replicated", 2_000_000),
    (1, 1, 1, 1, "nvfp4_368", "replicated", 1_000_000),
    (2, 1, 1, 64, "656", "sharded", 1_000_000),
    (4, 4, 1, 64, "nvfp4_368", "replicated", 1000),  # not even one block fits
])
def test_kv_tokens_against_brute_force(tp, dcp, interleave, block, fmt, indexer, kv):
    prof = profile(tp=tp, dcp=dcp, interleave=interleave, block_size=block, record_format=fmt,
                   indexer=indexer, kv_bytes=kv)
    p = capacity_plan(prof)
    assert p.kv_tokens == brute_kv_tokens(prof)
    assert p.bytes_used <= kv


@pytest.mark.parametrize("tp,dcp,interleave,block,fmt,indexer,kv,freed", [
    (4, 4, 1, 64, "nvfp4_368", "replicated", 5_000_000, 1_000_000),
    (4, 4, 3, 5, "656", "replicated", 3_000_000, 777_777),
    (4, 2, 64, 1, "432", "sharded", 2_000_000, 12_345),
    (1, 1, 1, 1, "nvfp4_368", "replicated", 1000, 10_000_000),  # from no whole block to many
    (4, 4, 1, 64, "nvfp4_368", "replicated", 5_000_000, 0),
])
def test_freed_tokens_is_the_brute_force_gain(tp, dcp, interleave, block, fmt, indexer, kv, freed):
    """A buffer's price in context (the plan's "tokens of context" column): the tokens dealt one by
    one that fit once its bytes are given back, less those that fit beside it."""
    prof = profile(tp=tp, dcp=dcp, interleave=interleave, block_size=block, record_format=fmt,
                   indexer=indexer, kv_bytes=kv)
    want = brute_kv_tokens(replace(prof, kv_bytes=kv + freed)) - brute_kv_tokens(prof)
    assert freed_tokens(capacity_plan(prof), freed) == want


def test_plan_prices_every_reservation_in_tokens(capsys):
    """glm52-tp4-dcp4-mtp3-368: the buffers other than the replica store cost the context between the
    plain budget's tokens and the tokens beside the buffers; each row is about its bytes / 10,172 B."""
    assert cli_main(["plan", "--profile", "glm52-tp4-dcp4-mtp3-368", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    held, tokens = d["reservations"], d["reservation_tokens"]
    assert set(tokens) == set(held)
    plain = capacity_plan(profile(kv_bytes=d["kv_budget_bytes"]))
    buffers = sum(b for k, b in held.items() if k != "replica_store")
    assert freed_tokens(capacity_plan(profile(kv_bytes=d["kv_budget_bytes"] - buffers)), buffers) == (
        plain.kv_tokens - d["capacity"]["kv_tokens"])
    granule = 64 * 4
    for name, b in held.items():  # whole blocks of 256 tokens at ~10,172 B per token per rank
        assert tokens[name] % granule == 0 and abs(tokens[name] - b / plain.bytes_per_token) <= granule, name


def test_replication_costs_capacity():
    rep = capacity_plan(profile(record_format="432"))
    sh = capacity_plan(profile(record_format="432", indexer="sharded"))
    assert rep.kv_tokens < sh.kv_tokens
    # ratio of per-token bytes, up to block rounding
    want = (8532 + 726) / (8532 + 2904)
    assert abs(rep.kv_tokens / sh.kv_tokens - want) < 1e-3


@pytest.mark.parametrize("kw,msg", [
    (dict(dcp=3), "must divide tp"),
    (dict(record_format="indexer_fp8"), "not a main record format"),
    (dict(record_format="nvfp4_999"), "unknown record format"),
    (dict(indexer="partial"), "indexer must be"),
    (dict(mtp=-1), "mtp"),
    (dict(kv_bytes=-5), "kv_bytes"),
    (dict(block_size=0), "block_size"),
    (dict(tp=2.5), "tp"),
])
def test_profile_rejects(kw, msg):
    with pytest.raises(ValueError, match=msg):
        profile(**kw)


def test_geometry_rejects_wrong_pattern():
    with pytest.raises(ValueError, match="77 characters"):
        ModelGeometry("bad", 78, 1, 64, 512, 64, 32, 128, 2048, "F" * 77)


def test_cli_prints_spec_figures(capsys):
    assert cli_main(["plan", "--tp", "4", "--dcp", "4", "--mtp", "3", "--format", "nvfp4_368",
                     "--indexer", "replicated", "--kv-gb", "10"]) == 0
    out = capsys.readouterr().out
    want = capacity_plan(profile())
    for s in ("7,268", "2,904", "10,172", f"{want.kv_tokens:,}"):
        assert s in out
    cli_main(["plan", "--format", "656", "--indexer", "sharded", "--kv-bytes", "1234567890"])
    out = capsys.readouterr().out
    assert "12,956" in out and "726" in out


def test_cli_bad_profile_exits_with_reason(capsys):
    with pytest.raises(SystemExit, match="must divide tp"):
        cli_main(["plan", "--tp", "4", "--dcp", "3"])


def test_add_section_hook(monkeypatch, capsys):
    monkeypatch.setattr(plan_cli, "_SECTIONS", [])

    def extra(args, plan):
        return plan_cli.Section("predicted", ("path", "bytes"), [("stock", f"{args.ctx * 2}")])

    plan_cli.add_section(extra, lambda p: p.add_argument("--ctx", type=int, default=21))
    assert cli_main(["plan", "--ctx", "50"]) == 0
    out = capsys.readouterr().out
    assert "predicted" in out and "100" in out and "KV capacity" in out


def test_plan_does_not_import_torch():
    code = ("import argparse, sys; from sparkinfer.cli import plan; p = argparse.ArgumentParser(); "
            "plan.add_arguments(p); plan.run(p.parse_args([])); "
            "assert 'torch' not in sys.modules, 'plan imported torch'")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


@pytest.mark.parametrize("batch,share,fmt,mtp", [(1, 0.25, "nvfp4_368", 3), (8, 0.25, "nvfp4_368", 3),
                                                  (3, 0.5, "656", 0), (2, 0.0, "432", 3), (1, 1.0, "nvfp4_368", 1)])
def test_replica_capacity(batch, share, fmt, mtp):
    """Window from the budget (largest ring that fits), local context checked step by step against
    the replica rule itself, the store inside the KV budget (less context than DCP without it)."""
    from sparkinfer.core.capacity import rank_bytes, replica_capacity
    from sparkinfer.core.replicas import ReplicaWindow
    from sparkinfer.core.topology import DcpLayout
    prof = profile(record_format=fmt, mtp=mtp, kv_bytes=64 << 20)  # small enough to simulate
    budget = int(share * prof.kv_bytes)
    r = replica_capacity(prof, batch, budget)
    # the engine's store: every target layer, not the MTP layer (sparkinfer/vllm/replica_budget.py)
    per_pos = batch * GLM52.num_layers * {"nvfp4_368": 368, "656": 656, "432": 432}[fmt]
    assert r.window * per_pos <= budget < (r.window + 1) * per_pos and r.store_bytes == r.window * per_pos
    rows = 1 + mtp
    # the rule: a request prefilled to c, then one decode step of `rows`, holds everything iff c <= local
    for c in {max(0, r.local_context - 1), r.local_context, r.local_context + 1}:
        ring = ReplicaWindow(r.window, batch)
        keys = list(range(batch))
        ring.begin_step(keys, [0] * batch, [c] * batch)
        step = ring.begin_step(keys, [c] * batch, [rows] * batch)
        if c <= r.local_context or r.local_context < r.replica_max_context:  # else capped by capacity
            assert step.all_local == (c <= r.local_context), (c, r)
    # capacities: per request, whole blocks; the store counted inside the budget
    def per_request(p):
        g = p.block_size * p.dcp
        return capacity_plan(p).kv_tokens // batch // g * g
    assert r.dcp_max_context == per_request(prof)
    assert r.dcp1_max_context == per_request(replace(prof, dcp=1))
    assert r.replica_max_context == per_request(replace(prof, kv_bytes=prof.kv_bytes - r.store_bytes))
    assert r.replica_max_context <= r.dcp_max_context and r.local_context <= r.replica_max_context
    plan = capacity_plan(prof)
    lay = DcpLayout(prof.dcp, prof.interleave)
    used = rank_bytes(lay, r.replica_max_context * batch, plan.main_bytes_per_local_token,
                      plan.indexer_bytes_per_token) + r.store_bytes
    assert used <= prof.kv_bytes
    if share == 0.0:
        assert (r.window, r.local_context, r.store_bytes) == (0, 0, 0) and r.replica_max_context == r.dcp_max_context


def test_replica_capacity_rejects():
    from sparkinfer.core.capacity import replica_capacity
    with pytest.raises(ValueError, match="batch"):
        replica_capacity(profile(), 0, 0)
    with pytest.raises(ValueError, match="store_budget"):
        replica_capacity(profile(), 1, 11 * GIB)


def test_plan_prints_replica_table(capsys):
    """``sparkinfer plan`` shows, per batch, the context up to which every record is local next to
    DCP1's and DCP4's max context and the store's bytes per rank (replica_capacity's numbers)."""
    from sparkinfer.core.capacity import replica_capacity
    assert cli_main(["plan", "--kv-gb", "10", "--concurrency", "2", "--replica-share", "0.25"]) == 0
    out = capsys.readouterr().out
    assert "Replica records" in out
    for batch in (1, 2, 8):
        r = replica_capacity(profile(), batch, int(0.25 * 10 * GIB))
        for v in (r.local_context, r.dcp1_max_context, r.dcp_max_context, r.replica_max_context):
            assert f"{v:,}" in out
    assert cli_main(["plan", "--replica-share", "0"]) == 0 and "Replica records" not in capsys.readouterr().out
    assert cli_main(["plan", "--dcp", "1"]) == 0 and "Replica records" not in capsys.readouterr().out
    with pytest.raises(SystemExit, match="replica-share"):
        cli_main(["plan", "--replica-share", "1.5"])
