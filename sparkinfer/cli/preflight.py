"""``sparkinfer preflight``: check a node before serving (GPUs, P2P, node settings, library, memory).

Exit 0 when no check fails, 1 otherwise. The rules live in ``sparkinfer.preflight``.
"""

from __future__ import annotations

import argparse
import json

from sparkinfer.core.capacity import GIB, INDEXER_MODES, CapacityProfile

HELP = "check a node before serving: GPUs, P2P, IOMMU/ACS/HMM, CUDA library, memory (each failure with its fix)"

_STYLE = {"ok": "green", "warn": "yellow", "fail": "bold red", "skipped": "dim"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=int, default=4, help="GPUs the serving profile uses (default 4)")
    p.add_argument("--dcp", type=int, default=4, help="decode-context-parallel size (default 4)")
    p.add_argument("--mtp", type=int, default=3, help="speculative tokens (default 3)")
    p.add_argument("--format", default="nvfp4_368", help="main record format (default nvfp4_368)")
    p.add_argument("--indexer", choices=INDEXER_MODES, default="replicated")
    p.add_argument("--kv-gb", type=float, default=10.0, help="KV cache budget per GPU in GiB (default 10)")
    p.add_argument("--allow-cpu", action="store_true",
                   help="a machine without a CUDA device passes (host fabric only)")
    p.add_argument("--json", action="store_true", help="print the checks and the snapshot as JSON")


def run(args: argparse.Namespace) -> int:
    from sparkinfer import preflight as pf

    try:
        profile = CapacityProfile(tp=args.tp, dcp=args.dcp, mtp=args.mtp, record_format=args.format,
                                  indexer=args.indexer, kv_bytes=int(args.kv_gb * GIB))
        opts = pf.Options(tp=args.tp, allow_cpu=args.allow_cpu, profile=profile)
    except ValueError as e:
        raise SystemExit(f"sparkinfer preflight: {e}") from None
    snapshot = pf.collect()
    checks = pf.evaluate(snapshot, opts)
    if args.json:
        print(json.dumps(pf.report(snapshot, checks), indent=2))
    else:
        from rich.console import Console
        from rich.table import Table

        table = Table(title="sparkinfer preflight")
        for col in ("check", "status", "seen", "fix"):
            table.add_column(col, overflow="fold")
        for c in checks:
            table.add_row(c.name, f"[{_STYLE[c.status]}]{c.status}[/]", c.detail, c.fix)
        Console().print(table)
    return 0 if pf.passed(checks) else 1
