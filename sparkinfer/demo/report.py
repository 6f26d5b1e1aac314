"""Aggregate the four ranks' results of the demo run, check them, and print the per-step table."""

from __future__ import annotations

from sparkinfer.formats import get_format

from .config import DemoConfig

PATHS = ("stock", "selected", "reuse", "replica")


def summarize(cfg: DemoConfig, results: list[dict]) -> dict:
    """Per step: the policy's choice, bytes per path (measured; the byte matrices are all-gathered
    so every rank holds the same), whether they equal the accounting, union ratio, top-k overlap
    with the previous step, reuse hit rate, worst errors over all ranks. ``ok`` is the --check verdict."""
    tol, tol_stock = results[0]["tol"], results[0]["tol_stock"]
    rows, problems = [], []
    for si, s0 in enumerate(results[0]["steps"]):
        ss = [r["steps"][si] for r in results]
        bytes_ok = {p: all(s["measured"][p] == s["accounted"][p] for s in ss) for p in PATHS}
        copies_ok = all(m == a for s in ss for m, a in s["copies"].values())
        row = {
            "step": si, "path": s0["path"], "depth": s0["depth"], "reason": s0["reason"],
            "stock_us": s0["stock_us"], "selected_us": s0["selected_us"], "horizon": s0["horizon"],
            "plan_stock_us": s0["plan_stock_us"], "plan_selected_us": s0["plan_selected_us"],
            "bytes": {p: sum(map(sum, s0["measured"][p])) for p in PATHS},
            "stock_qrep": s0["stock_qrep"],
            "accounted": {p: sum(map(sum, s0["accounted"][p])) for p in PATHS},
            "bytes_ok": bytes_ok, "copies_ok": copies_ok, "copies": s0["copies"],
            "union_ratio": s0["union_ratio"], "overlap": s0["overlap"],
            "hit_rate": s0["hit_rate"], "accepted": s0["accepted"],
            "pool_rows": max(s["pool_rows"] for s in ss),
            "err_selected": max(s["err_selected"] for s in ss), "err_stock": max(s["err_stock"] for s in ss),
            "workspace_exact": all(s["workspace_exact"] for s in ss),
            "decision_agreed": all(s["decision_agreed"] for s in ss),
            "restart": s0.get("restart"),
            "replica_exchanges": s0["replica_exchanges"], "replica_held": s0["replica_held"],
        }
        rows.append(row)
        why = [f"{p} bytes measured {row['bytes'][p]:,} != accounted {row['accounted'][p]:,} (or per pair)"
               for p in PATHS if not bytes_ok[p]]
        if not copies_ok:
            why.append("non-empty copies (measured, accounted) differ: "
                       f"{[s['copies'] for s in ss if any(m != a for m, a in s['copies'].values())][0]}")
        if row["err_selected"] > tol:
            why.append(f"selected max error {row['err_selected']:.1e} > {tol:g}")
        if row["err_stock"] > tol_stock:
            why.append(f"stock max error {row['err_stock']:.1e} > {tol_stock:g}")
        if not row["workspace_exact"]:
            why.append("a workspace differs from the gather from the unsharded cache")
        dropped = max(s["spec_dropped"] for s in ss)
        if dropped:
            why.append(f"the reuse pools held {dropped} records at rejected draft positions")
        if not row["decision_agreed"]:
            why.append("ranks reached different policy decisions")
        if not all(x["sharded_equal"] for x in ss):
            why.append("sharded scoring's merged top-k differs from the replicated top-k")
        problems += [f"step {si}: {w}" for w in why]
    if not all(r["topk_identical"] for r in results):
        problems.append("top-k differs between ranks")
    if not all(r["pools_empty"] for r in results):
        problems.append("reuse pools not empty after every request ended")
    times = {k: max(r["times"].get(k, 0.0) for r in results) for k in results[0]["times"]}
    return {"rows": rows, "times": times, "tol": tol, "tol_stock": tol_stock, "problems": problems, "ok": not problems,
            "topk_identical": all(r["topk_identical"] for r in results),
            "sharded_equal": all(st["sharded_equal"] for r in results for st in r["steps"])}


