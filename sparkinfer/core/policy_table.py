"""Per-context predicted bytes and time per decode step for each path, and the policy's choice.

``policy_rows`` is torch-free and returns plain rows; ``policy_section`` and
``add_policy_arguments`` adapt it to ``sparkinfer plan``'s ``add_section`` hook
(``sparkinfer plan --profile rtx_pro_6000_x4``).
"""

from __future__ import annotations

import argparse

from sparkinfer.core import costmodel as cm
from sparkinfer.core.policy import StepPolicy

DEFAULT_CONTEXTS = (0, 4096, 16384, 65536, 131072, 262144)
PATHS = ("stock", "selected", "selected+reuse")


def policy_rows(profile: cm.NodeProfile, *, batch: int = 1, mtp: int = 3, record_format: str = "nvfp4_368",
                tp: int = 4, dcp: int = 4, union_ratio: float | None = None, new_fraction: float = 0.3,
                contexts=DEFAULT_CONTEXTS, max_depth: int = 3, env=None) -> list[dict]:
    """One dict per (context, path): bytes entering the busiest rank per step, predicted
    path time per step, and which path/depth the policy picks for that context."""
    rows = 1 + mtp
    ur = union_ratio if union_ratio is not None else (cm.UNION_RATIO_MTP3 if rows > 1 else 1.0)
    ur = min(ur, rows)
    pol = StepPolicy(profile, tp=tp, dcp=dcp, record_format=record_format, max_depth=max_depth, env=env)
    out = []
    for ctx in contexts:
        spec = cm.StepSpec(batch=batch, rows=rows, context=ctx, union_ratio=ur, record_format=record_format,
                           tp=tp, dcp=dcp)
        u = cm.selected_tokens(spec)
        chosen = pol.decide([rows] * batch, [ctx] * batch, [u] * batch, [new_fraction] * batch)
        for path in PATHS:
            if path == "stock":
                c = cm.predict(spec, profile, "stock", 0)
            else:
                nf = new_fraction if path == "selected+reuse" else 1.0
                s = cm.StepSpec(**{**spec.__dict__, "new_fraction": nf})
                c = min((cm.predict(s, profile, "selected", d) for d in range(max_depth + 1)),
                        key=lambda pc: pc.total_us)
            out.append({"context": ctx, "path": path, "depth": c.depth, "rx_MB": c.rx_bytes_per_rank / 1e6,
                        "total_MB": c.total_bytes / 1e6, "comm_us": c.comm_us, "path_us": c.total_us,
                        "decision": f"{chosen.path} d={chosen.depth}"})
    return out


def add_policy_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", default=None,
                   help="node profile (name in sparkinfer/profiles or JSON path): adds the per-path table")
    p.add_argument("--batch", type=int, default=1, help="requests per step for the per-path table")
    p.add_argument("--reuse-new", type=float, default=0.3,
                   help="share of the remote union not yet held, for selected+reuse (default 0.3)")


def policy_section(args: argparse.Namespace, plan):
    """``sparkinfer plan`` section; None without ``--profile``."""
    if getattr(args, "profile", None) is None:
        return None
    from sparkinfer.cli.plan import Section

    prof = cm.load_profile(args.profile)
    rows = policy_rows(prof, batch=args.batch, mtp=args.mtp, record_format=args.format, tp=args.tp,
                       dcp=args.dcp, new_fraction=args.reuse_new)
    table = [(f"{r['context']:,}", r["path"], str(r["depth"]), f"{r['rx_MB']:.1f}",
              f"{r['comm_us']:.0f}", f"{r['path_us']:.0f}", r["decision"] if r["path"] == "stock" else "")
             for r in rows]
    return Section(f"Predicted per decode step on {prof.name} (batch {args.batch}, MTP{args.mtp}, "
                   f"reuse new share {args.reuse_new}); mode {StepPolicy(prof, dcp=args.dcp).mode}",
                   ("context", "path", "depth", "MB in/rank", "comm us", "path us", "policy"), table)
