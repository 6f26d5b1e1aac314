"""Host time of one policy decision (budget: well under 10 us for a batch of 8), and of the
Python reference ReuseTracker per layer for scale.

    python benchmarks/policy_bench.py [--hw rtx_pro_6000_x4] [--batch 8]

Prints the median and p99 of per-call wall time over many repetitions
(``time.perf_counter_ns``, one call per sample, after a warm-up).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from sparkinfer.core import costmodel as cm
from sparkinfer.core.policy import StepPolicy
from sparkinfer.core.reuse import ReuseTracker
from sparkinfer.core.topology import DcpLayout


def _cpu_us(fn, n: int, repeats: int = 5) -> float:
    """CPU time per call (``time.process_time``), the least of ``repeats`` runs of ``n // repeats``
    calls: what the call costs the host, without the time it waited for a core and with less of
    the cache/SMT disturbance other processes add on a loaded machine."""
    best = float("inf")
    for _ in range(repeats):
        t = time.process_time()
        for _ in range(n // repeats):
            fn()
        best = min(best, (time.process_time() - t) / (n // repeats) * 1e6)
    return best


def _time_calls(fn, n: int) -> np.ndarray:
    for _ in range(min(n, 1000)):
        fn()
    out = np.empty(n)
    for i in range(n):
        t = time.perf_counter_ns()
        fn()
        out[i] = time.perf_counter_ns() - t
    return out / 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hw", default="rtx_pro_6000_x4", help="hardware cost profile (name or JSON path)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--n", type=int, default=20000)
    args = ap.parse_args(argv)
    p = cm.load_profile(args.hw)
    pol = StepPolicy(p, env={})
    b = args.batch
    rows, ctx = [4] * b, [65536 + 977 * i for i in range(b)]
    union, nf = [3584.0 - 11 * i for i in range(b)], [0.3 + 0.01 * i for i in range(b)]
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs (wall times include waiting for a core)")
    for label, fn in ((f"union + reuse given", lambda: pol.decide(rows, ctx, union, nf)),
                      ("defaults (no union / reuse given)", lambda: pol.decide(rows, ctx)),
                      ("cold pool amortised over 64 steps", lambda: pol.decide(rows, ctx, union, [1.0] * b,
                                                                              horizon=64, steady_fraction=nf))):
        us = _time_calls(fn, args.n)
        print(f"policy.decide, batch {b}, {label}, profile {p.name}: wall median {np.median(us):.2f} us, "
              f"p99 {np.percentile(us, 99):.2f} us; CPU {_cpu_us(fn, args.n):.2f} us per call (best of 5) "
              f"-> {fn().path}")
    ref = np.median(_time_calls(lambda: sum(rows), args.n))
    print(f"reference: sum() of {b} ints takes {ref:.2f} us here (about 0.1 us on an idle modern core): "
          f"scale the numbers above by that ratio")
    # the torch-free reference tracker, for scale (a runtime tracker would live on the GPU)
    tr = ReuseTracker(DcpLayout(4, 1), 8 * 4 * 2048 * 2)
    rng = np.random.default_rng(0)
    unions = np.stack([rng.choice(65536, size=3584, replace=False) for _ in range(b)])
    counts = np.full(b, 3584)
    reqs = list(range(b))
    t = time.perf_counter()
    for step in range(5):
        tr.held(0, reqs, unions, counts)
        tr.commit(0, reqs, unions, counts, [70000] * b)
    print(f"ReuseTracker (numpy reference) held+commit, batch {b}, union 3584, DCP4: "
          f"{(time.perf_counter() - t) / 5 * 1e3:.1f} ms per layer")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
