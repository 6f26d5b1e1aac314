"""PCIe bytes per decoded token: stock DCP vs selected records vs selected records with reuse.

Decoding is replayed over top-k traces with 4-row MTP windows (MTP3): a step's
rows sit at positions ``p .. p+3``; each draft is accepted with probability
0.6 (chain, seeded), so the step commits ``a`` in 1..4 tokens. Two replays
bracket what a real decode sees (``replay`` column): ``accepted`` starts the
next step at ``p + a`` and re-uses the trace's top-k for re-queried positions
(optimistic: a real re-query carries a different token), ``fresh`` starts it at
``p + 4`` so every row is a new position (pessimistic: rows are further from
the previous step than a real re-query). Per step and layer the union of the 4
rows' top-k (first-occurrence order) is priced with ``sparkinfer.core.accounting``
at TP4/DCP4, interleave 1, 368-byte records; reuse runs the replicated
``ReuseTracker`` (held mask -> missing records -> commit of positions ``< p + a``),
its pool split into per-layer quotas of ``--pool`` x k records per destination.
Stock DCP's bytes do not depend on the trace; two variants are priced: ``stock``
(ag_rs: query all-gather + LSE all-gather + output reduce-scatter for 4 rows per
layer) and ``stock_qrep`` (vLLM 0.32's default for GLM-MoE-DSA: queries replicated,
one all-to-all of outputs and LSE).

Traces:
* real: ``benchmarks/traces/smollm2_topk.npz`` (``make_traces.py``: SmolLM2-135M,
  head-summed attention top-k per layer over license texts), windows of 64
  positions ending at contexts 512..8192, ``k`` in 64/128/256. Every layer has
  its own top-k (no IndexShare in SmolLM2); results are per layer.
* real-long: ``benchmarks/traces/smollm2_topk_long.npz``, one window of 448 positions
  ending at 8192, ``k = 64``, replayed at several pool sizes (``--long-pools``) to see
  the LRU budget over a 7x longer decode than the short windows.
* synthetic: one layer, GLM-5.2's ``k = 2048`` at a 64K context; position
  ``q+1``'s set keeps a random ``overlap`` share of position ``q``'s set and
  draws the rest uniformly from the other tokens of its causal prefix.

Record counts scale with ``k``, stock DCP's bytes do not (they follow GLM-5.2's
64 heads x 576), so selected and reuse bytes are reported at GLM-5.2 scale:
the measured record counts x ``2048 / k`` (the traces give the shares: union
per k, new records per k). ``overlap`` is the mean top-k overlap of adjacent
positions. Bytes per decoded token = all PCIe bytes of the steps / tokens committed. The
first step of each window starts with an empty pool; ``steady`` excludes it
(a real decode runs thousands of steps per pool fill), ``cold`` includes it, ``late`` counts only
the second half of the window's steps (a pool warmed by the first half).

Replica path (``sparkinfer.core.replicas.ReplicaWindow``, issue 11): every rank keeps the last
``W`` positions of the request in a ring, so a union token in the window (or among the step's own
rows, which every rank writes) is local on every destination. ``W`` is a fraction of the trace
window's context (``window`` column: 1/16, 1/8, 1/4, and 1 = the whole context fits; 0 = no replica
store, the selected + reuse path above). The prefill writes ``[0, p0)`` before the first decode
step (the ring is warm after a prefill; the reuse pool is not). Held = reuse pool OR replica
window OR own shard; the pool stores only records that were received (``commit`` gets the union
without its replica-held tokens), so it keeps the older tokens that had to move. A layer whose
held mask leaves nothing to move runs no exchange. ``replica_vs_stock_qrep`` = stock
qrep + a2a bytes / replica-path bytes (``inf`` when nothing moves).

Operation counts per decode step and attention layer (``bytes_per_token_ops.csv``; fresh replay,
steady, ctx/k >= 8): stock DCP's collectives (and the point-to-point pairs inside them), and for the selected paths
the exchanges that run (a layer with no remote record runs none) and the packed copies (one per
(src, dst) pair with a non-zero payload). SmolLM2 has no IndexShare, so each trace layer is its own
exchange group; on GLM-5.2 a Full layer's Shared layers join its group (fewer exchanges).

Writes ``bytes_per_token.csv``, ``bytes_per_token_ops.csv`` and ``bytes_per_token.png`` (``--out`` dir).
"""

