"""Cost model: profiles, link time, bytes consistent with the accounting, published residuals."""

import json
import math

import numpy as np
import pytest

from sparkinfer.core import accounting as acc
from sparkinfer.core import costmodel as cm
from sparkinfer.core.geometry import GLM52


@pytest.fixture(scope="module")
def rtx():
    return cm.load_profile("rtx_pro_6000_x4")


def test_shipped_profiles_load():
    for name in ("rtx_pro_6000_x4", "h200_x4"):
        p = cm.load_profile(name)
        assert p.world_size == 4 and p.mode == "auto" and p.source
    rtx = cm.load_profile("rtx_pro_6000_x4")
    # the measured facts of glm52-and-hardware.md
    assert (rtx.bw_dir_GBps, rtx.bw_bidir_GBps, rtx.link_latency_us, rtx.copy_us, rtx.hbm_GBps) == \
        (55.0, 107.0, 0.4, 2.0, 1790.0)


def test_find_profile_by_device_name_and_world():
    """auto inside vLLM models only the node the RTX profile was fitted to; the H200 profile is an
    estimate and matches no device."""
    rtx = cm.find_profile("NVIDIA RTX PRO 6000 Blackwell Server Edition", 4)
    assert rtx is not None and rtx.name == "rtx_pro_6000_x4"
    assert cm.find_profile("NVIDIA RTX PRO 6000 Blackwell Server Edition", 2) is None  # fitted for 4 GPUs
    assert cm.find_profile("NVIDIA H200", 4) is None
    assert cm.find_profile("cpu", 4) is None


def test_geometry_from_a_hugging_face_config():
    from dataclasses import replace
    from types import SimpleNamespace

    from sparkinfer.core.geometry import ModelGeometry

    hf = SimpleNamespace(model_type="glm_moe_dsa", num_hidden_layers=GLM52.num_layers, num_nextn_predict_layers=1,
                         num_attention_heads=64, kv_lora_rank=512, qk_rope_head_dim=64, index_n_heads=32,
                         index_head_dim=128, index_topk=2048, index_topk_pattern=GLM52.index_share)
    geom = ModelGeometry.from_hf_config(hf)
    assert geom == replace(GLM52, name="glm_moe_dsa")
    hf.index_topk_pattern = None  # no IndexShare: every layer runs the indexer
    assert ModelGeometry.from_hf_config(hf).pattern.full_layers == list(range(GLM52.num_layers))


def test_profile_validation(tmp_path, rtx):
    d = rtx.to_dict()
    for bad, msg in ((dict(d, bw_dir_GBps=0), "bandwidths"), (dict(d, copy_us=-1), "copy_us"),
                     (dict(d, mode="fast"), "mode"), (dict(d, extra=1), "unknown"),
                     ({k: v for k, v in d.items() if k != "base_us"}, "missing")):
        path = tmp_path / "p.json"
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=msg):
            cm.load_profile(str(path))
    with pytest.raises(ValueError, match="no profile"):
        cm.load_profile("nonexistent_node")
    path = tmp_path / "ok.json"
    rtx.save(str(path))
    assert cm.load_profile(str(path)) == rtx


def test_link_time(rtx):
    # one direction busy: the one-way rate; both directions: the bidirectional cap
    assert cm.link_us(55e3, 0, 55e3, rtx) == pytest.approx(1.0)
    assert cm.link_us(55e3, 55e3, 110e3, rtx) == pytest.approx(110e3 / 107e3)


@pytest.mark.parametrize("rows,ctx,fmt", [(1, 0, "nvfp4_368"), (4, 65536, "nvfp4_432"), (2, 1000, "fp8_ds_mla")])
def test_predicted_bytes_equal_accounting(rtx, rows, ctx, fmt):
    step = cm.StepSpec(batch=3, rows=rows, context=ctx, union_ratio=1.0, record_format=fmt)
    layers = GLM52.num_layers + (1 if rows > 1 else 0)
    st = cm.predict(step, rtx, "stock", 0)
    lb = acc.stock_dcp_layer(acc.StockDcpShape(rows=3 * rows))
    assert st.total_bytes == lb.total * layers and st.rx_bytes_per_rank == lb.rx.max() * layers
    # selected: brute force with an evenly spread union (tokens 0..U-1 over 4 owners)
    u = min(ctx + rows, 2048)
    union = np.tile(np.arange(u), (3, 1))
    from sparkinfer.core.topology import DcpLayout
    rec = {"nvfp4_368": 368, "nvfp4_432": 432, "fp8_ds_mla": 656}[fmt]
    exact = acc.selected_layer(acc.missing_counts(union, np.full(3, u), DcpLayout(4, 1)), rec)
    se = cm.predict(step, rtx, "selected", 3)
    if u % 4 == 0:
        assert se.total_bytes == exact.total * layers
    assert se.total_bytes == pytest.approx(exact.total * layers, rel=4 / u)


