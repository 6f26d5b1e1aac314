"""``sparkinfer demo``: decode steps through the whole transport on four host-fabric ranks."""

from __future__ import annotations

import time

HELP = ("run TP4/DCP4/MTP3 decode steps (policy, selected records with cross-step reuse, stock DCP, dense "
        "reference, measured bytes vs accounting) on 4 CPU ranks")


def add_arguments(p) -> None:
    from sparkinfer.core.layouts import MAIN_LAYOUTS

    p.add_argument("--format", default="nvfp4_ds_mla:bf16-rope-432", choices=[l.name for l in MAIN_LAYOUTS] +
                   [l.short for l in MAIN_LAYOUTS], help="main record format")
    p.add_argument("--steps", type=int, default=3, help="consecutive decode steps of the same requests")
    p.add_argument("--mode", choices=("auto", "stock", "selected"), default=None,
                   help="policy mode (default: the profile's, overridden by VLLM_SPARKINFER_MODE)")
    p.add_argument("--hw", default="rtx_pro_6000_x4",
                   help="hardware cost profile (name in sparkinfer/hw_profiles or JSON path) the policy models")
    p.add_argument("--pool-rows", type=int, default=0,
                   help="reuse pool rows per rank (0: enough for the whole run; small values force eviction)")
    p.add_argument("--restart-step", type=int, default=-1,
                   help="before this step request 0 ends and a new request takes its slot (-1: none)")
    p.add_argument("--drift", type=float, default=0.6,
                   help="step-to-step drift of the indexer queries (0.6: ~0.7 top-k overlap between steps)")
    p.add_argument("--reuse-prior", type=float, default=0.3,
                   help="policy's prior share of remote records a warm pool still fetches (0-1)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--context", type=int, default=256, help="tokens per request")
    p.add_argument("--topk", type=int, default=32)
    p.add_argument("--heads", type=int, default=8, help="attention heads (divisible by 4)")
    p.add_argument("--depth", type=int, default=3, help="deepest prefetch ring the policy may pick")
    p.add_argument("--interleave", type=int, default=1, help="DCP interleave size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--replica-window", type=int, default=-1,
                   help="positions per request every rank keeps (replica records): -1 whole context, 0 off")
    p.add_argument("--check", action="store_true",
                   help="exit non-zero on any mismatch (outputs, workspaces, bytes vs accounting, decisions)")


def run(args) -> int:
    from dataclasses import replace

    from sparkinfer.core.layouts import canonical_name
    from sparkinfer.demo.config import DemoConfig
    from sparkinfer.demo.report import show

    cfg = DemoConfig(fmt=canonical_name(args.format), batch=args.batch, context=args.context, topk=args.topk,
                     heads=args.heads, depth=args.depth, interleave=args.interleave, seed=args.seed,
                     steps=args.steps, drift=args.drift, mode=args.mode, profile=args.hw,
                     pool_rows=args.pool_rows, restart_step=args.restart_step,
                     reuse_prior=args.reuse_prior, replica_window=args.replica_window)
    summary = run_demo(cfg)
    show(replace(cfg, mode=summary["mode"]), summary, summary["wall_s"])
    return 0 if summary["ok"] or not args.check else 1


def run_demo(cfg) -> dict:
    """Resolve the policy mode, build the inputs once, run the four ranks, return ``summarize``'s dict
    (+ ``wall_s`` and the resolved ``mode``)."""
    import os
    import tempfile

    from sparkinfer.comm.launch import run_ranks
    from sparkinfer.demo.config import resolve_demo_mode
    from sparkinfer.demo.inputs import save_inputs
    from sparkinfer.demo.rank import run_rank
    from sparkinfer.demo.report import summarize

    t = time.perf_counter()
    cfg = resolve_demo_mode(cfg)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="sparkinfer-demo-", dir=shm) as tmp:
        path = os.path.join(tmp, "inputs.pt")
        save_inputs(cfg, path)
        results = run_ranks(run_rank, cfg.world, cfg, path, timeout_s=300, pg_timeout_s=120)
    summary = summarize(cfg, results)
    summary["wall_s"] = time.perf_counter() - t
    summary["mode"] = cfg.mode
    return summary
