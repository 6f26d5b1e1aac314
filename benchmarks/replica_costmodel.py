"""Predicted decode tokens/s with replica records: TP4, MTP3, batch 1 and 8, contexts 0 to 1M.

Everything here is the cost model (``sparkinfer/core/costmodel.py``) and the policy
(``sparkinfer/core/policy.py``) on the fitted ``rtx_pro_6000_x4`` profile; nothing is measured.
Lines (per request context ``c``, every request of the batch at ``c``):

* **DCP1 stock**: TP4/DCP1, no DCP collective: the path-independent base + indexer (every rank
  scores the whole context) + sparse attention over the top-k (16 local heads x k per row, the
  same FLOPs as the selected path). Drawn where the context fits DCP1's KV capacity.
* **DCP4 stock, qrep + a2a**: vLLM 0.32's default for GLM-MoE-DSA (queries replicated, one
  all-to-all of outputs + LSE per layer), two indexers: ``replicated`` (sparkinfer's stock path,
  the policy's oracle) and ``sharded`` (vLLM's own default: every rank scores 1/4 of the context,
  plus a top-k candidate merge per Full layer; its cache holds 1/4 of the indexer keys).
* **DCP4 selected + reuse**: the selected path at its best prefetch depth (0..3), forced, with the
  reuse pool's steady miss share ``new`` (below) and the step's indexer scoring (next line).
* **DCP4 replicas (auto)**: a replica store of ``--replica-share`` of the KV budget per rank
  (counted inside it, so the line ends at a lower max context), window ``W`` positions per request
  (``core/replicas.window_for_budget`` over the 78 target layers x 368 B x batch: the MTP layer's
  records are not held). A step with ``c + 4 <= W`` holds every record (no exchange); beyond, the
  share of the remote union that moves at window fraction ``w = W / c`` is the trace measurement
  of ``bytes_per_token.py`` (below). The policy
  (``StepPolicy.decide`` with ``held_fraction``) picks stock or selected per step; the line is the
  chosen path's time, which includes the replica writes on both paths. Its indexer scoring is the
  engine's ``indexer_scoring = auto``: per step ``costmodel.choose_indexer`` (over the batch's
  rows x context, DCP 4) picks ``replicated`` (every rank scores the whole context from its
  replicated keys) or ``sharded`` (each rank scores its quarter, then a top-k candidate
  all-gather per Full layer: the same merged top-k on every rank), and that scoring applies to
  whichever path the policy took. Scoring costs both paths the same, so it leaves the path choice
  as it is. Column ``indexer_scoring`` is the choice.

Assumed parameters (printed in the header):
* profile ``rtx_pro_6000_x4`` (fitted base, exchange, indexer and attention terms; measured link);
* MTP3, chain acceptance ``costmodel.MTP_ACCEPT`` = 0.6 per draft: 2.176 tokens per step per request;
  union of the 4 rows ``costmodel.UNION_RATIO_MTP3`` = 1.75 k, k = 2048, 368-byte records;
* KV budget per GPU ``--kv-gb`` (default 10 GiB, the plan / serve-profile default), replicated
  indexer unless said, 64-token pages (``core/capacity.py``);
* replica store ``--replica-share`` of it (default 0.2, the most ``replica_window = auto`` reserves,
  ``sparkinfer/vllm/replica_budget.py``): the rest stays for the DCP4 shards; one ring per request
  of the batch (the engine keeps ``max_num_seqs`` rings, so a deployment's window is this table's
  at batch = ``max_num_seqs``);
* moving share of the remote union at window fraction ``w``: from
  ``benchmarks/results/bytes_per_token.csv`` (real traces, ``--replay`` fresh = pessimistic,
  steady, ctx/k >= 8, sum of replica bytes / sum of plain selected bytes per window), linear in
  ``w`` between the measured windows 0, 1/16, 1/8, 1/4 and 0 at ``w = 1`` (the context fits), with
  ``w = (W - 4) / c`` (the committed positions a step holds); the
  reuse pool's share ``new`` is the ``w = 0`` point, and ``held = 1 - share(w) / new``;
* per-group exchange skips (a Full layer's group with no remote record while others have some)
  are not modelled: any moving record prices every exchange (conservative for replicas);
* the replica write rides the cache-write kernel (HBM bytes only, no launch of its own); attention
  reads replica-held records in place (no gather copy; a copy of the union would add ~2 x union x
  368 B per layer at HBM rate, printed below).

Writes ``replica_costmodel.csv`` and ``replica_costmodel.png`` (``--out``) and prints the targets:
within 5% of DCP1 wherever the context fits the replica window (and DCP1), never below either
DCP4 stock line beyond it (up to DCP4-with-replicas' max context), with the worst ratio.
"""

