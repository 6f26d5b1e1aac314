"""Kernel terms fitted to the GPU run's JSON, scaled to the RTX PRO 6000, and the plan table they feed."""

import argparse
import json
import re

import pytest

from sparkinfer.core import costmodel as cm
from sparkinfer.core import kernel_fit as kf

RUN1 = f"{kf.RESULTS_DIR}/2026-12-04-nvidia-h200-run1.json"


@pytest.fixture(scope="module")
def run1():
    with open(RUN1) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def measured():
    return kf.measured_profile(cm.load_profile("rtx_pro_6000_x4"))


def test_points_are_the_json_rows(run1, measured):
    """Every decode-shape time of the run is a point of its term, read straight from the JSON."""
    rows = run1["kernel_timing"]["rows"]
    attn = {r["measured_us"] for r in rows if r["kernel"] == "sparse_mla_decode[nvfp4_368]"
            and r["shape"].endswith("16 heads/rank, top-2048")}
    timed = run1["attention"][[i for i, line in enumerate(run1["attention"]) if "H=16 K=2048" in line][-1]:]
    attn |= {float(line.split()[3]) for line in timed if line.startswith("nvfp4_ds_mla:fp8-rope-368")}
    score = {r["measured_us"] for r in rows if r["kernel"] == "indexer_scores" and "prefill" not in r["shape"]}
    table = [line.split() for line in run1["indexer"][2:]]
    score |= {float(f[2]) for f in table}
    topk = {float(f[3]) for f in table}
    got = {t: {p.us for p in f.points} for t, f in measured.fits.items()}
    assert got == {"attention": attn, "scoring": score, "topk": topk}
    assert len(attn) == 6 and len(score) == 8 and len(topk) == 6
    assert all(f.timing == "eager" for f in measured.fits.values())  # run 1 has no graph_us


