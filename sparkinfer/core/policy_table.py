"""Per-context predicted bytes and time per decode step for each path, and the policy's choice;
predicted decode tokens/s at the DCP size and at DCP1.

``policy_rows`` and ``decode_rows`` are torch-free and return plain rows; ``sparkinfer plan``
renders them (``sparkinfer/cli/plan.py``, ``policy_section``, ``decode_section``). The core knows
nothing of the CLI.
"""

from __future__ import annotations

from dataclasses import replace

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



DECODE_CONTEXTS = (0, 65536, 262144)
DECODE_BATCHES = (1, 8)


def decode_rows(profiles: dict, *, mtp: int = 3, record_format: str = "nvfp4_368", tp: int = 4, dcp: int = 4,
                contexts=DECODE_CONTEXTS, batches=DECODE_BATCHES, max_depth: int = 3, env=None) -> list[dict]:
    """Predicted decode speed per (kernels, batch, context, DCP size): at ``dcp`` the path and depth
    the policy picks (no reuse: every remote record moves), at DCP1 (same TP) the step without an
    exchange or a collective. ``profiles``: {label: node profile of ``dcp`` GPUs}. Tokens per step
    per request: ``costmodel.tokens_per_step`` (MTP acceptance ``costmodel.MTP_ACCEPT`` per draft,
    chain)."""
    rows = 1 + mtp
    ur = min(cm.UNION_RATIO_MTP3 if rows > 1 else 1.0, rows)
    tokens = cm.tokens_per_step(rows)
    out = []
    for label, prof in profiles.items():
        pol = StepPolicy(prof, tp=tp, dcp=dcp, record_format=record_format, max_depth=max_depth, env=env)
        one = replace(prof, world_size=1)
        for batch in batches:
            for ctx in contexts:
                for d in dict.fromkeys((dcp, 1)):
                    spec = cm.StepSpec(batch=batch, rows=rows, context=ctx, union_ratio=ur,
                                       record_format=record_format, tp=tp, dcp=d)
                    if d == 1:
                        path, depth, p = "stock", 0, one  # DCP1: nothing to exchange, no collective
                        choice = "no DCP"
                    else:
                        u = cm.selected_tokens(spec)
                        c = pol.decide([rows] * batch, [ctx] * batch, [u] * batch)
                        path, depth, p = c.path, c.depth, prof
                        choice = f"{c.path} d={c.depth}"
                    us = cm.step_time_us(spec, p, path, depth)
                    out.append({"kernels": label, "batch": batch, "context": ctx, "tp": tp, "dcp": d,
                                "path": choice, "step_us": us, "tok_s_request": tokens / us * 1e6,
                                "tok_s_total": batch * tokens / us * 1e6})
    return out
