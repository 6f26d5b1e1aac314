"""``sparkinfer demo``: one decode step through the whole transport on four host-fabric ranks."""

from __future__ import annotations

import time

HELP = "run one TP4/DCP4/MTP3 decode step (selected records vs stock DCP vs dense reference) on 4 CPU ranks"


def add_arguments(p) -> None:
    from sparkinfer.core.layouts import MAIN_LAYOUTS

    p.add_argument("--format", default="nvfp4_ds_mla:bf16-rope-432", choices=[l.name for l in MAIN_LAYOUTS] +
                   [l.short for l in MAIN_LAYOUTS], help="main record format")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--context", type=int, default=256, help="tokens per request")
    p.add_argument("--topk", type=int, default=32)
    p.add_argument("--heads", type=int, default=8, help="attention heads (divisible by 4)")
    p.add_argument("--depth", type=int, default=3, help="prefetch ring depth")
    p.add_argument("--interleave", type=int, default=1, help="DCP interleave size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true", help="exit non-zero if any output mismatches the reference")


def run(args) -> int:
    from sparkinfer.core.layouts import canonical_name
    from sparkinfer.demo.config import DemoConfig
    from sparkinfer.demo.report import show

    cfg = DemoConfig(fmt=canonical_name(args.format), batch=args.batch, context=args.context, topk=args.topk,
                     heads=args.heads, depth=args.depth, interleave=args.interleave, seed=args.seed)
    summary = run_demo(cfg)
    show(cfg, summary, summary["wall_s"])
    return 0 if summary["ok"] or not args.check else 1


def run_demo(cfg) -> dict:
    """Build the inputs once, run the four ranks, return ``summarize``'s dict (+ ``wall_s``)."""
    import os
    import tempfile

    from sparkinfer.comm.launch import run_ranks
    from sparkinfer.demo.inputs import save_inputs
    from sparkinfer.demo.rank import run_rank
    from sparkinfer.demo.report import summarize

    t = time.perf_counter()
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="sparkinfer-demo-", dir=shm) as tmp:
        path = os.path.join(tmp, "inputs.pt")
        save_inputs(cfg, path)
        results = run_ranks(run_rank, cfg.world, cfg, path, timeout_s=300, pg_timeout_s=120)
    summary = summarize(cfg, results)
    summary["wall_s"] = time.perf_counter() - t
    return summary
