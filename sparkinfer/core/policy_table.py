"""Per-context predicted bytes and time per decode step for each path, and the policy's choice.

``policy_rows`` is torch-free and returns plain rows; ``sparkinfer plan`` renders them
(``sparkinfer/cli/plan.py``, ``policy_section``). The core knows nothing of the CLI.
"""

from __future__ import annotations

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

