"""Per-step policy: never picks the path the cost model rates slower, deterministic across
processes, mode switch, workspace fallback."""

import itertools
import json
import subprocess
import sys
from dataclasses import replace

import pytest

from sparkinfer.core import costmodel as cm
from sparkinfer.core.policy import Decision, StepPolicy, resolve_mode


def _profiles():
    rtx = cm.load_profile("rtx_pro_6000_x4")
    h200 = cm.load_profile("h200_x4")
    # an exchange between the fitted one and a lean one makes both choices occur on the grid
    lean = replace(rtx, name="lean", exchange_us=100.0, copy_us=1.0)
    return [rtx, h200, lean]


@pytest.mark.parametrize("profile", _profiles(), ids=lambda p: p.name)
@pytest.mark.parametrize("fmt", ["nvfp4_368", "fp8_ds_mla"])
@pytest.mark.parametrize("qrep", [False, True], ids=["ag_rs", "qrep_a2a"])
def test_never_picks_the_slower_path(profile, fmt, qrep):
    """Grid of steps: the policy's choice is never rated slower by the full cost model
    (``costmodel.predict``, which also prices the indexer and attention both paths share), for
    stock DCP as vLLM's default (ag_rs, gathered queries) and as its GLM-MoE-DSA default
    (replicated queries, a2a)."""
    picks = set()
    stock_shape = {"backend": "a2a" if qrep else "ag_rs", "q_replicated": qrep}
    for batch, rows, ctx, nf in itertools.product((1, 2, 8), (1, 4), (0, 100, 2048, 8192, 65536, 262144),
                                                 (1.0, 0.5, 0.3, 0.1, 0.0)):
        ur = 1.75 if rows == 4 else 1.0
        step = cm.StepSpec(batch=batch, rows=rows, context=ctx, union_ratio=ur, new_fraction=nf,
                           record_format=fmt, **stock_shape)
        pol = StepPolicy(profile, record_format=fmt, max_depth=3, env={}, **stock_shape)
        u = cm.selected_tokens(step)
        d = pol.decide([rows] * batch, [ctx] * batch, [u] * batch, [nf] * batch)
        stock = cm.predict(step, profile, "stock", 0).total_us
        best_sel = min(cm.predict(step, profile, "selected", k).total_us for k in range(4))
        chosen = stock if d.path == "stock" else cm.predict(step, profile, "selected", d.depth).total_us
        assert chosen <= min(stock, best_sel) * (1 + 1e-9), (batch, rows, ctx, nf, d)
        picks.add(d.path)
    if profile.name == "lean":
        assert picks == {"stock", "selected"}  # the grid exercises both outcomes


@pytest.mark.parametrize("profile", _profiles(), ids=lambda p: p.name)
def test_replicated_queries_make_stock_win_more_often(profile):
    """Stock with replicated queries moves fewer bytes, so wherever the policy picks stock against
    ag_rs it picks stock against qrep + a2a too, and on the lean profile some steps flip."""
    flips = 0
    for batch, rows, ctx, nf in itertools.product((1, 2, 8), (1, 4), (2048, 65536), (1.0, 0.3, 0.0)):
        ur = 1.75 if rows == 4 else 1.0
        u = cm.selected_tokens(cm.StepSpec(batch=batch, rows=rows, context=ctx, union_ratio=ur))
        args = ([rows] * batch, [ctx] * batch, [u] * batch, [nf] * batch)
        ag = StepPolicy(profile, env={}).decide(*args)
        qrep = StepPolicy(profile, env={}, backend="a2a", q_replicated=True).decide(*args)
        assert qrep.stock_us < ag.stock_us
        assert ag.path == "selected" or qrep.path == "stock"
        flips += ag.path != qrep.path
    if profile.name == "lean":
        assert flips > 0