def test_the_report_params_give_the_points_the_shape_text_gives(run1):
    """Runs after issue 33 record each row's ``params`` (the kernel report's): the same points as
    run 1's shape text, and a shape text the fit cannot read no longer matters."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("kernel_report", f"{kf.RESULTS_DIR}/../../kernel_report.py")
    kr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kr)
    params = {(r["kernel"], r["shape"]): r["params"] for r in kr.roofline()}
    rows = run1["kernel_timing"]["rows"]
    # kernels the report no longer has (run 1's separate compaction, fused into the decode since)
    # are no points of the fit: the rows with params must give every point
    with_params = [{**r, "params": params[(r["kernel"], r["shape"])], "shape": "decode" * r["shape"].startswith(
        "decode")} for r in rows if (r["kernel"], r["shape"]) in params]
    def key(pts):  # a batched decode step's params are M rows over T = the requests' contexts end to end
        return [(p.term, p.units, p.us) for p in pts]

    assert key(kf._kernel_points(with_params, "x")) == key(kf._kernel_points(rows, "x"))
    assert len(kf._kernel_points(rows, "x")) == 4


def test_fit_reproduces_its_points_within_the_stated_tolerance(measured):
    for term, fit in measured.fits.items():
        for p, r in zip(fit.points, fit.residuals_pct()):
            assert abs(r) <= kf.TOLERANCE_PCT[term], (term, p, r)
        assert fit.fixed_us > 0 and fit.per_unit_us > 0


def test_fit_is_the_least_squares_optimum_of_relative_residuals(measured):
    for fit in measured.fits.values():
        def cost(a, b):
            return sum(((a + b * p.units) / p.us - 1) ** 2 for p in fit.points)

        best = cost(fit.fixed_us, fit.per_unit_us)
        for da, db in ((1.01, 1), (0.99, 1), (1, 1.01), (1, 0.99)):
            assert cost(fit.fixed_us * da, fit.per_unit_us * db) > best


def test_json_device_matches_the_gpu_facts(run1):
    assert kf.gpu_of(run1["device"]) == "h200"
    assert int(re.search(r"(\d+) SMs", run1["device"])[1]) == kf.GPUS["h200"].sms


def test_scaling_direction_and_ratio(measured):
    h, r = kf.GPUS["h200"], kf.GPUS["rtx_pro_6000"]
    bw, issue = h.hbm_GBps / r.hbm_GBps, h.issue / r.issue
    assert bw > 1 > issue  # the RTX reads memory slower and issues faster
    for term, fit in measured.fits.items():
        fixed, slope = kf.scale_term(fit, h, r)
        assert fixed == pytest.approx(fit.fixed_us * issue)
        assert slope == pytest.approx(fit.per_unit_us * (bw if kf.SLOPE_SCALING[term] == "bandwidth" else issue))
        assert kf.scale_term(fit, h, h) == (pytest.approx(fit.fixed_us), pytest.approx(fit.per_unit_us))
    p, fits = measured.profile, measured.fits
    assert p.attn_us_per_ktok == pytest.approx(fits["attention"].per_unit_us * bw)  # a pure byte term
    assert p.attn_call_us == pytest.approx(fits["attention"].fixed_us * issue)
    assert p.index_call_us == pytest.approx((fits["scoring"].fixed_us + fits["topk"].fixed_us) * issue)
    assert p.index_ns_per_token == pytest.approx(
        (fits["scoring"].per_unit_us * issue + fits["topk"].per_unit_us * bw) * 1e3)
    floor = cm.load_profile("rtx_pro_6000_x4")
    untouched = [f for f in cm.NodeProfile.__dataclass_fields__
                 if f not in ("name", "source", "attn_call_us", "attn_us_per_ktok", "index_call_us",
                              "index_ns_per_token")]
    assert all(getattr(p, f) == getattr(floor, f) for f in untouched)


def _kernel_run(tmp_path, device, graph):
    """A run of two attention and two scoring shapes, ``graph``: with graph_us beside measured_us."""
    rows = []
    for kernel, shape, us in (("sparse_mla_decode[nvfp4_368]", "batch 1: 4 rows, 16 heads/rank, top-2048", 100.0),
                              ("sparse_mla_decode[nvfp4_368]", "selected: 16 req x 4 rows, 16 heads/rank, top-2048",
                               160.0),
                              ("indexer_scores", "decode: one request, 4 rows, 128K context", 50.0),
                              ("indexer_scores", "decode step: 16 req x 4 rows at 64K each (one batched launch)",
                               250.0)):
        rows.append({"kernel": kernel, "shape": shape, "measured_us": us + 90.0, **({"graph_us": us} if graph else {})})
    doc = {"device": device, "kernel_timing": {"rows": rows, "smoke": False}, "attention": None,
           "indexer": ["T M score us topk us total us key ids", "    8192    4  50.0  20.0  70.0  1.0  0",
                       "  65536   32  80.0  60.0  140.0  1.0  0"]}
    (tmp_path / "run.json").write_text(json.dumps(doc))
    return str(tmp_path)


def test_graph_timing_wins_and_a_run_on_the_target_is_not_scaled(tmp_path):
    floor = cm.load_profile("rtx_pro_6000_x4")
    m = kf.measured_profile(floor, _kernel_run(tmp_path, "NVIDIA RTX PRO 6000 Blackwell Server Edition", True))
    assert m.source_gpu == m.target_gpu == "rtx_pro_6000"
    att = m.fits["attention"]
    assert att.timing == "graph" and {p.us for p in att.points} == {100.0, 160.0}  # eager points dropped
    # two points: the line through them, unscaled
    assert att.per_unit_us == pytest.approx(60.0 / ((64 - 4) * 2))
    assert m.profile.attn_call_us == pytest.approx(100.0 - 4 * 2 * att.per_unit_us)
    assert m.fits["topk"].timing == "eager"  # the indexer table has no graph timing
    with pytest.raises(ValueError, match="no GPU facts"):
        kf.measured_profile(floor, _kernel_run(tmp_path, "NVIDIA A100", False))


def _plan_sections(argv):
    from sparkinfer.cli import plan as plan_cli

    ap = argparse.ArgumentParser()
    plan_cli.add_arguments(ap)
    return {s.title.split(" on ")[0]: s for s in plan_cli.sections(ap.parse_args(argv))}


def test_plan_prints_dcp4_and_dcp1_at_three_contexts_and_two_batches(measured, capsys):
    from sparkinfer.core.policy_table import decode_rows

    s = _plan_sections(["--hw", "rtx_pro_6000_x4", "--kernels", "measured"])["Predicted decode"]
    col = {c: i for i, c in enumerate(s.columns)}
    got = {(r[col["kernels"]], r[col["batch"]], r[col["context"]], r[col["parallel"]]): r for r in s.rows}
    want = {(k, b, c, p) for k in ("floor", "measured") for b in ("1", "8") for c in ("0", "65,536", "262,144")
            for p in ("TP4/DCP4", "TP4/DCP1")}
    assert set(got) == want and len(s.rows) == len(want)
    floor = cm.load_profile("rtx_pro_6000_x4")
    rows = decode_rows({"floor": floor, "measured": measured.profile})
    for r in rows:  # the printed numbers are these rows'
        printed = got[(r["kernels"], str(r["batch"]), f"{r['context']:,}", f"TP{r['tp']}/DCP{r['dcp']}")]
        assert (printed[col["step ms"]], printed[col["tok/s / request"]], printed[col["tok/s total"]]) == \
            (f"{r['step_us'] / 1e3:.2f}", f"{r['tok_s_request']:.1f}", f"{r['tok_s_total']:.1f}")
    tokens = 1 + 0.6 + 0.6 ** 2 + 0.6 ** 3  # MTP3, acceptance 0.6 per draft, chain
    by = {(r["kernels"], r["batch"], r["context"], r["dcp"]): r for r in rows}
    p = measured.profile
    for (kern, b, ctx, dcp), r in by.items():
        assert r["tok_s_request"] == pytest.approx(tokens / r["step_us"] * 1e6)
        assert r["tok_s_total"] == pytest.approx(b * r["tok_s_request"])
        if kern == "floor":
            continue
        # what the measured kernels add to a step: the fitted terms over 79 layers (22 of them Full)
        # at 4 rows per request, the same on both parallel layouts
        n, k = 4 * b, min(ctx + 4, 2048)
        added = (79 * (p.attn_call_us + (p.attn_us_per_ktok - floor.attn_us_per_ktok) * n * k / 1024)
                 + 22 * (p.index_call_us + (p.index_ns_per_token - floor.index_ns_per_token) * n * ctx * 1e-3))
        other = by[("floor", b, ctx, dcp)]
        # the policy compares only what differs between the paths: its choice ignores the kernel terms
        assert r["path"] == other["path"]
        assert r["step_us"] - other["step_us"] == pytest.approx(added)
    # floor only without --kernels measured; printed by the CLI
    floor_only = _plan_sections(["--hw", "rtx_pro_6000_x4"])["Predicted decode"]
    assert {r[0] for r in floor_only.rows} == {"floor"} and len(floor_only.rows) == 12
    from sparkinfer.cli import main as cli_main

    assert cli_main(["plan", "--hw", "rtx_pro_6000_x4", "--kernels", "measured"]) == 0
    out = capsys.readouterr().out
    assert "Predicted decode on rtx_pro_6000_x4" in out and "rtx_pro_6000_x4+measured" in out
