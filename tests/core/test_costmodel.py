"""Cost model: profiles, link time, bytes consistent with the accounting, published residuals."""

import itertools
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
    f = lambda x, fixed=10.0, s=2.0, c=100.0, d=3: cm.selected_comm_us(x, fixed, s, c, counts, d)
    # depth 0: every layer's exchange exposed
    assert f(5.0, d=0) == pytest.approx(78 * 15.0)
    # compute-bound (x + s < c): a chunk exposes its first layer only
    assert f(5.0, d=3) == pytest.approx(21 * 15.0)
    assert f(5.0, d=1) == pytest.approx(2 * 15.0 + 19 * 2 * 15.0)  # FS + SS per group
    # link-bound: every layer after a chunk's first exposes x + s - c
    assert f(200.0, d=3) == pytest.approx(21 * 210.0 + 19 * 3 * (200.0 + 2.0 - 100.0))
    xs = np.linspace(0, 500, 51)
    for d in range(4):
        vals = [f(x, d=d) for x in xs]
        assert all(b >= a for a, b in zip(vals, vals[1:]))  # monotone in bytes
        assert f(50.0, fixed=20.0, d=d) >= f(50.0, fixed=10.0, d=d)


def _simulated_exposed(J, x, fixed, section, c, overlap):
    """An independent event simulation of one exchange of J layers issued at t = 0: the link moves
    the sections one after the other (the first after the fixed cost, each later one after its own
    issue cost too) and layer j computes for c once its section (overlap) or the whole region (no
    overlap) landed and layer j - 1 finished; exposed = the end less J layers of compute."""
    landed, t = [], fixed
    for j in range(J):
        t += x + (section if j and overlap else 0.0)
        landed.append(t)
    if not overlap:
        landed = [landed[-1]] * J
    free = 0.0
    for j in range(J):
        free = max(free, landed[j]) + c
    return free - J * c


@pytest.mark.parametrize("J", [1, 2, 3, 4, 7])
def test_chunk_overlap_formula_against_a_simulation(J):
    """``chunk_exposed_us`` against the event simulation above over compute-bound, link-bound and
    tie cases, with and without the overlap; and what the overlap saves: J - 1 hidden sections."""
    rng = np.random.default_rng(J)
    cases = [(5.0, 10.0, 2.0, 100.0), (200.0, 10.0, 2.0, 100.0), (98.0, 0.0, 2.0, 100.0), (0.0, 3.0, 0.0, 0.0)]
    cases += [tuple(rng.uniform(0, 300, 4)) for _ in range(200)]
    for x, fixed, section, c in cases:
        for overlap in (True, False):
            got = cm.chunk_exposed_us(J, x, fixed, section, c, overlap)
            assert got == pytest.approx(_simulated_exposed(J, x, fixed, section, c, overlap), abs=1e-9)
        packed = cm.chunk_exposed_us(J, x, fixed, section, c, False)
        if section <= c:  # a section's issue cost below a layer's compute: the overlap never loses
            assert cm.chunk_exposed_us(J, x, fixed, section, c) <= packed + 1e-9
    # hand values: F + 3 Shared layers, x 40 us, fixed 10, section 2, compute 100 -> only F's section
    assert cm.chunk_exposed_us(4, 40.0, 10.0, 2.0, 100.0) == 50.0
    assert cm.chunk_exposed_us(4, 40.0, 10.0, 2.0, 100.0, overlap=False) == 170.0
    assert cm.chunk_exposed_us(4, 150.0, 10.0, 2.0, 100.0) == 10.0 + 150.0 + 3 * 52.0