@pytest.mark.parametrize("profile", _profiles(), ids=lambda p: p.name)
def test_amortised_plan_never_rated_slower(profile):
    """auto with a horizon: the chosen plan (stock for H steps, or selected now at the current new
    fraction then H - 1 steps at the steady one) is never rated slower by ``costmodel.predict`` than
    the other plan; a cold pool (new fraction 1) can go selected when the warm steps pay for it."""
    pol = StepPolicy(profile, max_depth=3, env={})
    picks, cold_selected = set(), False
    for batch, rows, ctx, ss, h in itertools.product((1, 8), (1, 4), (0, 2048, 65536, 262144),
                                                    (0.0, 0.3, 1.0), (1, 2, 8, 64)):
        ur = 1.75 if rows == 4 else 1.0
        spec = lambda nf: cm.StepSpec(batch=batch, rows=rows, context=ctx, union_ratio=ur, new_fraction=nf)
        u = cm.selected_tokens(spec(1.0))
        d = pol.decide([rows] * batch, [ctx] * batch, [u] * batch, [1.0] * batch, horizon=h,
                       steady_fraction=[ss] * batch)
        stock = h * cm.predict(spec(1.0), profile, "stock", 0).total_us
        sel_now = [cm.predict(spec(1.0), profile, "selected", k).total_us for k in range(4)]
        sel_ss = min(cm.predict(spec(ss), profile, "selected", k).total_us for k in range(4))
        best_sel = min(sel_now) + (h - 1) * sel_ss
        chosen = stock if d.path == "stock" else sel_now[d.depth] + (h - 1) * sel_ss
        assert chosen <= min(stock, best_sel) * (1 + 1e-9), (batch, rows, ctx, ss, h, d)
        assert (d.path == "selected") == (d.plan_selected_us < d.plan_stock_us)
        picks.add(d.path)
        cold_selected |= d.path == "selected" and sel_now[d.depth] > stock / h
    if profile.name != "h200_x4":  # the H200 model rates selected faster everywhere on this grid
        assert picks == {"stock", "selected"}
    if profile.name == "rtx_pro_6000_x4":
        assert cold_selected  # a warm-up step rated slower than stock, paid for by the steps after it


def test_horizon_one_is_the_per_step_rule_and_prior_and_modes():
    p = replace(cm.load_profile("rtx_pro_6000_x4"), exchange_us=100.0, copy_us=1.0)
    pol = StepPolicy(p, env={})
    for ctx in (0, 4096, 65536):
        a = pol.decide([4, 4], [ctx] * 2, None, [1.0, 1.0])
        b = pol.decide([4, 4], [ctx] * 2, None, [1.0, 1.0], horizon=1, steady_fraction=[0.0, 0.0])
        assert a[:5] == b[:5]
    # the configured prior stands in for an observed steady fraction
    prior = StepPolicy(p, env={}, prior_new_fraction=0.2)
    assert prior.decide([4], [65536], None, [1.0], horizon=16) == pol.decide(
        [4], [65536], None, [1.0], horizon=16, steady_fraction=[0.2])
    # forced modes ignore the horizon
    for mode in ("stock", "selected"):
        d = StepPolicy(p, mode=mode, env={}).decide([4], [65536], None, [1.0], horizon=64, steady_fraction=[0.0])
        assert d.path == mode and d.reason == f"mode={mode}"
    with pytest.raises(ValueError, match="horizon"):
        pol.decide([4], [10], horizon=0)
    with pytest.raises(ValueError, match="steady_fraction"):
        pol.decide([4], [10], horizon=4, steady_fraction=[1.5])
    with pytest.raises(ValueError, match="prior_new_fraction"):
        StepPolicy(p, env={}, prior_new_fraction=-0.1)


def test_default_union_and_shallowest_tie():
    p = replace(cm.load_profile("rtx_pro_6000_x4"), exchange_us=4.0, copy_us=0.5)
    pol = StepPolicy(p, max_depth=5, env={})
    assert pol.decide([4], [65536]) == pol.decide([4], [65536], [2048], [1.0])  # default min(ctx+rows, k)
    # GLM-5.2 groups have 3 Shared layers: depths 3, 4, 5 carry F and them in one exchange alike,
    # depths 1 and 2 in two (FS + SS, FSS + S: the same exposed time), and the shallowest wins ties
    d = pol.decide([1], [65536])
    _, sel = pol.costs(1, 2048.0, False)
    assert d.path == "selected" and d.depth == 3
    assert sel[3] == sel[4] == sel[5] < sel[2] == sel[1] < sel[0]