from __future__ import annotations

import argparse
import csv
import os
from dataclasses import replace

import numpy as np

from sparkinfer.core import costmodel as cm
from sparkinfer.core.capacity import GIB, CapacityProfile, capacity_plan, replica_capacity
from sparkinfer.core.geometry import GLM52
from sparkinfer.core.policy import StepPolicy
from sparkinfer.core.replicas import store_bytes, write_hbm_bytes

from bytes_per_token import pyplot, write_csv  # benchmarks/ (the script's directory)

HERE = os.path.dirname(os.path.abspath(__file__))
BYTES_CSV = os.path.join(HERE, "results", "bytes_per_token.csv")
ROWS, FMT, RECORD, DEPTHS = 4, "nvfp4_368", 368, 4
MEASURED = (0.0, 1 / 16, 1 / 8, 1 / 4)


def moving_share_curve(path: str, replay: str) -> dict:
    """{window fraction: share of the remote union that moves} from bytes_per_token's CSV."""
    if not os.path.exists(path):
        raise SystemExit(f"{path} not found: run benchmarks/bytes_per_token.py first (it measures the moving share)")
    with open(path) as f:
        rows = [r for r in csv.DictReader(f) if r["trace"] == "real" and r["replay"] == replay
                and r["accounting"] == "steady" and float(r["ctx_over_k"]) >= 8 and r.get("window", "") != ""]
    out = {}
    for w in MEASURED:
        sel = [r for r in rows if abs(float(r["window"]) - w) < 1e-9]
        if not sel:
            raise SystemExit(f"{path} has no replica rows for window {w:g}: regenerate it with bytes_per_token.py")
        out[w] = sum(float(r["replica_B_per_tok_layer"]) for r in sel) / sum(
            float(r["selected_B_per_tok_layer"]) for r in sel)
    out[1.0] = 0.0
    return out


def share_at(curve: dict, w: float) -> float:
    xs = sorted(curve)
    return float(np.interp(min(w, 1.0), xs, [curve[x] for x in xs]))


def spec(batch: int, ctx: int, **kw) -> cm.StepSpec:
    return cm.StepSpec(batch=batch, rows=ROWS, context=ctx, union_ratio=cm.UNION_RATIO_MTP3, record_format=FMT,
                       backend="a2a", q_replicated=True, **kw)


def tok_s(batch: int, step_us: float) -> float:
    return batch * cm.tokens_per_step(ROWS) / step_us * 1e6


def base_us(p: cm.NodeProfile, batch: int) -> float:
    return p.base_us + p.base_row_us * (batch * ROWS - 1)