from __future__ import annotations

import argparse
import csv
import itertools
import os
import time

import numpy as np

from sparkinfer.core import accounting as acc
from sparkinfer.core.replicas import ReplicaWindow
from sparkinfer.core.reuse import ReuseTracker
from sparkinfer.core.topology import DcpLayout

HERE = os.path.dirname(os.path.abspath(__file__))
TRACE = os.path.join(HERE, "traces", "smollm2_topk.npz")
LONG_TRACE = os.path.join(HERE, "traces", "smollm2_topk_long.npz")
ROWS = 4
ACCEPT = 0.6
RECORD = 368
DCP = 4
GLM_TOPK = 2048
ACCOUNTING = ("steady", "cold", "late")
WINDOWS = (1 / 16, 1 / 8, 1 / 4, 1.0)  # replica window, fraction of the context (1: the whole context fits)


def first_occurrence_union(rows: np.ndarray) -> np.ndarray:
    """Tokens of ``rows`` [R, K] (no -1) in first-occurrence order over (row, k)."""
    flat = rows.ravel()
    _, idx = np.unique(flat, return_index=True)
    return flat[np.sort(idx)]


def stock_bytes_per_step(qrep: bool = False) -> int:
    shape = acc.StockDcpShape(rows=ROWS, tp=DCP, dcp=DCP, backend="a2a" if qrep else "ag_rs", q_replicated=qrep)
    return acc.stock_dcp_layer(shape).total


def replica_positions(frac: float, context: int) -> int:
    """Ring positions per request for a window of ``frac`` of ``context`` (1: the context and the
    step's rows fit)."""
    return context + ROWS if frac >= 1.0 else max(1, int(round(frac * context)))


def replay(topk_of, positions: np.ndarray, layers: int, capacity: int, seed: int, fresh: bool,
           windows=(), context: int | None = None) -> dict:
    """Replay MTP steps over a window. ``topk_of(layer, pos) -> int array`` (the row's top-k).

    ``fresh=False``: the next step starts at ``p + a`` and re-queries positions whose drafts were
    rejected with the trace's (true-text) top-k, identical to the previous step's rows: optimistic,
    since the real re-query has a different token. ``fresh=True``: the next step starts at ``p + 4``
    (all rows new positions) while still committing ``a`` tokens: pessimistic, since rows are
    further from the previous step than a real re-query.

    ``windows``: replica windows (fractions of ``context``), each replayed with its own reuse
    pool and ``ReplicaWindow`` beside the plain reuse path.

    Returns per-step arrays: tokens committed, selected bytes, reuse bytes (summed over layers);
    per window, replica bytes, exchanges and copies.
    """
    layout = DcpLayout(DCP, 1)
    tracker = ReuseTracker(layout, capacity, num_layers=layers)  # per-layer quotas
    reps = [(ReplicaWindow(replica_positions(f, context), 1), ReuseTracker(layout, capacity, num_layers=layers))
            for f in windows]
    rng = np.random.default_rng(seed)
    p, end = int(positions[0]), int(positions[-1]) - ROWS + 1
    for ring, _ in reps:
        ring.begin_step([0], [0], [p])  # the prefill wrote [0, p) into every rank's ring
    toks, sel, reuse, overlap = [], [], [], []
    ops = {"selected": [], "reuse": []}
    rep_out = [{"bytes": [], "exchanges": [], "copies": []} for _ in reps]
    while p <= end:
        a = 1
        while a < ROWS and rng.random() < ACCEPT:
            a += 1
        s_bytes = r_bytes = 0
        s_ops, r_ops = np.zeros(2, np.int64), np.zeros(2, np.int64)
        steps = [ring.begin_step([0], [p], [ROWS]) for ring, _ in reps]
        rep_step = np.zeros((len(reps), 3), np.int64)  # bytes, exchanges, copies
        for layer in range(layers):
            rows = np.stack([topk_of(layer, p + j) for j in range(ROWS)])
            union = first_occurrence_union(rows)[None, :]
            counts = np.array([union.shape[1]])
            # adjacent positions' overlap (the rows of one step are adjacent)
            overlap.append(np.mean([len(np.intersect1d(rows[j], rows[j + 1])) / rows.shape[1]
                                    for j in range(ROWS - 1)]))
            lb = acc.selected_layer(acc.missing_counts(union, counts, layout), RECORD)
            s_bytes += lb.total
            s_ops += (lb.ops, lb.copies)
            held = tracker.held(layer, [0], union, counts)
            lb = acc.selected_layer(acc.missing_counts(union, counts, layout, held), RECORD)
            r_bytes += lb.total
            r_ops += (lb.ops, lb.copies)
            tracker.commit(layer, [0], union, counts, [p + a])
            for i, ((_, pool), st) in enumerate(zip(reps, steps)):
                local = st.held_mask(union, counts)[0] | (union[0] >= p)  # window, or this step's own rows
                held = pool.held(layer, [0], union, counts) | local[None, None, :]
                lb = acc.selected_layer(acc.missing_counts(union, counts, layout, held), RECORD)
                rep_step[i] += (lb.total, lb.ops, lb.copies)
                fetched = union[:, ~local]  # the pool keeps only records that moved
                pool.commit(layer, [0], fetched, np.array([fetched.shape[1]]), [p + a])
        toks.append(a)
        sel.append(s_bytes)
        reuse.append(r_bytes)
        ops["selected"].append(s_ops)
        ops["reuse"].append(r_ops)
        for out, (b_, e_, c_) in zip(rep_out, rep_step):
            out["bytes"].append(b_)
            out["exchanges"].append(e_)
            out["copies"].append(c_)
        p += ROWS if fresh else a
    return {"tokens": np.array(toks), "selected": np.array(sel), "reuse": np.array(reuse),
            "overlap": float(np.mean(overlap)) if overlap else float("nan"),
            "ops": {k: np.array(v).reshape(-1, 2) for k, v in ops.items()},
            "replicas": [{k: np.array(v) for k, v in o.items()} for o in rep_out]}