def test_mode_sources():
    p = cm.load_profile("rtx_pro_6000_x4")
    assert resolve_mode(p, env={}) == "auto"
    assert resolve_mode(replace(p, mode="selected"), env={}) == "selected"
    assert resolve_mode(p, env={"VLLM_SPARKINFER_MODE": "stock"}) == "stock"
    assert resolve_mode(p, env={"VLLM_SPARKINFER_MODE": "stock"}, override="selected") == "selected"
    with pytest.raises(ValueError, match="VLLM_SPARKINFER_MODE"):
        resolve_mode(p, env={"VLLM_SPARKINFER_MODE": "fastest"})
    forced = StepPolicy(p, env={"VLLM_SPARKINFER_MODE": "selected"})
    assert forced.decide([1], [65536]).path == "selected"
    assert StepPolicy(p, mode="stock", env={}).decide([4], [65536], [100], [0.0]).path == "stock"


def test_workspace_fallback():
    p = replace(cm.load_profile("rtx_pro_6000_x4"), exchange_us=1.0, copy_us=0.1)
    big = StepPolicy(p, mode="selected", env={}).decide([4] * 8, [65536] * 8)
    assert big.path == "selected"
    small = StepPolicy(p, mode="selected", workspace_bytes=1 << 20, env={}).decide([4] * 8, [65536] * 8)
    assert small.path == "stock" and small.reason == "workspace too small"
    # a workspace for two ring slots only: depth limited to 1
    need = 8 * 2052 * 368
    d = StepPolicy(p, mode="selected", workspace_bytes=2 * need, env={}).decide([4] * 8, [65536] * 8)
    assert d.path == "selected" and d.depth <= 1


def test_bad_inputs():
    p = cm.load_profile("rtx_pro_6000_x4")
    with pytest.raises(ValueError, match="one entry per request"):
        StepPolicy(p, env={}).decide([1, 1], [10])
    with pytest.raises(ValueError, match="dcp=2"):
        StepPolicy(p, dcp=2, env={})
    with pytest.raises(ValueError, match="max_depth"):
        StepPolicy(p, max_depth=-1, env={})


_SCRIPT = r"""
import json, random
from dataclasses import replace
from sparkinfer.core import costmodel as cm
from sparkinfer.core.policy import StepPolicy
p = replace(cm.load_profile("rtx_pro_6000_x4"), exchange_us=100.0, copy_us=1.0)
pol = StepPolicy(p, env={})
rng = random.Random(3)
out = []
for _ in range(300):
    b = rng.randint(1, 8)
    rows = [rng.choice([1, 4]) for _ in range(b)]
    ctx = [rng.randint(0, 300000) for _ in range(b)]
    nf = [rng.random() for _ in range(b)]
    out.append(list(pol.decide(rows, ctx, None, nf)))
    ss = [rng.random() for _ in range(b)]
    out.append(list(pol.decide(rows, ctx, None, [1.0] * b, horizon=rng.randint(1, 200), steady_fraction=ss)))
print(json.dumps(out))
"""


def test_identical_across_processes():
    """Same inputs -> the same decision (path, depth and the float costs, bit for bit) in
    independent interpreters, as on every rank."""
    outs = []
    for seed in ("0", "12345"):
        r = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)})
        outs.append(r.stdout)
    assert outs[0] == outs[1]
    paths = {d[0] for d in json.loads(outs[0])}
    assert paths == {"stock", "selected"}


def test_policy_table_matches_model_and_policy():
    from sparkinfer.core.policy_table import PATHS, policy_rows
    p = cm.load_profile("rtx_pro_6000_x4")
    rows = policy_rows(p, batch=2, mtp=3, contexts=(0, 65536), env={})
    assert [r["path"] for r in rows] == list(PATHS) * 2
    for r in rows:
        spec = cm.StepSpec(batch=2, rows=4, context=r["context"], union_ratio=1.75,
                           new_fraction=0.3 if r["path"] == "selected+reuse" else 1.0)
        path = "stock" if r["path"] == "stock" else "selected"
        assert r["path_us"] == pytest.approx(cm.predict(spec, p, path, r["depth"]).total_us)
    # reuse never moves more than plain selected records
    for ctx in (0, 65536):
        by = {r["path"]: r for r in rows if r["context"] == ctx}
        assert by["selected+reuse"]["rx_MB"] <= by["selected"]["rx_MB"]