def rows_for(p, batch, contexts, curve, kv, share) -> list[dict]:
    prof = CapacityProfile(tp=4, dcp=4, mtp=3, record_format=FMT, indexer="replicated", kv_bytes=kv)
    cap = replica_capacity(prof, batch, int(share * kv))
    sharded_max = capacity_plan(replace(prof, indexer="sharded")).kv_tokens // batch
    new = curve[0.0]
    pol = StepPolicy(p, record_format=FMT, backend="a2a", q_replicated=True, max_depth=DEPTHS - 1, env={})
    out = []
    for c in contexts:
        s = spec(batch, c)
        st = cm.predict(s, p, "stock", 0)
        shd = cm.predict(spec(batch, c, indexer="sharded"), p, "stock", 0)
        # the engine's indexer_scoring = auto; it costs stock and selected alike, so the policy's
        # path choice (which leaves scoring out) stands and the chosen path is priced with it
        # as the engine decides (indexer_scoring.py): row i of a request at context c scores c + i + 1 tokens
        scoring = cm.choose_indexer(p, batch * (ROWS * c + ROWS * (ROWS + 1) / 2), batch * ROWS, s.dcp)
        reuse = min((cm.predict(replace(s, new_fraction=new, indexer=scoring), p, "selected", d)
                     for d in range(DEPTHS)), key=lambda pc: pc.total_us)
        local = c + ROWS <= cap.window
        w = max(0, cap.window - ROWS) / c if c else 1.0  # held committed share; < 1 when not all local
        held = 1.0 if local else max(0.0, 1.0 - share_at(curve, w) / new)
        u = cm.selected_tokens(s)
        d = pol.decide([ROWS] * batch, [c] * batch, [u] * batch, [new] * batch, held_fraction=[held] * batch)
        rs = replace(s, new_fraction=new, held_fraction=held)
        rep = cm.predict(replace(rs, indexer=scoring), p, d.path, d.depth)
        b = base_us(p, batch)
        dcp1 = b + st.indexer_us + st.attn_us
        out.append({
            "batch": batch, "context": c, "kv_gib": kv / GIB, "replica_share": share, "window": cap.window,
            "window_fraction": min(1.0, cap.window / c) if c else 1.0, "all_local": local, "held_fraction": held,
            "moving_share": 0.0 if local else (1 - held) * new,
            "dcp1_max_context": cap.dcp1_max_context, "dcp4_max_context": cap.dcp_max_context,
            "dcp4_sharded_max_context": sharded_max, "replica_max_context": cap.replica_max_context,
            "dcp1_tok_s": tok_s(batch, dcp1) if c <= cap.dcp1_max_context else float("nan"),
            "dcp4_stock_tok_s": tok_s(batch, b + st.total_us) if c <= cap.dcp_max_context else float("nan"),
            "dcp4_stock_sharded_tok_s": tok_s(batch, b + shd.total_us) if c <= sharded_max else float("nan"),
            "dcp4_selected_reuse_tok_s": tok_s(batch, b + reuse.total_us) if c <= cap.dcp_max_context
            else float("nan"),
            "dcp4_replicas_tok_s": tok_s(batch, b + rep.total_us) if c <= cap.replica_max_context else float("nan"),
            "replica_path": f"{d.path} d={d.depth}", "indexer_scoring": scoring, "replica_write_us": rep.write_us,
            "replica_rx_MB_per_step": rep.rx_bytes_per_rank / 1e6, "stock_rx_MB_per_step": st.rx_bytes_per_rank / 1e6,
        })
    return out


def check_targets(rows: list[dict]) -> list[str]:
    lines = []
    for batch in sorted({r["batch"] for r in rows}):
        rb = [r for r in rows if r["batch"] == batch]
        fit = [r for r in rb if r["all_local"] and r["dcp1_tok_s"] == r["dcp1_tok_s"]
               and r["dcp4_replicas_tok_s"] == r["dcp4_replicas_tok_s"]]
        if fit:
            worst = min(fit, key=lambda r: r["dcp4_replicas_tok_s"] / r["dcp1_tok_s"])
            ratio = worst["dcp4_replicas_tok_s"] / worst["dcp1_tok_s"]
            lines.append(f"batch {batch}: contexts that fit the window (<= {max(r['context'] for r in fit):,}): "
                         f"replicas / DCP1 >= {ratio:.5f} (at {worst['context']:,}) -> "
                         f"{'met' if ratio >= 0.95 else 'NOT met'} (target >= 0.95)")
        for col, name in (("dcp4_stock_tok_s", "DCP4 stock (replicated indexer)"),
                          ("dcp4_stock_sharded_tok_s", "DCP4 stock (vLLM default, sharded indexer)")):
            beyond = [r for r in rb if not r["all_local"] and r["dcp4_replicas_tok_s"] == r["dcp4_replicas_tok_s"]
                      and r[col] == r[col]]
            if not beyond:
                continue
            worst = min(beyond, key=lambda r: r["dcp4_replicas_tok_s"] / r[col])
            ratio = worst["dcp4_replicas_tok_s"] / worst[col]
            below = [r["context"] for r in beyond if r["dcp4_replicas_tok_s"] < r[col]]
            # the replica write is the one cost the stock lines (no store) do not pay
            step_us = batch * cm.tokens_per_step(ROWS) / worst["dcp4_replicas_tok_s"] * 1e6
            no_write = tok_s(batch, step_us - worst["replica_write_us"]) / worst[col]
            verdict = "met" if not below else (
                f"below at {len(below)} of {len(beyond)} contexts ({min(below):,} to {max(below):,}) by up to "
                f"{(1 - ratio) * 100:.2g}%; without the replica write {no_write:.6f}")
            lines.append(f"batch {batch}: beyond the window ({beyond[0]['context']:,} to {beyond[-1]['context']:,}): "
                         f"replicas / {name} >= {ratio:.6f} (at {worst['context']:,}, {worst['replica_path']}, "
                         f"{worst['indexer_scoring']} scoring) -> {verdict}")
    return lines