def test_issue_arithmetic(rtx):
    """Issue 6: TP4/DCP4, 368 B, MTP3: ~1.0 MB per layer per request for selected records,
    ~0.3 MB with reuse (30% new), ~0.4 MB for stock DCP (bytes entering one rank)."""
    b = cm.step_bytes(cm.StepSpec(rows=4, union_ratio=1.75, new_fraction=0.3, context=65536))
    rx = lambda m: max(sum(m[s][t] for s in range(4) if s != t) for t in range(4))
    assert 0.95e6 < rx(b["selected"]) < 1.05e6
    assert 0.28e6 < rx(b["reuse"]) < 0.32e6
    assert 0.40e6 < b["stock"].rx.max() < 0.43e6


def test_selected_comm_properties():
    counts = cm.group_counts(cm.pattern_groups(GLM52, False))
    assert counts == ((0, 2), (3, 19))
    f = lambda x, fixed=10.0, c=100.0, d=3: cm.selected_comm_us(x, fixed, c, counts, d)
    # depth 0: every layer's exchange exposed
    assert f(5.0, d=0) == pytest.approx(78 * 15.0)
    # hidden bundles cost only their fixed part
    assert f(5.0, d=3) == pytest.approx(21 * 15.0 + 19 * 10.0)
    assert f(5.0, d=1) == pytest.approx(21 * 15.0 + 19 * 3 * 10.0)
    # link-bound: a bundle of s layers exposes s*x - c
    assert f(200.0, d=3) == pytest.approx(21 * 210.0 + 19 * (10.0 + 600.0 - 100.0))
    xs = np.linspace(0, 500, 51)
    for d in range(4):
        vals = [f(x, d=d) for x in xs]
        assert all(b >= a for a, b in zip(vals, vals[1:]))  # monotone in bytes
        assert f(50.0, fixed=20.0, d=d) >= f(50.0, fixed=10.0, d=d)


def test_indexer_and_attention_terms(rtx):
    s0 = cm.StepSpec(context=0)  # one row: no MTP layer, 21 Full layers
    s1 = cm.StepSpec(context=262144)
    a, b = cm.predict(s0, rtx, "stock", 0), cm.predict(s1, rtx, "stock", 0)
    assert b.indexer_us - a.indexer_us == pytest.approx(21 * 262144 * rtx.index_ns_per_token * 1e-3)
    sharded = cm.predict(cm.StepSpec(context=262144, indexer="sharded"), rtx, "stock", 0)
    assert sharded.indexer_us == pytest.approx(b.indexer_us / 4)
    assert sharded.comm_us > b.comm_us  # the candidate all-gather
    with pytest.raises(ValueError, match="replicated"):
        cm.predict(cm.StepSpec(indexer="sharded"), rtx, "selected", 1)


def test_published_residuals_within_5pct(rtx):
    """The shipped RTX profile reproduces every published run within 5% (doc table)."""
    rows = cm.residual_table(rtx)
    assert len(rows) == len(cm.PUBLISHED)
    for r in rows:
        assert abs(r["residual_pct"]) < 5.0, r
    # the model keeps the published ordering: stock faster than selected at every point
    by = {(r["point"], r["path"]): r["predicted"] for r in rows}
    for point, _ in by:
        assert by[(point, "stock")] > by[(point, "selected")]


def test_bad_steps(rtx):
    with pytest.raises(ValueError, match="union_ratio"):
        cm.StepSpec(rows=1, union_ratio=2.0)
    with pytest.raises(ValueError, match="new_fraction"):
        cm.StepSpec(new_fraction=1.5)
    with pytest.raises(ValueError, match="unknown record format"):
        cm.StepSpec(record_format="nvfp5")
    with pytest.raises(ValueError, match="dcp=2"):
        cm.predict(cm.StepSpec(dcp=2, tp=2), rtx, "stock", 0)
    with pytest.raises(ValueError, match="path"):
        cm.predict(cm.StepSpec(), rtx, "magic", 0)
    assert math.isfinite(cm.step_time_us(cm.StepSpec(), rtx, "selected", 2))


def test_calibrate_host_fabric(tmp_path):
    from sparkinfer.cli import calibrate
    base = cm.load_profile("rtx_pro_6000_x4")
    prof, measured = calibrate.calibrate(base, 4, 1 << 20, quick=True, name="t")
    assert all(v > 0 for v in measured.values())
    assert "HOST FABRIC" in prof.source and prof.base_us == base.base_us
    path = tmp_path / "p.json"
    prof.save(str(path))
    assert cm.load_profile(str(path)) == prof