def test_plan_section_renders():
    import argparse
    from sparkinfer.cli import plan
    from sparkinfer.cli.plan import add_policy_arguments, policy_section
    ap = argparse.ArgumentParser()
    plan.add_arguments(ap)
    if not any("--hw" in a.option_strings for a in ap._actions):  # not wired into plan (yet)
        add_policy_arguments(ap)
    args = ap.parse_args(["--hw", "h200_x4", "--batch", "2"])
    sec = policy_section(args, None)
    assert sec is not None and len(sec.rows) == 6 * 3 and "h200_x4" in sec.title
    assert policy_section(ap.parse_args([]), None) is None


def _reference_decide(pol, rows, contexts, union=None, new_fraction=None, horizon=1, steady_fraction=None):
    """The straightforward decision through ``pol.costs`` (``costmodel.exposed_us`` and
    ``layer_compute_us``): the reference ``StepPolicy.decide``'s inlined arithmetic must match."""
    b = len(rows)
    if union is None:
        union = [min(c + r, pol.geom.topk) for c, r in zip(contexts, rows)]
    records = sum(union)
    moved = records if new_fraction is None else sum(u * f for u, f in zip(union, new_fraction))
    total_rows = sum(rows)
    if total_rows == 0:
        return Decision("stock", 0, 0.0, 0.0, "empty step")
    mtp = total_rows > b
    stock, sel = pol.costs(total_rows, moved, mtp)
    if pol.mode == "stock":
        return Decision("stock", 0, stock, min(sel), "mode=stock", stock, min(sel))
    depths = list(range(len(sel)))
    if pol.workspace_bytes is not None:
        depths = [d for d in depths if records * pol.record_bytes * (d + 1) <= pol.workspace_bytes]
        if not depths:
            return Decision("stock", 0, stock, min(sel), "workspace too small", stock, min(sel))
    depth = min(depths, key=sel.__getitem__)
    if pol.mode == "selected":
        return Decision("selected", depth, stock, sel[depth], "mode=selected", stock, sel[depth])
    if steady_fraction is None and pol.prior_new_fraction is not None:
        steady_fraction = [pol.prior_new_fraction] * b
    if horizon == 1 or steady_fraction is None:
        if sel[depth] < stock:
            return Decision("selected", depth, stock, sel[depth], "model: selected faster", stock, sel[depth])
        return Decision("stock", 0, stock, sel[depth], "model: stock faster or equal", stock, sel[depth])
    steady = pol.costs(total_rows, sum(u * f for u, f in zip(union, steady_fraction)), mtp)[1]
    plan_stock = horizon * stock
    plan_sel = sel[depth] + (horizon - 1) * min(steady[d] for d in depths)
    why = f"over {horizon} steps at steady reuse"
    if plan_sel < plan_stock:
        return Decision("selected", depth, stock, sel[depth], f"model: selected faster {why}", plan_stock, plan_sel,
                        horizon)
    return Decision("stock", 0, stock, sel[depth], f"model: stock faster or equal {why}", plan_stock, plan_sel,
                    horizon)