def plot(rows: list[dict], path: str) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(7 * len(batches), 4.8))
    lines = (("dcp1_tok_s", "DCP1 stock", dict(color="k", lw=4, alpha=0.35)),
             ("dcp4_stock_tok_s", "DCP4 stock qrep+a2a (replicated indexer)", dict(color="tab:gray")),
             ("dcp4_stock_sharded_tok_s", "DCP4 stock qrep+a2a (vLLM default, sharded indexer)",
              dict(color="tab:gray", ls="--")),
             ("dcp4_selected_reuse_tok_s", "DCP4 selected + reuse (forced; scoring per step)",
              dict(color="tab:blue", ls=":")),
             ("dcp4_replicas_tok_s", "DCP4 replicas + reuse (auto; scoring per step)", dict(color="tab:green", lw=2)))
    for ax, batch in zip(np.atleast_1d(axes), batches):
        rb = sorted((r for r in rows if r["batch"] == batch), key=lambda r: r["context"])
        x = [max(r["context"], 512) for r in rb]
        for col, label, style in lines:
            ax.plot(x, [r[col] for r in rb], label=label, **style)
        win = rb[0]["window"]
        ax.axvline(max(win - ROWS, 512), color="tab:green", ls=":", lw=1)
        ax.text(max(win - ROWS, 512), ax.get_ylim()[0], f" window {win:,}", fontsize=7, color="tab:green",
                rotation=90, va="bottom")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context per request (tokens; 0 drawn at 512)")
        ax.set_ylabel("predicted decode tok/s (all requests)")
        ax.set_title(f"TP4 MTP3, batch {batch}, KV {rb[0]['kv_gib']:g} GiB/GPU, replicas "
                     f"{rb[0]['replica_share']:.0%} of it (cost model)", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="predicted decode tok/s with replica records (cost model)")
    ap.add_argument("--hw", default="rtx_pro_6000_x4", help="hardware cost profile (name or JSON path)")
    ap.add_argument("--kv-gb", type=float, default=10.0, help="KV budget per GPU, GiB (default 10)")
    ap.add_argument("--replica-share", type=float, default=0.2,
                    help="share of the KV budget given to the replica store (default 0.2, the auto share)")
    ap.add_argument("--replay", choices=("fresh", "accepted"), default="fresh",
                    help="which bytes_per_token replay gives the moving share (fresh: pessimistic)")
    ap.add_argument("--bytes-csv", default=BYTES_CSV)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args(argv)
    if not 0.0 <= args.replica_share < 1.0:
        raise SystemExit("--replica-share must be in [0, 1)")
    p = cm.load_profile(args.hw)
    kv = int(args.kv_gb * GIB)
    curve = moving_share_curve(args.bytes_csv, args.replay)
    layers = GLM52.num_layers  # the store holds the target layers (the MTP layer's records are not replicated)
    print(f"profile {p.name}: base {p.base_us:.0f} us + {p.base_row_us:.0f} us/row, exchange {p.exchange_us:.1f} us, "
          f"copy {p.copy_us} us, collective {p.collective_us} us, link {p.bw_dir_GBps}/{p.bw_bidir_GBps} GB/s, "
          f"HBM {p.hbm_GBps} GB/s, indexer {p.index_ns_per_token} ns/token, attention {p.attn_us_per_ktok} us/ktok")
    print(f"TP4, MTP3 (acceptance {cm.MTP_ACCEPT} per draft, chain: {cm.tokens_per_step(ROWS):.3f} tokens/step), "
          f"union {cm.UNION_RATIO_MTP3} k, k {GLM52.topk}, {RECORD}-byte records, {layers} replicated layers, "
          "prefetch 0..3")
    print(f"KV budget {args.kv_gb:g} GiB per GPU; replica store {args.replica_share:.0%} of it "
          f"({args.replica_share * args.kv_gb:g} GiB per rank, inside the budget)")
    print(f"moving share of the remote union vs replica window fraction ({args.replay} replay, steady, ctx/k >= 8, "
          f"from {os.path.relpath(args.bytes_csv, HERE)}): "
          + ", ".join(f"{w:g}: {s:.3f}" for w, s in sorted(curve.items())) + f"; reuse pool new share {curve[0.0]:.3f}")
    per_pos = write_hbm_bytes(RECORD, layers)
    print(f"replica write: {per_pos:,} B per token per rank ({per_pos * ROWS / (p.hbm_GBps * 1e3) * 1e3:.0f} ns per "
          f"request-step of {ROWS} rows at HBM rate); a gather copy of the union (not assumed) would cost "
          f"{2 * cm.UNION_RATIO_MTP3 * GLM52.topk * RECORD * layers / (p.hbm_GBps * 1e3):.0f} us per request-step")
    print("\nreplica memory per rank per request (every layer's ring, 368 B records):")
    ctxs = (8192, 32768, 131072, 262144, 1 << 20)
    print(f"{'window':>10}" + "".join(f"{c:>12,}" for c in ctxs) + "   (context; MiB)")
    mem_rows = []
    for frac in (1 / 16, 1 / 8, 1 / 4, 1.0):
        vals = [store_bytes(int(frac * c) + (ROWS if frac == 1.0 else 0), 1, layers, RECORD) for c in ctxs]
        name = "fits" if frac == 1.0 else f"1/{round(1 / frac)}"
        print(f"{name:>10}" + "".join(f"{v / 2**20:>12,.1f}" for v in vals))
        mem_rows += [{"window": name, "context": c, "MiB_per_rank_per_request": v / 2**20} for c, v in zip(ctxs, vals)]
    contexts = sorted({0, *(int(x) for x in np.geomspace(1024, 1 << 20, 41))})
    rows = []
    for batch in (1, 8):
        cap = replica_capacity(CapacityProfile(tp=4, dcp=4, mtp=3, record_format=FMT, indexer="replicated",
                                               kv_bytes=kv), batch, int(args.replica_share * kv))
        extra = {cap.local_context, cap.local_context + 1, cap.dcp1_max_context, cap.replica_max_context}
        print(f"\nbatch {batch}: window {cap.window:,} positions per request, every record local up to context "
              f"{cap.local_context:,}; max context per request: DCP1 {cap.dcp1_max_context:,}, DCP4 "
              f"{cap.dcp_max_context:,}, DCP4 with replicas {cap.replica_max_context:,}; store "
              f"{cap.store_bytes / GIB:.2f} GiB per rank ({cap.store_bytes_per_request / 2**20:,.0f} MiB per request); "
              f"sharded indexer scoring from context {cm.sharded_scoring_from(p, batch, ROWS, 4):,}")
        rows += rows_for(p, batch, sorted(set(contexts) | extra), curve, kv, args.replica_share)
    print(f"\n{'batch':>5}{'context':>10}{'DCP1':>8}{'stock':>8}{'stock sh':>9}{'sel+re':>8}{'replica':>8}"
          f"{'path':>14}{'scoring':>11}{'held':>6}   (tok/s)")
    for r in rows:
        if r["context"] in (0, 4096, 16384, 65536, 131072, 262144, 524288, 1048576) or r["context"] in (
                r["window"] - ROWS, r["window"] - ROWS + 1):
            print(f"{r['batch']:>5}{r['context']:>10,}{r['dcp1_tok_s']:>8.1f}{r['dcp4_stock_tok_s']:>8.1f}"
                  f"{r['dcp4_stock_sharded_tok_s']:>9.1f}{r['dcp4_selected_reuse_tok_s']:>8.1f}"
                  f"{r['dcp4_replicas_tok_s']:>8.1f}{r['replica_path']:>14}{r['indexer_scoring']:>11}"
                  f"{r['held_fraction']:>6.2f}")
    print("\ntargets:")
    for line in check_targets(rows):
        print(" ", line)
    os.makedirs(args.out, exist_ok=True)
    csv_path = os.path.join(args.out, "replica_costmodel.csv")
    write_csv(csv_path, rows)
    mem_path = os.path.join(args.out, "replica_memory.csv")
    write_csv(mem_path, mem_rows)
    png = os.path.join(args.out, "replica_costmodel.png")
    if plot(rows, png):
        print("wrote", png)
    print("wrote", csv_path, "and", mem_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
