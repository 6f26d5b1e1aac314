"""Fit the RTX PRO 6000 profile's unmeasured parameters to the published runs and print residuals.

Fixed from measured facts (glm52-and-hardware.md): link 55 GB/s one way,
107 GB/s both ways, 0.4 us latency, ~2 us CPU per cudaMemcpyAsync, HBM
1.79 TB/s. Assumed (no published measurement): 10 us per NCCL collective
call on a PCIe-only node. Fitted by linear least squares on the ten published
step times (prior-art.md, second team, 432-byte records, MTP acceptance 0.6):
base_us, base_row_us (path-independent), exchange_us (fixed cost of their
selected-record exchange), index_ns_per_token, attn_us_per_ktok. At batch 1
every prefetched exchange hides behind compute, so the model is linear in
these five and Gauss-Newton converges in one step to the least-squares fit.

    python benchmarks/fit_costmodel.py [--write]   # --write updates sparkinfer/hw_profiles/rtx_pro_6000_x4.json
"""

from __future__ import annotations

import argparse
import os
from dataclasses import replace

import numpy as np

from sparkinfer.core import costmodel as cm

FITTED = ("base_us", "base_row_us", "exchange_us", "index_ns_per_token", "attn_us_per_ktok")


def _times(p: cm.NodeProfile, points=cm.PUBLISHED) -> np.ndarray:
    out = []
    for _, rows, ctx, path, _ in points:
        step = cm.published_step(rows, ctx, path)
        out.append(cm.step_time_us(step, p, path, 0 if path == "stock" else 3))
    return np.array(out)


def fit(p: cm.NodeProfile, points=cm.PUBLISHED, iters: int = 4) -> cm.NodeProfile:
    """Gauss-Newton on the five parameters (exact in one step where exchanges hide)."""
    target = np.array([cm.tokens_per_step(rows) / tps * 1e6 for _, rows, _, _, tps in points])
    for _ in range(iters):
        t0 = _times(p, points)
        a = np.stack([_times(replace(p, **{k: getattr(p, k) + 1.0}), points) - t0 for k in FITTED], axis=1)
        delta, *_ = np.linalg.lstsq(a, target - t0, rcond=None)
        p = replace(p, **{k: getattr(p, k) + float(v) for k, v in zip(FITTED, delta)})
    return replace(p, **{k: float(round(getattr(p, k), 4)) for k in FITTED})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="fit the RTX PRO 6000 profile to published numbers")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args(argv)
    p = cm.load_profile("rtx_pro_6000_x4")
    f = fit(p)
    print("fitted:", {k: getattr(f, k) for k in FITTED})
    print(f"{'point':<15}{'path':<10}{'published':>10}{'predicted':>11}{'resid %':>9}")
    for r in cm.residual_table(f):
        print(f"{r['point']:<15}{r['path']:<10}{r['published']:>10.1f}{r['predicted']:>11.1f}"
              f"{r['residual_pct']:>+9.2f}")
    # out of sample: fit on MTP0 (6 points) + stock MTP3 ctx 0, predict the other three MTP3 points
    train = [pt for pt in cm.PUBLISHED if pt[1] == 1 or (pt[3] == "stock" and pt[2] == 0)]
    held = fit(p, train)
    print("holdout (fit on MTP0 + stock MTP3 ctx 0):")
    for r in cm.residual_table(held):
        if not any(r["point"] == t[0] and r["path"] == t[3] for t in train):
            print(f"  {r['point']:<15}{r['path']:<10}{r['published']:>10.1f}{r['predicted']:>11.1f}"
                  f"{r['residual_pct']:>+9.2f}")
    if args.write:
        path = os.path.join(cm.PROFILE_DIR, "rtx_pro_6000_x4.json")
        f.save(path)
        print("wrote", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