@pytest.mark.parametrize("profile", _profiles(), ids=lambda p: p.name)
def test_fast_decide_equals_reference(profile):
    """``decide`` (precomputed constants, inlined arithmetic) returns exactly the reference's
    Decision, float fields bit for bit, on a randomized grid: every mode, horizon, workspace limit,
    prior, with and without union / new / steady fractions, including empty and zero-union steps."""
    import random
    rng = random.Random(6)
    pols = [StepPolicy(profile, mode=mode, env={}, max_depth=md, workspace_bytes=ws, prior_new_fraction=prior,
                       record_format=fmt)
            for mode, md, ws, prior, fmt in itertools.product(
                ("auto", "stock", "selected"), (0, 3, 5), (None, 1 << 20, 4 << 20, 40 << 20), (None, 0.25),
                ("nvfp4_368", "fp8_ds_mla"))]
    kinds = set()
    for _ in range(3000):
        pol = rng.choice(pols)
        b = rng.randint(1, 8)
        rows = [rng.choice([0, 1, 1, 4]) for _ in range(b)]
        ctx = [rng.choice([0, 3, rng.randint(0, 4096), rng.randint(0, 300000)]) for _ in range(b)]
        if rng.random() < 0.3:  # every request at or past top-k
            ctx = [rng.choice([2048 - rows[i], rng.randint(2048, 300000)]) for i in range(b)]
        union = rng.choice([None, [float(rng.randint(0, 4096)) for _ in range(b)], [0] * b])
        nf = rng.choice([None, [rng.random() for _ in range(b)], [1.0] * b, [0.0] * b])
        h = rng.choice([1, 1, 2, 8, 64, rng.randint(1, 500)])
        ss = rng.choice([None, [rng.random() for _ in range(b)], [0.0] * b])
        args = (rows, ctx, union, nf)
        got = pol.decide(*args, horizon=h, steady_fraction=ss)
        assert got == _reference_decide(pol, *args, horizon=h, steady_fraction=ss), (pol.mode, args, h, ss)
        assert [type(v) for v in got] == [type(v) for v in _reference_decide(pol, *args, h, ss)]
        kinds.add((got.path, got.reason.split(" over ")[0], got.horizon > 1))
    for pol in pols[:3]:
        assert pol.decide([], []) == _reference_decide(pol, [], []) == Decision("stock", 0, 0.0, 0.0, "empty step")
    assert len(kinds) >= 7, kinds  # the rule's outcomes (incl. amortised ones) occur on the grid


@pytest.mark.parametrize("profile", _profiles(), ids=lambda p: p.name)
def test_fully_held_step_goes_selected_under_auto(profile):
    """Replicas hold the whole remote union: auto takes the selected path with no exchange (depth
    0) on every profile, batch, row count, context, stock shape, reuse state and horizon, and the
    full cost model rates it strictly cheaper than stock."""
    for batch, rows, ctx, qrep, nf, h in itertools.product((1, 8), (1, 4), (0, 2048, 65536, 1 << 20), (False, True),
                                                           (None, 1.0, 0.3), (1, 64)):
        shape = {"backend": "a2a" if qrep else "ag_rs", "q_replicated": qrep}
        pol = StepPolicy(profile, max_depth=3, env={}, prior_new_fraction=0.3, **shape)
        ur = 1.75 if rows == 4 else 1.0
        step = cm.StepSpec(batch=batch, rows=rows, context=ctx, union_ratio=ur, held_fraction=1.0, **shape)
        u = cm.selected_tokens(step)
        d = pol.decide([rows] * batch, [ctx] * batch, [u] * batch, None if nf is None else [nf] * batch, horizon=h,
                       held_fraction=[1.0] * batch)
        assert d.path == "selected" and d.depth == 0 and "local" in d.reason, (batch, rows, ctx, qrep, d)
        stock, sel = cm.predict(step, profile, "stock", 0), cm.predict(step, profile, "selected", 0)
        assert sel.total_us < stock.total_us and sel.comm_us == 0.0
        assert d.selected_us == pytest.approx(sel.write_us)
        assert d.stock_us == pytest.approx(stock.comm_us + stock.write_us)
    # mode=stock still forces stock; a held share below 1 prices an exchange again
    assert StepPolicy(profile, mode="stock", env={}).decide([4], [65536], held_fraction=[1.0]).path == "stock"
    part = StepPolicy(profile, env={}).decide([4], [65536], held_fraction=[0.999])
    assert part.selected_us > profile.exchange_us