def show(cfg: DemoConfig, summary: dict, wall_s: float) -> None:
    from rich.console import Console
    from rich.table import Table

    fmt = get_format(cfg.fmt)
    con = Console(width=230)
    con.print(f"sparkinfer demo: TP{cfg.world}/DCP{cfg.world}/MTP{cfg.mtp}, {cfg.pattern.num_layers} layers "
              f"(GLM-5.2 pattern + MTP layer), {cfg.fmt} ({fmt.record_bytes} B), batch {cfg.batch}, "
              f"context {cfg.context}, top-k {cfg.topk}, {cfg.heads} heads ({cfg.local_heads}/rank), "
              f"max prefetch depth {cfg.depth}, {cfg.steps} steps, profile {cfg.profile}, mode {cfg.mode}, reuse pool "
              f"{cfg.reuse_capacity} rows/rank; host fabric, 4 processes")
    t = Table(title="per decode step: bytes over all (src, dst) pairs, measured (= accounting where 'ok'); "
                    "overlap: share of the top-k union already in the previous step's; hits: remote union "
                    "records the destination's pool held")
    for c in ("step", "policy", "stock B", "qrep+a2a B", "selected B", "sel+reuse B", "/stock", "/qrep",
              "replicas B", "rep/qrep", "exch run/skip", "bytes", "union/k", "overlap", "hits", "accepted", "pool",
              "err sel", "err stock"):
        t.add_column(c, justify="right", no_wrap=True)
    for r in summary["rows"]:
        b = r["bytes"]
        t.add_row(str(r["step"]), f"{r['path']} d{r['depth']}", f"{b['stock']:,}", f"{r['stock_qrep']:,}",
                  f"{b['selected']:,}", f"{b['reuse']:,}", f"{b['reuse'] / max(1, b['stock']):.2f}x",
                  f"{b['reuse'] / max(1, r['stock_qrep']):.2f}x", f"{b['replica']:,}",
                  f"{b['replica'] / max(1, r['stock_qrep']):.2f}x", "{}/{}".format(*r["replica_exchanges"]),
                  "ok" if all(r["bytes_ok"].values()) and r["copies_ok"] else "MISMATCH", f"{r['union_ratio']:.2f}",
                  "-" if r["overlap"] is None else f"{r['overlap']:.2f}", f"{r['hit_rate']:.0%}",
                  ",".join(map(str, r["accepted"])), str(r["pool_rows"]), f"{r['err_selected']:.1e}",
                  f"{r['err_stock']:.1e}")
    con.print(t)
    for r in summary["rows"]:
        con.print(f"step {r['step']} policy: {r['path']} (depth {r['depth']}): {r['reason']}; modelled "
                  f"stock {r['stock_us']:.1f} us vs selected {r['selected_us']:.1f} us this step"
                  + (f", {r['plan_stock_us']:.1f} us vs {r['plan_selected_us']:.1f} us over {r['horizon']} steps"
                     if r["horizon"] > 1 else "")
                  + f"; same on all ranks: {r['decision_agreed']}")
    for r in summary["rows"]:
        if r["restart"]:
            x = r["restart"]
            con.print(f"before step {r['step']}: request {x['ended']} ended (drop_request freed {x['dropped']} "
                      f"entries from the {cfg.world} pools); request {x['new']} took its batch slot and KV blocks")
    if all(r["path"] == "stock" for r in summary["rows"]):
        con.print("every step went stock: the reuse pools only keep records of steps that moved them "
                  "(--mode selected or another --hw shows the reuse path filling workspaces from them)")
    tt = Table(title="time per stage (slowest rank, all steps)")
    tt.add_column("stage")
    tt.add_column("seconds", justify="right")
    for k, v in summary["times"].items():
        tt.add_row(k, f"{v:.3f}")
    tt.add_row("wall (spawn + all)", f"{wall_s:.1f}")
    con.print(tt)
    con.print("bytes: selected = plain selected-record exchange, selected+reuse = the exchange whose planes "
              "omit records the destination holds (both counted by the host fabric's copy thread), stock DCP = "
              "vLLM's ag_rs tensors (query all-gather, LSE all-gather, output reduce-scatter; bf16 queries and "
              "partial outputs, fp32 LSE) counted at the gloo calls; each compared per (src, dst) pair with "
              "sparkinfer.core.accounting. qrep+a2a = stock DCP as vLLM 0.32 runs GLM-MoE-DSA by default "
              "(every rank computes every head's query, one all-to-all of outputs and LSE), accounted, not "
              "run; /stock and /qrep = sel+reuse over each. replicas = the exchange whose planes also omit what "
              f"every rank's replica store holds (the last {cfg.window} positions of each request, written at "
              "every cache write, and the step's own rows): exch run/skip = its layered exchanges run and "
              "skipped because every record was local. Every step "
              "runs all paths; the policy's path is the one whose records the reuse pools keep.")
    verdict = "PASS" if summary["ok"] else "FAIL"
    con.print(f"{verdict}: tolerance {summary['tol']:g} selected, {summary['tol_stock']:g} stock (bf16 partials), "
              f"relative to 1 + max|ref|; top-k identical on all ranks: "
              f"{summary['topk_identical']}; sharded scoring gives the same top-k: {summary['sharded_equal']}; "
              f"workspaces bit-exact vs the unsharded cache: "
              f"{all(r['workspace_exact'] for r in summary['rows'])}; problems: {len(summary['problems'])}")
    for p in summary["problems"][:20]:
        con.print(f"  {p}")