def steps_of(mode: str, n: int) -> slice:
    """``steady``: all but the cold first step; ``cold``: every step; ``late``: the second half of
    the window's steps (the pool warmed by the first half: closer to a long decode's steady state)."""
    return {"steady": slice(1, None), "cold": slice(None), "late": slice(n // 2, None)}[mode]


def per_token(res: dict, layers: int, mode: str, k: int, window: int | None = None) -> dict:
    """Bytes per decoded token per layer at GLM-5.2 scale: record counts x (GLM_TOPK / k);
    ``window`` (an index into the replay's replica windows) adds the replica path."""
    s = steps_of(mode, len(res["tokens"]))
    t = res["tokens"][s].sum()
    steps = layers * len(res["tokens"][s])
    scale = GLM_TOPK / k
    out = {"stock": stock_bytes_per_step() * steps / t / layers,
           "stock_qrep": stock_bytes_per_step(qrep=True) * steps / t / layers,
           "selected": res["selected"][s].sum() * scale / t / layers,
           "reuse": res["reuse"][s].sum() * scale / t / layers}
    out["replica"] = out["reuse"] if window is None else \
        res["replicas"][window]["bytes"][s].sum() * scale / t / layers
    return out


def op_counts(res: dict, layers: int, mode: str, window: int | None) -> dict:
    """Per decode step and layer over the ``mode`` steps: exchanges run and packed copies issued
    (replica path at ``window``, or selected + reuse when None), and the same for plain selected."""
    s = steps_of(mode, len(res["tokens"]))
    if window is None:
        ex, cp = res["ops"]["reuse"][s, 0], res["ops"]["reuse"][s, 1]
    else:
        ex, cp = res["replicas"][window]["exchanges"][s], res["replicas"][window]["copies"][s]
    return {"exchanges": float(ex.mean()) / layers, "copies": float(cp.mean()) / layers,
            "zero_byte_steps": float((ex == 0).mean()),
            "selected_exchanges": float(res["ops"]["selected"][s, 0].mean()) / layers,
            "selected_copies": float(res["ops"]["selected"][s, 1].mean()) / layers}


def real_rows(path: str, capacity_per_layer: float, label: str = "real", windows=WINDOWS) -> list[dict]:
    z = np.load(path)
    topk, positions, contexts = z["topk"].astype(np.int64), z["positions"], z["contexts"]
    _, _, layers, keep = topk.shape
    out = []
    for k, (w, ctx), fresh in itertools.product((64, 128, 256), enumerate(contexts), (False, True)):
        if k > keep:
            continue
        base = positions[w, 0]
        res = replay(lambda layer, pos: topk[w, pos - base, layer, :k], positions[w], layers,
                     int(capacity_per_layer * k * layers), seed=0, fresh=fresh,  # one acceptance sequence
                     windows=windows, context=int(ctx))
        for mode, (wi, frac) in itertools.product(ACCOUNTING, [(None, 0.0)] + list(enumerate(windows))):
            pt = per_token(res, layers, mode, k, wi)
            ops = op_counts(res, layers, mode, wi)
            out.append({"trace": label, "pool": capacity_per_layer, "replay": "fresh" if fresh else "accepted", "k": k,
                        "context": int(ctx), "ctx_over_k": int(ctx) / k,
                        "overlap": res["overlap"], "accounting": mode, "steps": len(res["tokens"]),
                        **{f"{p}_B_per_tok_layer": v for p, v in pt.items()},
                        "reuse_vs_stock": pt["stock"] / pt["reuse"],
                        "reuse_vs_stock_qrep": pt["stock_qrep"] / pt["reuse"],
                        "window": frac,
                        "replica_positions": 0 if wi is None else replica_positions(frac, int(ctx)),
                        "replica_vs_stock_qrep": pt["stock_qrep"] / pt["replica"] if pt["replica"] else float("inf"),
                        "exchanges_per_step_layer": ops["exchanges"], "copies_per_step_layer": ops["copies"],
                        "zero_byte_step_share": ops["zero_byte_steps"],
                        "selected_exchanges_per_step_layer": ops["selected_exchanges"],
                        "selected_copies_per_step_layer": ops["selected_copies"]})
    return out


def synthetic_topk(rng, ctx: int, k: int, n_pos: int, overlap: float) -> np.ndarray:
    """[n_pos, k] top-k sets for positions ctx-n_pos .. ctx-1 with a controlled step overlap."""
    first = ctx - n_pos
    cur = rng.choice(first + 1, size=k, replace=False)
    out = [cur]
    for q in range(first + 1, ctx):
        keep = rng.choice(cur, size=int(round(overlap * k)), replace=False)
        pool = np.setdiff1d(np.arange(q + 1), keep, assume_unique=False)
        new = rng.choice(pool, size=k - len(keep), replace=False)
        cur = np.concatenate([keep, new])
        out.append(cur)
    return np.stack(out)


def synthetic_rows(overlaps, ctx: int, k: int, n_pos: int, capacity_per_layer: float) -> list[dict]:
    out = []
    for o in overlaps:
        rng = np.random.default_rng(int(o * 1000))
        sets = synthetic_topk(rng, ctx, k, n_pos, o)
        first = ctx - n_pos
        res = replay(lambda layer, pos: sets[pos - first], np.arange(first, ctx), 1,
                     int(capacity_per_layer * k), seed=7, fresh=True)
        pt = per_token(res, 1, "steady", k)
        out.append({"trace": "synthetic", "pool": capacity_per_layer, "replay": "fresh", "k": k, "context": ctx, "ctx_over_k": ctx / k,
                    "overlap": res["overlap"], "accounting": "steady", "steps": len(res["tokens"]),
                    **{f"{p}_B_per_tok_layer": v for p, v in pt.items()},
                    "reuse_vs_stock": pt["stock"] / pt["reuse"],
                    "reuse_vs_stock_qrep": pt["stock_qrep"] / pt["reuse"], "window": 0.0,
                    "replica_vs_stock_qrep": pt["stock_qrep"] / pt["replica"]})
    return out


def break_even(rows: list[dict], stock: str = "stock") -> float:
    """Overlap above which reuse moves fewer bytes than ``stock`` (linear interpolation)."""
    pts = sorted((r["overlap"], r["reuse_B_per_tok_layer"] - r[f"{stock}_B_per_tok_layer"]) for r in rows)
    for (o0, d0), (o1, d1) in zip(pts, pts[1:]):
        if d0 >= 0 > d1:
            return o0 + (o1 - o0) * d0 / (d0 - d1)
    return float("nan")


def replica_summary(rows: list[dict]) -> list[dict]:
    """Per (trace, replay, accounting, window): replica path vs stock qrep + a2a over the windows
    with ctx/k >= 8 (pool = the replay's default), and the op counts."""
    real8 = [r for r in rows if r["trace"].startswith("real") and r["ctx_over_k"] >= 8 and r["window"] != ""
             and r.get("replica_positions") is not None and (r["trace"] == "real" or r["pool"] == 4.0)]
    out = []
    keys = sorted({(r["trace"], r["replay"], r["accounting"], r["window"]) for r in real8})
    for trace, replay_mode, mode, win in keys:
        sel = [r for r in real8 if (r["trace"], r["replay"], r["accounting"], r["window"]) == (trace, replay_mode,
                                                                                            mode, win)]
        ratio = np.array([r["replica_vs_stock_qrep"] for r in sel])
        out.append({"trace": trace, "replay": replay_mode, "accounting": mode, "window": win, "windows": len(sel),
                    "replica_B_per_tok_layer": float(np.mean([r["replica_B_per_tok_layer"] for r in sel])),
                    "stock_qrep_B_per_tok_layer": float(np.mean([r["stock_qrep_B_per_tok_layer"] for r in sel])),
                    "ratio_mean": float(ratio.mean()), "ratio_min": float(ratio.min()), "ratio_max": float(ratio.max()),
                    "exchanges_per_step_layer": float(np.mean([r["exchanges_per_step_layer"] for r in sel])),
                    "copies_per_step_layer": float(np.mean([r["copies_per_step_layer"] for r in sel])),
                    "zero_byte_step_share": float(np.mean([r["zero_byte_step_share"] for r in sel]))})
    return out


def ops_table(rows: list[dict]) -> list[dict]:
    """Collectives, exchanges and copies per decode step (fresh replay, steady, ctx/k >= 8, main
    trace), per attention layer and for GLM-5.2's stock step (79 layers at MTP3)."""
    layers = 79
    out = []
    for qrep, name in ((True, "stock DCP qrep + a2a (vLLM default)"), (False, "stock DCP ag_rs")):
        lb = acc.stock_dcp_layer(acc.StockDcpShape(rows=ROWS, tp=DCP, dcp=DCP, backend="a2a" if qrep else "ag_rs",
                                                   q_replicated=qrep))
        out.append({"path": name, "window": "", "collectives_per_layer": lb.ops, "exchanges_per_layer": 0.0,
                    "copies_per_layer": 0.0, "p2p_pairs_per_layer": lb.copies,
                    "collectives_per_step_glm52": lb.ops * layers, "zero_byte_step_share": 0.0})
    sel = [r for r in rows if r["trace"] == "real" and r["ctx_over_k"] >= 8 and r["replay"] == "fresh"
           and r["accounting"] == "steady"]
    if not sel:
        return out
    w0 = [r for r in sel if r["window"] == 0.0]
    out.append({"path": "selected records", "window": "", "collectives_per_layer": 0,
                "exchanges_per_layer": float(np.mean([r["selected_exchanges_per_step_layer"] for r in w0])),
                "copies_per_layer": float(np.mean([r["selected_copies_per_step_layer"] for r in w0])),
                "p2p_pairs_per_layer": "", "collectives_per_step_glm52": 0, "zero_byte_step_share": 0.0})
    for win in sorted({r["window"] for r in sel}):
        rs = [r for r in sel if r["window"] == win]
        out.append({"path": "selected + reuse" if win == 0.0 else "replicas + reuse", "window": win,
                    "collectives_per_layer": 0,
                    "exchanges_per_layer": float(np.mean([r["exchanges_per_step_layer"] for r in rs])),
                    "copies_per_layer": float(np.mean([r["copies_per_step_layer"] for r in rs])),
                    "p2p_pairs_per_layer": "", "collectives_per_step_glm52": 0,
                    "zero_byte_step_share": float(np.mean([r["zero_byte_step_share"] for r in rs]))})
    return out


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend, or None (said on stdout) without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install -e .[plot]): no plot")
        return None
    return plt


def plot(rows: list[dict], path: str) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(18, 4.8))
    colors = {"stock": "k", "stock_qrep": "tab:gray", "selected": "tab:red", "reuse": "tab:blue",
              "replica": "tab:green"}
    names = {"stock": "stock DCP ag_rs", "stock_qrep": "stock DCP qrep + a2a (vLLM default)",
             "selected": "selected records", "reuse": "selected + reuse", "replica": "replicas (1/8 ctx) + reuse"}
    styles = {64: ":", 128: "-", 256: "--"}
    real = [r for r in rows if r["trace"] == "real" and r["accounting"] == "steady" and r["replay"] == "fresh"]
    for k in sorted({r["k"] for r in real}):
        for kind in ("stock", "stock_qrep", "selected", "reuse", "replica"):
            win = 0.125 if kind == "replica" else 0.0
            rk = sorted((r for r in real if r["k"] == k and r["window"] == win), key=lambda r: r["context"])
            a.plot([r["context"] for r in rk], [r[f"{kind}_B_per_tok_layer"] / 1e3 for r in rk],
                   styles.get(k, "-"), color=colors[kind], marker="o", ms=3,
                   label=f"{names[kind]}, k={k}" if not kind.startswith("stock") or k == 64 else None)
    a.set_xscale("log", base=2)
    a.set_yscale("log")
    a.set_xlabel("context (tokens)")
    a.set_ylabel("KB per decoded token per layer (all links, k scaled to 2048)")
    a.set_title("real traces (SmolLM2-135M top-k, MTP3, fresh replay, steady)")
    a.legend(fontsize=6)
    syn = sorted((r for r in rows if r["trace"] == "synthetic"), key=lambda r: r["overlap"])
    for kind in ("stock", "stock_qrep", "selected", "reuse"):
        b.plot([r["overlap"] for r in syn], [r[f"{kind}_B_per_tok_layer"] / 1e6 for r in syn],
               color=colors[kind], marker="o", ms=3, label=names[kind])
    rf = [r for r in real if r["ctx_over_k"] >= 8 and r["window"] == 0.0]
    b.scatter([r["overlap"] for r in rf], [r["reuse_B_per_tok_layer"] / 1e6 for r in rf], s=12,
              color="tab:cyan", label="real traces, selected + reuse (ctx >= 8k)", zorder=3)
    be = break_even(syn, "stock_qrep")
    if be == be:
        b.axvline(be, color="gray", ls=":", lw=1)
        b.text(be, b.get_ylim()[1] * 0.9, f" break-even vs qrep {be:.2f}", fontsize=8)
    b.set_xlabel("adjacent-position top-k overlap")
    b.set_ylabel("MB per decoded token per layer (all links)")
    b.set_title(f"synthetic, k={syn[0]['k'] if syn else '?'}, ctx={syn[0]['context'] if syn else '?'}")
    b.legend(fontsize=7)
    summ = [r for r in replica_summary(rows) if r["window"] < 1.0]
    for (trace, replay_mode, mode), style in (
            (("real", "fresh", "steady"), dict(color="tab:green", ls="-")),
            (("real", "fresh", "late"), dict(color="tab:green", ls="--")),
            (("real", "accepted", "steady"), dict(color="tab:olive", ls="-")),
            (("real-long", "fresh", "steady"), dict(color="tab:purple", ls="-")),
            (("real-long", "accepted", "steady"), dict(color="tab:pink", ls="-"))):
        rs = sorted((r for r in summ if (r["trace"], r["replay"], r["accounting"]) == (trace, replay_mode, mode)),
                    key=lambda r: r["window"])
        if not rs:
            continue
        x = [r["window"] for r in rs]
        c.plot(x, [r["ratio_mean"] for r in rs], marker="o", ms=3, label=f"{trace}, {replay_mode}, {mode}", **style)
        if len(rs[0:1]) and rs[0]["windows"] > 1:
            c.fill_between(x, [r["ratio_min"] for r in rs], [r["ratio_max"] for r in rs], alpha=0.12,
                           color=style["color"])
    c.axhline(3.0, color="k", ls=":", lw=1)
    c.axhline(1.0, color="tab:gray", lw=1)
    c.text(0.0, 3.05, " target 3x at window 1/8", fontsize=8)
    c.set_xticks([0, 1 / 16, 1 / 8, 1 / 4], ["0 (no replicas)", "1/16", "1/8", "1/4"])
    c.set_xlabel("replica window (fraction of the context; whole context: 0 bytes)")
    c.set_ylabel("stock qrep + a2a bytes / replica-path bytes")
    c.set_yscale("log", base=2)
    c.set_title("replicas + reuse vs qrep + a2a (ctx/k >= 8; band: min-max)")
    c.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def write_csv(path: str, rows: list[dict]) -> None:
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="PCIe bytes per decoded token per path")
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--pool", type=float, default=4.0,
                    help="reuse pool per destination, in units of k records per layer (default 4)")
    ap.add_argument("--long-trace", default=LONG_TRACE,
                    help="one long window (448 positions) to check the pool budget over a longer decode")
    ap.add_argument("--long-pools", default="1,1.5,2,4",
                    help="pool sizes (units of k per layer) for it; replica windows run at --pool")
    ap.add_argument("--syn-k", type=int, default=2048)
    ap.add_argument("--syn-context", type=int, default=65536)
    ap.add_argument("--syn-positions", type=int, default=48)
    ap.add_argument("--quick", action="store_true", help="small synthetic sweep (CI)")
    args = ap.parse_args(argv)
    t0 = time.time()
    os.makedirs(args.out, exist_ok=True)
    rows = real_rows(args.trace, args.pool) if os.path.exists(args.trace) else []
    if not rows:
        print(f"no trace at {args.trace}: run benchmarks/make_traces.py (synthetic only)")
    if os.path.exists(args.long_trace):
        for pool in (float(x) for x in args.long_pools.split(",")):
            rows += real_rows(args.long_trace, pool, label="real-long", windows=WINDOWS if pool == args.pool else ())
    overlaps = (0.0, 0.5, 0.8, 0.95) if args.quick else (0.0, 0.2, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
    k = 256 if args.quick else args.syn_k
    ctx = 8192 if args.quick else args.syn_context
    rows += synthetic_rows(overlaps, ctx, k, args.syn_positions, args.pool)
    csv_path = os.path.join(args.out, "bytes_per_token.csv")
    write_csv(csv_path, rows)
    base = [r for r in rows if r["window"] == 0.0]  # the paths without a replica store
    print(f"{'trace':<10}{'pool':>5}{'replay':>9}{'k':>5}{'ctx':>7}{'ctx/k':>7}{'overlap':>8}{'acct':>7}{'stock':>10}"
          f"{'qrep':>10}{'selected':>10}{'reuse':>10}{'qrep/reuse':>11}   (bytes per decoded token per layer)")
    for r in base:
        if r["accounting"] != "late":
            print(f"{r['trace']:<10}{r['pool']:>5.1f}{r['replay']:>9}{r['k']:>5}{r['context']:>7}"
                  f"{r['ctx_over_k']:>7.0f}"
                  f"{r['overlap']:>8.2f}{r['accounting']:>7}{r['stock_B_per_tok_layer']:>10.0f}"
                  f"{r['stock_qrep_B_per_tok_layer']:>10.0f}{r['selected_B_per_tok_layer']:>10.0f}"
                  f"{r['reuse_B_per_tok_layer']:>10.0f}{r['reuse_vs_stock_qrep']:>11.2f}")
    syn = [r for r in rows if r["trace"] == "synthetic"]
    print(f"synthetic break-even overlap (reuse = stock bytes), k={k}: {break_even(syn):.3f} (ag_rs), "
          f"{break_even(syn, 'stock_qrep'):.3f} (replicated queries, a2a)")
    real8 = [r for r in base if r["trace"].startswith("real") and r["ctx_over_k"] >= 8]
    for (trace, pool), replay_mode, mode in itertools.product(sorted({(r["trace"], r["pool"]) for r in real8}),
                                                              ("accepted", "fresh"), ("steady", "cold")):
        sel = [r for r in real8 if r["accounting"] == mode and r["replay"] == replay_mode
               and r["trace"] == trace and r["pool"] == pool]
        for stock in ("stock", "stock_qrep") if sel else ():
            ratios = np.array([r["reuse_vs_" + stock] for r in sel])
            print(f"{trace} traces, pool {pool:g} k/layer, ctx >= 8k, replay {replay_mode}, {mode}: {stock}/reuse "
                  f"bytes ratio mean {ratios.mean():.2f} min {ratios.min():.2f} max {ratios.max():.2f} over "
                  f"{len(sel)} (k, ctx) windows")
    summ = replica_summary(rows)
    print(f"\nreplica path (held = reuse pool {args.pool:g} k/layer OR replica window OR own), ctx/k >= 8, "
          "stock qrep + a2a / replica bytes:")
    print(f"{'trace':<10}{'replay':>9}{'acct':>7}{'window':>8}{'n':>3}{'replica B':>11}{'mean':>7}{'min':>7}{'max':>7}"
          f"{'exch/L':>8}{'copies/L':>9}{'0-B steps':>10}")
    for r in summ:
        win = "fits" if r["window"] >= 1 else ("none" if r["window"] == 0 else f"1/{round(1 / r['window'])}")
        print(f"{r['trace']:<10}{r['replay']:>9}{r['accounting']:>7}{win:>8}{r['windows']:>3}"
              f"{r['replica_B_per_tok_layer']:>11.0f}{r['ratio_mean']:>7.2f}{r['ratio_min']:>7.2f}"
              f"{r['ratio_max']:>7.2f}{r['exchanges_per_step_layer']:>8.2f}{r['copies_per_step_layer']:>9.2f}"
              f"{r['zero_byte_step_share']:>10.2f}")
    target = [r for r in summ if r["trace"] == "real" and r["replay"] == "fresh" and r["accounting"] == "steady"]
    t8 = [r for r in target if r["window"] == 0.125]
    fits = [r for r in summ if r["window"] >= 1.0]
    if t8:
        print(f"target 1 (window 1/8, fresh, steady, ctx/k >= 8: >= 3x fewer bytes than qrep + a2a): mean "
              f"{t8[0]['ratio_mean']:.2f}x, min {t8[0]['ratio_min']:.2f}x -> "
              + ("met" if t8[0]["ratio_min"] >= 3 else "met on the mean only" if t8[0]["ratio_mean"] >= 3
                 else "NOT met"))
    if fits:
        zero = all(r["replica_B_per_tok_layer"] == 0 and r["zero_byte_step_share"] == 1.0 for r in fits)
        print(f"target 2 (whole context fits: 0 bytes per decode step): {'met' if zero else 'NOT met'} "
              f"on every (k, ctx) window, replay and accounting ({sum(r['windows'] for r in fits)} rows)")
    ops = ops_table(rows)
    ops_path = os.path.join(args.out, "bytes_per_token_ops.csv")
    write_csv(ops_path, ops)
    print("\nper decode step (MTP3, 4 rows), per attention layer; fresh replay, steady, ctx/k >= 8:")
    print(f"{'path':<38}{'window':>8}{'collectives':>12}{'exchanges':>10}{'copies':>8}{'0-B steps':>10}")
    for r in ops:
        win = "" if r["window"] == "" else ("none" if r["window"] == 0 else
                                            "fits" if r["window"] >= 1 else f"1/{round(1 / r['window'])}")
        print(f"{r['path']:<38}{win:>8}{r['collectives_per_layer']:>12}{r['exchanges_per_layer']:>10.2f}"
              f"{r['copies_per_layer']:>8.2f}{r['zero_byte_step_share']:>10.2f}")
    png = os.path.join(args.out, "bytes_per_token.png")
    if plot(rows, png):
        print("wrote", png)
    print("wrote", csv_path, "and", ops_path, f"in {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