@pytest.mark.parametrize("profile", _profiles(), ids=lambda p: p.name)
@pytest.mark.parametrize("qrep", [False, True], ids=["ag_rs", "qrep_a2a"])
def test_never_picks_the_slower_path_with_replicas(profile, qrep):
    """The never-rated-slower grid with replica shares: per step and amortised over a horizon, the
    choice is never rated slower by ``costmodel.predict`` (held_fraction set) than the other path."""
    stock_shape = {"backend": "a2a" if qrep else "ag_rs", "q_replicated": qrep}
    pol = StepPolicy(profile, max_depth=3, env={}, **stock_shape)
    picks = set()
    for batch, rows, ctx, held, nf, ss, h in itertools.product(
            (1, 8), (1, 4), (0, 8192, 65536, 262144), (0.0, 0.5, 0.9, 1.0), (1.0, 0.3, 0.0), (None, 0.0, 0.3),
            (1, 8)):
        ur = 1.75 if rows == 4 else 1.0
        spec = lambda f: cm.StepSpec(batch=batch, rows=rows, context=ctx, union_ratio=ur, new_fraction=f,
                                     held_fraction=held, **stock_shape)
        u = cm.selected_tokens(spec(1.0))
        d = pol.decide([rows] * batch, [ctx] * batch, [u] * batch, [nf] * batch, horizon=h,
                       steady_fraction=None if ss is None else [ss] * batch, held_fraction=[held] * batch)
        stock = cm.predict(spec(nf), profile, "stock", 0).total_us
        sel_now = [cm.predict(spec(nf), profile, "selected", k).total_us for k in range(4)]
        if h == 1 or ss is None or held == 1.0:
            best_sel, chosen_sel, plan_stock = min(sel_now), sel_now[d.depth], stock
        else:
            sel_ss = min(cm.predict(spec(ss), profile, "selected", k).total_us for k in range(4))
            best_sel, chosen_sel, plan_stock = min(sel_now) + (h - 1) * sel_ss, sel_now[d.depth] + (h - 1) * sel_ss, \
                h * stock
        chosen = plan_stock if d.path == "stock" else chosen_sel
        assert chosen <= min(plan_stock, best_sel) * (1 + 1e-9), (batch, rows, ctx, held, nf, ss, h, d)
        picks.add((d.path, held == 1.0))
    assert ("selected", True) in picks
    if profile.name != "h200_x4":  # the H200 model rates selected faster everywhere on this grid
        assert ("stock", False) in picks  # both outcomes occur


def _reference_replicas(pol, rows, contexts, union, new_fraction, horizon, steady_fraction, held):
    """``decide`` with a replica store through ``pol.costs`` (the straightforward evaluation)."""
    b = len(rows)
    total_rows = sum(rows)
    if total_rows == 0:
        return Decision("stock", 0, 0.0, 0.0, "empty step")
    if union is None:
        union = [min(c + r, pol.geom.topk) for c, r in zip(contexts, rows)]
    outside = [u * (1.0 - h) for u, h in zip(union, held)]
    local = sum(outside) == 0
    moved = sum(outside) if new_fraction is None else sum(o * f for o, f in zip(outside, new_fraction))
    mtp = total_rows > b
    stock, sel = pol.costs(total_rows, moved, mtp, all_local=local, replicas=True)
    if pol.mode == "stock":
        return Decision("stock", 0, stock, min(sel), "mode=stock", stock, min(sel))
    depths = list(range(len(sel)))
    if pol.workspace_bytes is not None:
        depths = [d for d in depths if sum(union) * pol.record_bytes * (d + 1) <= pol.workspace_bytes]
        if not depths:
            return Decision("stock", 0, stock, min(sel), "workspace too small", stock, min(sel))
    depth = min(depths, key=sel.__getitem__)
    if pol.mode == "selected":
        return Decision("selected", depth, stock, sel[depth], "mode=selected", stock, sel[depth])
    if local:
        return Decision("selected", depth, stock, sel[depth], "model: every record local (replicas), no exchange",
                        stock, sel[depth])
    if steady_fraction is None and horizon != 1 and pol.prior_new_fraction is not None:
        steady_fraction = [pol.prior_new_fraction] * b
    if horizon == 1 or steady_fraction is None:
        why = "model: selected faster" if sel[depth] < stock else "model: stock faster or equal"
        return Decision("selected" if sel[depth] < stock else "stock", depth if sel[depth] < stock else 0, stock,
                        sel[depth], why, stock, sel[depth])
    steady = pol.costs(total_rows, sum(o * f for o, f in zip(outside, steady_fraction)), mtp, replicas=True)[1]
    plan_stock, plan_sel = horizon * stock, sel[depth] + (horizon - 1) * min(steady[d] for d in depths)
    why = f"over {horizon} steps at steady reuse"
    if plan_sel < plan_stock:
        return Decision("selected", depth, stock, sel[depth], f"model: selected faster {why}", plan_stock, plan_sel,
                        horizon)
    return Decision("stock", 0, stock, sel[depth], f"model: stock faster or equal {why}", plan_stock, plan_sel, horizon)