def test_chunk_terms_cover_every_layer_once():
    for counts in (((0, 2), (3, 19)), ((0, 3), (1, 2), (5, 4)), ((2, 1),)):
        layers = sum((n + 1) * k for n, k in counts)
        for d in range(6):
            terms = cm.chunk_terms(counts, d)
            assert sum(m * j for m, j in terms) == layers
            assert all(1 <= j <= d + 1 for _, j in terms)
            assert sum(m for m, _ in terms) == sum(k * -(-(n + 1) // (d + 1)) for n, k in counts)


def test_indexer_and_attention_terms(rtx):
    s0 = cm.StepSpec(context=0)  # one row: no MTP layer, 21 Full layers
    s1 = cm.StepSpec(context=262144)
    a, b = cm.predict(s0, rtx, "stock", 0), cm.predict(s1, rtx, "stock", 0)
    assert b.indexer_us - a.indexer_us == pytest.approx(21 * 262144 * rtx.index_ns_per_token * 1e-3)
    sharded = cm.predict(cm.StepSpec(context=262144, indexer="sharded"), rtx, "stock", 0)
    assert sharded.indexer_us == pytest.approx(b.indexer_us / 4)
    assert sharded.comm_us > b.comm_us  # the candidate all-gather
    # sharded scoring gives every rank the merged top-k, so the selected path can follow it too:
    # the same all-gather per Full layer on both paths
    for path, depth in (("stock", 0), ("selected", 1)):
        rep, shd = (cm.predict(cm.StepSpec(context=262144, indexer=i), rtx, path, depth)
                    for i in ("replicated", "sharded"))
        merge = cm.merge_us(acc.sharded_topk_merge(1, GLM52.topk, 4), rtx)
        assert shd.comm_us - rep.comm_us == pytest.approx(21 * merge) and merge > rtx.collective_us


@pytest.mark.parametrize("batch, rows", [(1, 1), (1, 4), (8, 4), (32, 1)])
def test_choose_indexer_picks_the_cheaper_predicted_step(rtx, batch, rows):
    """``choose_indexer`` (a per-Full-layer rule) against whole-step predictions of both scorings,
    on both paths, over contexts from 0 to 1M: it picks sharded exactly where that step is cheaper."""
    n_full = 21 + (1 if rows > 1 else 0)
    flips = 0
    for ctx in [0, 1, 1000, 8000, 16000, 24000, 32000, 65536, 131072, 262144, 1 << 20]:
        pick = cm.choose_indexer(rtx, batch * rows * ctx, batch * rows, 4)
        for path, depth in (("stock", 0), ("selected", 2)):
            steps = {i: cm.predict(cm.StepSpec(batch=batch, rows=rows, context=ctx, indexer=i,
                                               union_ratio=min(1.75, rows)), rtx, path, depth)
                     for i in ("replicated", "sharded")}
            saving = steps["replicated"].total_us - steps["sharded"].total_us
            assert saving == pytest.approx(n_full * cm.scoring_saving_us(rtx, batch * rows * ctx, batch * rows, 4),
                                           abs=1e-6)
            assert pick == ("sharded" if saving > 1e-9 else "replicated"), (ctx, path)
        flips += pick == "sharded"
    assert 0 < flips < 11  # short contexts score whole, long ones in shards
    assert cm.choose_indexer(rtx, 1e12, 1, 1) == "replicated"  # DCP 1: nothing to shard


def test_a_step_of_more_rows_than_a_merge_block_pays_an_all_gather_per_block(rtx):
    """The engine merges sharded candidates in blocks of INDEXER_ROWS rows (its reserved buffers):
    8,192 rows pay one all-gather's fixed cost per block for the same bytes; a decode step's rows
    (16 requests x 4 at the main profile) pay one."""
    from sparkinfer.core import accounting as acc
    from sparkinfer.core.indexer_tiles import INDEXER_ROWS

    assert INDEXER_ROWS >= 64
    for rows, blocks in ((64, 1), (INDEXER_ROWS, 1), (INDEXER_ROWS + 1, 2), (8192, -(-8192 // INDEXER_ROWS))):
        one_gather = cm.merge_us(acc.sharded_topk_merge(rows, 2048, 4), rtx)
        saved = rows * 100_000 * 0.75 * rtx.index_ns_per_token * 1e-3
        assert cm.scoring_saving_us(rtx, rows * 100_000, rows, 4) == pytest.approx(
            saved - one_gather - (blocks - 1) * rtx.collective_us)


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


def _profiles():
    from dataclasses import replace
    rtx = cm.load_profile("rtx_pro_6000_x4")
    return [rtx, cm.load_profile("h200_x4"), replace(rtx, name="lean", exchange_us=60.0, copy_us=1.0)]


@pytest.mark.parametrize("profile", _profiles(), ids=lambda p: p.name)
def test_fully_held_step_is_attention_plus_replica_write(profile):
    """A step whose remote union the replica store holds entirely runs no exchange: predicted
    selected time is the indexer + attention + the replica writes (rows x layers x record bytes at
    HBM rate, counted by hand here), no PCIe byte, strictly below stock at every depth."""
    for batch, rows, ctx, fmt, qrep in itertools.product((1, 8), (1, 4), (0, 2048, 65536, 262144),
                                                         ("nvfp4_368", "fp8_ds_mla"), (False, True)):
        ur = 1.75 if rows == 4 else 1.0
        kw = dict(batch=batch, rows=rows, context=ctx, union_ratio=ur, record_format=fmt,
                  backend="a2a" if qrep else "ag_rs", q_replicated=qrep)
        held = cm.StepSpec(held_fraction=1.0, **kw)
        plain = cm.StepSpec(**kw)
        layers = GLM52.num_layers  # the store holds the target layers, not the MTP layer
        rec = {"nvfp4_368": 368, "fp8_ds_mla": 656}[fmt]
        write = batch * rows * layers * rec / (profile.hbm_GBps * 1e3)
        st = cm.predict(held, profile, "stock", 0)
        assert st.write_us == pytest.approx(write, rel=1e-12)
        assert st.total_us == pytest.approx(cm.predict(plain, profile, "stock", 0).total_us + write, rel=1e-12)
        for d in range(4):
            se = cm.predict(held, profile, "selected", d)
            ref = cm.predict(plain, profile, "selected", d)
            assert se.comm_us == 0.0 and se.rx_bytes_per_rank == 0.0 and se.total_bytes == 0.0
            assert se.total_us == ref.indexer_us + ref.attn_us + se.write_us
            assert se.total_us < st.total_us
        assert write < 1.0  # small: under a microsecond per step even at batch 8 with 656-byte records


def test_replica_share_combines_with_reuse(rtx):
    """held_fraction and new_fraction are one notion: the share of the remote union that moves,
    (1 - held) * new; without a replica store (None) nothing changes, not even by a write term."""
    base = dict(batch=2, rows=4, context=65536, union_ratio=1.75)
    for held, new in ((0.0, 1.0), (0.5, 0.4), (0.9, 0.3), (0.25, 0.0)):
        a = cm.StepSpec(held_fraction=held, new_fraction=new, **base)
        b = cm.StepSpec(new_fraction=(1 - held) * new, **base)
        assert cm.moving_fraction(new, held) == pytest.approx((1 - held) * new)
        np.testing.assert_allclose(cm.step_bytes(a)["reuse"], cm.step_bytes(b)["reuse"], rtol=1e-12)
        for d in range(4):
            pa, pb = cm.predict(a, rtx, "selected", d), cm.predict(b, rtx, "selected", d)
            assert pa.comm_us == pytest.approx(pb.comm_us, rel=1e-12)  # exchange still runs (held < 1)
            assert pa.total_us == pytest.approx(pb.total_us + pa.write_us, rel=1e-12) and pa.write_us > 0
    none = cm.StepSpec(**base)
    assert cm.moving_fraction(0.3, None) == 0.3 and not cm.all_local(none)
    assert cm.predict(none, rtx, "selected", 3).write_us == 0.0
    with pytest.raises(ValueError, match="held_fraction"):
        cm.StepSpec(held_fraction=1.5)


def test_bytes_per_token_replica_replay():
    """The benchmark's replica path: a window covering the context moves nothing and runs no
    exchange; a window that misses the selected tokens moves what selected + reuse moves; a window
    holding the newest half of them moves only the rest (counted by hand)."""
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "bytes_per_token.py")
    spec = importlib.util.spec_from_file_location("bytes_per_token", path)
    bpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bpt)
    topk = np.arange(36, 100)  # 64 tokens committed before the replay starts at 100
    ctx = 140
    windows = (1.0, 2 / ctx, 40 / ctx)  # ring of 144 (fits), 2 (holds none), 40 positions
    res = bpt.replay(lambda layer, pos: topk, np.arange(100, ctx), layers=2, capacity=1000, seed=1, fresh=True,
                     windows=windows, context=ctx)
    fits, none, half = res["replicas"]
    assert not fits["bytes"].any() and not fits["exchanges"].any() and not fits["copies"].any()
    assert fits["bytes"].shape == res["reuse"].shape
    np.testing.assert_array_equal(none["bytes"], res["reuse"])
    # step s writes [p, p + 4), p = 100 + 4 s; every rank's ring then holds [p + 4 - 40, p). Step 0:
    # 64..99 in the ring, 36..63 (7 per owner) move, 21 records into each of 4 destinations per layer
    assert half["bytes"][0] == 2 * 4 * 21 * 368 and half["exchanges"][0] == 2
    assert (half["copies"][0], none["copies"][0]) == (2 * 12, 2 * 12)
    # later steps: the pool kept 36..63; the 4 positions that just left the ring move once (3 destinations)
    assert half["bytes"][1:].tolist() == [2 * 4 * 3 * 368] * (len(half["bytes"]) - 1)


@pytest.mark.parametrize("batch, rows", [(1, 1), (1, 4), (8, 4), (16, 4), (3, 2)])
def test_sharded_scoring_from_is_the_edge_of_choose_indexer(rtx, batch, rows):
    c = cm.sharded_scoring_from(rtx, batch, rows, 4)
    rows_ctx = lambda ctx: batch * sum(ctx + i + 1 for i in range(rows))
    assert cm.choose_indexer(rtx, rows_ctx(c), batch * rows, 4) == "sharded"
    assert c == 0 or cm.choose_indexer(rtx, rows_ctx(c - 1), batch * rows, 4) == "replicated"
    assert cm.sharded_scoring_from(rtx, batch, rows, 1) is None
