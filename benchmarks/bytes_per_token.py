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
(a real decode runs thousands of steps per pool fill), ``cold`` includes it.

Writes ``bytes_per_token.csv`` and ``bytes_per_token.png`` (``--out`` dir).
"""

from __future__ import annotations

import argparse
import csv
import itertools
import os
import time

import numpy as np

from sparkinfer.core import accounting as acc
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


def first_occurrence_union(rows: np.ndarray) -> np.ndarray:
    """Tokens of ``rows`` [R, K] (no -1) in first-occurrence order over (row, k)."""
    flat = rows.ravel()
    _, idx = np.unique(flat, return_index=True)
    return flat[np.sort(idx)]


def stock_bytes_per_step(qrep: bool = False) -> int:
    shape = acc.StockDcpShape(rows=ROWS, tp=DCP, dcp=DCP, backend="a2a" if qrep else "ag_rs", q_replicated=qrep)
    return acc.stock_dcp_layer(shape).total


def replay(topk_of, positions: np.ndarray, layers: int, capacity: int, seed: int, fresh: bool) -> dict:
    """Replay MTP steps over a window. ``topk_of(layer, pos) -> int array`` (the row's top-k).

    ``fresh=False``: the next step starts at ``p + a`` and re-queries positions whose drafts were
    rejected with the trace's (true-text) top-k, identical to the previous step's rows: optimistic,
    since the real re-query has a different token. ``fresh=True``: the next step starts at ``p + 4``
    (all rows new positions) while still committing ``a`` tokens: pessimistic, since rows are
    further from the previous step than a real re-query.

    Returns per-step arrays: tokens committed, selected bytes, reuse bytes (summed over layers).
    """
    layout = DcpLayout(DCP, 1)
    tracker = ReuseTracker(layout, capacity, num_layers=layers)  # per-layer quotas
    rng = np.random.default_rng(seed)
    p, end = int(positions[0]), int(positions[-1]) - ROWS + 1
    toks, sel, reuse, overlap = [], [], [], []
    while p <= end:
        a = 1
        while a < ROWS and rng.random() < ACCEPT:
            a += 1
        s_bytes = r_bytes = 0
        for layer in range(layers):
            rows = np.stack([topk_of(layer, p + j) for j in range(ROWS)])
            union = first_occurrence_union(rows)[None, :]
            counts = np.array([union.shape[1]])
            # adjacent positions' overlap (the rows of one step are adjacent)
            overlap.append(np.mean([len(np.intersect1d(rows[j], rows[j + 1])) / rows.shape[1]
                                    for j in range(ROWS - 1)]))
            s_bytes += acc.selected_layer(acc.missing_counts(union, counts, layout), RECORD).total
            held = tracker.held(layer, [0], union, counts)
            r_bytes += acc.selected_layer(acc.missing_counts(union, counts, layout, held), RECORD).total
            tracker.commit(layer, [0], union, counts, [p + a])
        toks.append(a)
        sel.append(s_bytes)
        reuse.append(r_bytes)
        p += ROWS if fresh else a
    return {"tokens": np.array(toks), "selected": np.array(sel), "reuse": np.array(reuse),
            "overlap": float(np.mean(overlap)) if overlap else float("nan")}


def per_token(res: dict, layers: int, steady: bool, k: int) -> dict:
    """Bytes per decoded token per layer at GLM-5.2 scale: record counts x (GLM_TOPK / k)."""
    s = slice(1, None) if steady else slice(None)
    t = res["tokens"][s].sum()
    steps = layers * len(res["tokens"][s])
    scale = GLM_TOPK / k
    return {"stock": stock_bytes_per_step() * steps / t / layers,
            "stock_qrep": stock_bytes_per_step(qrep=True) * steps / t / layers,
            "selected": res["selected"][s].sum() * scale / t / layers,
            "reuse": res["reuse"][s].sum() * scale / t / layers}


def real_rows(path: str, capacity_per_layer: float, label: str = "real") -> list[dict]:
    z = np.load(path)
    topk, positions, contexts = z["topk"].astype(np.int64), z["positions"], z["contexts"]
    _, _, layers, keep = topk.shape
    out = []
    for k, (w, ctx), fresh in itertools.product((64, 128, 256), enumerate(contexts), (False, True)):
        if k > keep:
            continue
        base = positions[w, 0]
        res = replay(lambda layer, pos: topk[w, pos - base, layer, :k], positions[w], layers,
                     int(capacity_per_layer * k * layers), seed=0, fresh=fresh)  # one acceptance sequence
        for mode in ("steady", "cold"):
            pt = per_token(res, layers, mode == "steady", k)
            out.append({"trace": label, "pool": capacity_per_layer, "replay": "fresh" if fresh else "accepted", "k": k,
                        "context": int(ctx), "ctx_over_k": int(ctx) / k,
                        "overlap": res["overlap"], "accounting": mode, "steps": len(res["tokens"]),
                        **{f"{p}_B_per_tok_layer": v for p, v in pt.items()},
                        "reuse_vs_stock": pt["stock"] / pt["reuse"],
                    "reuse_vs_stock_qrep": pt["stock_qrep"] / pt["reuse"]})
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
        pt = per_token(res, 1, True, k)
        out.append({"trace": "synthetic", "pool": capacity_per_layer, "replay": "fresh", "k": k, "context": ctx, "ctx_over_k": ctx / k,
                    "overlap": res["overlap"], "accounting": "steady", "steps": len(res["tokens"]),
                    **{f"{p}_B_per_tok_layer": v for p, v in pt.items()},
                    "reuse_vs_stock": pt["stock"] / pt["reuse"],
                    "reuse_vs_stock_qrep": pt["stock_qrep"] / pt["reuse"]})
    return out


def break_even(rows: list[dict], stock: str = "stock") -> float:
    """Overlap above which reuse moves fewer bytes than ``stock`` (linear interpolation)."""
    pts = sorted((r["overlap"], r["reuse_B_per_tok_layer"] - r[f"{stock}_B_per_tok_layer"]) for r in rows)
    for (o0, d0), (o1, d1) in zip(pts, pts[1:]):
        if d0 >= 0 > d1:
            return o0 + (o1 - o0) * d0 / (d0 - d1)
    return float("nan")


def plot(rows: list[dict], path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return False
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {"stock": "k", "selected": "tab:red", "reuse": "tab:blue"}
    names = {"stock": "stock DCP", "selected": "selected records", "reuse": "selected + reuse"}
    styles = {64: ":", 128: "-", 256: "--"}
    real = [r for r in rows if r["trace"] == "real" and r["accounting"] == "steady" and r["replay"] == "fresh"]
    for k in sorted({r["k"] for r in real}):
        rk = sorted((r for r in real if r["k"] == k), key=lambda r: r["context"])
        for kind in ("stock", "selected", "reuse"):
            a.plot([r["context"] for r in rk], [r[f"{kind}_B_per_tok_layer"] / 1e3 for r in rk],
                   styles.get(k, "-"), color=colors[kind], marker="o", ms=3,
                   label=f"{names[kind]}, k={k}" if kind != "stock" or k == 64 else None)
    a.set_xscale("log", base=2)
    a.set_xlabel("context (tokens)")
    a.set_ylabel("KB per decoded token per layer (all links, k scaled to 2048)")
    a.set_title("real traces (SmolLM2-135M top-k, MTP3, fresh-row replay)")
    a.legend(fontsize=7)
    syn = sorted((r for r in rows if r["trace"] == "synthetic"), key=lambda r: r["overlap"])
    for kind in ("stock", "selected", "reuse"):
        b.plot([r["overlap"] for r in syn], [r[f"{kind}_B_per_tok_layer"] / 1e6 for r in syn],
               color=colors[kind], marker="o", ms=3, label=names[kind])
    rf = [r for r in real if r["ctx_over_k"] >= 8]
    b.scatter([r["overlap"] for r in rf], [r["reuse_B_per_tok_layer"] / 1e6 for r in rf], s=12,
              color="tab:cyan", label="real traces, selected + reuse (ctx >= 8k)", zorder=3)
    be = break_even(syn)
    if be == be:
        b.axvline(be, color="gray", ls=":", lw=1)
        b.text(be, b.get_ylim()[1] * 0.9, f" break-even {be:.2f}", fontsize=8)
    b.set_xlabel("adjacent-position top-k overlap")
    b.set_ylabel("MB per decoded token per layer (all links)")
    b.set_title(f"synthetic, k={syn[0]['k'] if syn else '?'}, ctx={syn[0]['context'] if syn else '?'}")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="PCIe bytes per decoded token per path")
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--pool", type=float, default=4.0,
                    help="reuse pool per destination, in units of k records per layer (default 4)")
    ap.add_argument("--long-trace", default=LONG_TRACE,
                    help="one long window (448 positions) to check the pool budget over a longer decode")
    ap.add_argument("--long-pools", default="1,1.5,2,4", help="pool sizes (units of k per layer) for it")
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
            rows += real_rows(args.long_trace, pool, label="real-long")
    overlaps = (0.0, 0.5, 0.8, 0.95) if args.quick else (0.0, 0.2, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
    k = 256 if args.quick else args.syn_k
    ctx = 8192 if args.quick else args.syn_context
    rows += synthetic_rows(overlaps, ctx, k, args.syn_positions, args.pool)
    csv_path = os.path.join(args.out, "bytes_per_token.csv")
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"{'trace':<10}{'pool':>5}{'replay':>9}{'k':>5}{'ctx':>7}{'ctx/k':>7}{'overlap':>8}{'acct':>7}{'stock':>10}{'selected':>10}"
          f"{'reuse':>10}{'stock/reuse':>12}   (bytes per decoded token per layer)")
    for r in rows:
        print(f"{r['trace']:<10}{r['pool']:>5.1f}{r['replay']:>9}{r['k']:>5}{r['context']:>7}{r['ctx_over_k']:>7.0f}{r['overlap']:>8.2f}"
              f"{r['accounting']:>7}{r['stock_B_per_tok_layer']:>10.0f}{r['selected_B_per_tok_layer']:>10.0f}"
              f"{r['reuse_B_per_tok_layer']:>10.0f}{r['reuse_vs_stock']:>12.2f}")
    syn = [r for r in rows if r["trace"] == "synthetic"]
    print(f"synthetic break-even overlap (reuse = stock bytes), k={k}: {break_even(syn):.3f} (ag_rs), "
          f"{break_even(syn, 'stock_qrep'):.3f} (replicated queries, a2a)")
    real8 = [r for r in rows if r["trace"].startswith("real") and r["ctx_over_k"] >= 8]
    for (trace, pool), replay_mode, mode in itertools.product(sorted({(r["trace"], r["pool"]) for r in real8}),
                                                              ("accepted", "fresh"), ("steady", "cold")):
        sel = [r for r in real8 if r["accounting"] == mode and r["replay"] == replay_mode
               and r["trace"] == trace and r["pool"] == pool]
        for stock in ("stock", "stock_qrep") if sel else ():
            ratios = np.array([r["reuse_vs_" + stock] for r in sel])
            print(f"{trace} traces, pool {pool:g} k/layer, ctx >= 8k, replay {replay_mode}, {mode}: {stock}/reuse "
                  f"bytes ratio mean {ratios.mean():.2f} min {ratios.min():.2f} max {ratios.max():.2f} over "
                  f"{len(sel)} (k, ctx) windows")
    png = os.path.join(args.out, "bytes_per_token.png")
    if plot(rows, png):
        print("wrote", png)
    print("wrote", csv_path, f"in {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