@pytest.mark.parametrize("profile", _profiles(), ids=lambda p: p.name)
def test_replica_decide_equals_reference(profile):
    """``decide(held_fraction=...)`` (compiled exposed time) equals the ``costs`` reference bit for
    bit on a randomized grid, including all-local, partly held and empty steps."""
    import random
    rng = random.Random(11)
    pols = [StepPolicy(profile, mode=mode, env={}, max_depth=md, workspace_bytes=ws, prior_new_fraction=prior)
            for mode, md, ws, prior in itertools.product(("auto", "stock", "selected"), (0, 3), (None, 4 << 20),
                                                         (None, 0.25))]
    kinds = set()
    for _ in range(1500):
        pol = rng.choice(pols)
        b = rng.randint(1, 8)
        rows = [rng.choice([0, 1, 4]) for _ in range(b)]
        ctx = [rng.choice([0, rng.randint(0, 4096), rng.randint(0, 300000)]) for _ in range(b)]
        union = rng.choice([None, [float(rng.randint(0, 4096)) for _ in range(b)]])
        nf = rng.choice([None, [rng.random() for _ in range(b)], [0.0] * b])
        held = rng.choice([[1.0] * b, [rng.random() for _ in range(b)], [0.0] * b,
                           [rng.choice([1.0, 0.5]) for _ in range(b)]])
        h = rng.choice([1, 8, rng.randint(1, 200)])
        ss = rng.choice([None, [rng.random() for _ in range(b)]])
        got = pol.decide(rows, ctx, union, nf, horizon=h, steady_fraction=ss, held_fraction=held)
        assert got == _reference_replicas(pol, rows, ctx, union, nf, h, ss, held), (pol.mode, rows, ctx, held)
        kinds.add((got.path, got.reason.split(" over ")[0]))
    assert ("selected", "model: every record local (replicas), no exchange") in kinds and len(kinds) >= 6, kinds
    with pytest.raises(ValueError, match="held_fraction"):
        pols[0].decide([4], [100], held_fraction=[1.5])
    with pytest.raises(ValueError, match="one entry per request"):
        pols[0].decide([4, 4], [100, 100], held_fraction=[1.0])


def test_plan_scoring_section():
    """``sparkinfer plan --hw``: the context from which ``indexer_scoring = auto`` shards, per batch, as
    ``costmodel.sharded_scoring_from`` gives it; no table where the choice does not exist."""
    import argparse
    from sparkinfer.cli import plan
    ap = argparse.ArgumentParser()
    plan.add_arguments(ap)
    titled = {s.title: s for s in plan.sections(ap.parse_args(["--hw", "rtx_pro_6000_x4", "--concurrency", "16"]))}
    sec = next(s for t, s in titled.items() if t.startswith("indexer_scoring = auto"))
    p = cm.load_profile("rtx_pro_6000_x4")
    assert sec.rows == [(str(b), f"{cm.sharded_scoring_from(p, b, 4, 4):,}") for b in (1, 8, 16)]
    for argv in (["--hw", "rtx_pro_6000_x4", "--indexer", "sharded"], ["--hw", "rtx_pro_6000_x4", "--dcp", "1"], []):
        args = ap.parse_args(argv)
        assert plan.scoring_section(args, plan.capacity_plan(plan.profile_from_args(args))) is None, argv
