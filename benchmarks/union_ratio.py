"""Union ratio (counts / K) of the per-request MTP union on synthetic top-k traces.

Each request has R = 4 verification rows (MTP3) of K = 2048 tokens over a
context of T tokens. Traces:

* window   row r is the contiguous window [s + r*d, s + r*d + K), d = (1 - rho) * K:
           adjacent rows share exactly rho * K tokens (a drifting local window).
* drift    row 0 is a uniform K-subset of the context; row r+1 keeps a uniform
           rho * K subset of row r and draws the rest uniformly from the tokens
           not in row r (so it may return to tokens that rows before r held).
* uniform  every row an independent uniform K-subset (the no-locality bound:
           E[union] = T * (1 - (1 - K/T)^R)).

Prints mean, p10 and p90 of counts / K over requests, the records moved per
destination relative to fetching each row's top-k separately (counts / (R*K)),
and the plane imbalance at DCP4 for batches of 8 requests: the largest source's
plane over the even share sum(counts) / 4 (what a fixed plane capacity must cover).
With ``--time`` it also times the torch reference, the host twin and (on a GPU)
the CUDA kernel at the production shape B x 4 x 2048.

    python benchmarks/union_ratio.py [--requests 64] [--seed 0] [--time]
"""

from __future__ import annotations

import argparse
import time

import torch

from sparkinfer.plan import build_planes, mtp_union, mtp_union_host, mtp_union_reference
from sparkinfer.core.topology import DcpLayout

R, K = 4, 2048
DCP, PLANE_BATCH = 4, 8


def window_trace(gen, b, ctx, rho):
    d = round((1 - rho) * K)
    span = K + (R - 1) * d
    start = torch.randint(0, ctx - span + 1, (b, 1, 1), generator=gen)
    offs = torch.arange(R).view(1, R, 1) * d + torch.arange(K).view(1, 1, K)
    return (start + offs).to(torch.int32)


def drift_trace(gen, b, ctx, rho):
    keep = round(rho * K)
    out = torch.empty((b, R, K), dtype=torch.int32)
    for q in range(b):
        row = torch.randperm(ctx, generator=gen)[:K]
        out[q, 0] = row
        for r in range(1, R):
            kept = row[torch.randperm(K, generator=gen)[:keep]]
            outside = torch.ones(ctx, dtype=torch.bool)
            outside[row] = False
            pool = outside.nonzero().squeeze(1)
            fresh = pool[torch.randperm(pool.numel(), generator=gen)[:K - keep]]
            row = torch.cat([kept, fresh])[torch.randperm(K, generator=gen)]
            out[q, r] = row
    return out


def uniform_trace(gen, b, ctx, rho=None):
    return torch.stack([torch.stack([torch.randperm(ctx, generator=gen)[:K] for _ in range(R)])
                        for _ in range(b)]).to(torch.int32)


TRACES = [("window", window_trace, (0.9, 0.69, 0.5)),
          ("drift", drift_trace, (0.9, 0.69, 0.5)),
          ("uniform", uniform_trace, (None,))]
CONTEXTS = (16_384, 65_536, 262_144)


def ratios(args):
    gen = torch.Generator().manual_seed(args.seed)
    print(f"R={R} rows x K={K}, {args.requests} requests per line; ratio = counts / K "
          f"(1.0 = all rows equal, {R}.0 = all disjoint)")
    print(f"{'trace':<8} {'rho':>5} {'context':>8} {'mean':>6} {'p10':>6} {'p90':>6} "
          f"{'moved vs per-row':>17} {'max plane / share':>18}")
    for name, make, rhos in TRACES:
        for rho in rhos:
            for ctx in CONTEXTS:
                topk = make(gen, args.requests, ctx, rho)
                union, _, counts = mtp_union(topk)
                x = counts.double() / K
                imbalance = []
                for lo in range(0, args.requests - PLANE_BATCH + 1, PLANE_BATCH):
                    c = counts[lo:lo + PLANE_BATCH]
                    planes = build_planes(union[lo:lo + PLANE_BATCH], c, DcpLayout(DCP), 0)
                    imbalance.append(int(planes.count[:, 0].max()) / (int(c.sum()) / DCP))
                q = torch.quantile(x, torch.tensor([0.1, 0.9], dtype=torch.float64))
                rho_s = "-" if rho is None else f"{rho:.2f}"
                worst = f"{max(imbalance):18.3f}" if imbalance else f"{'-':>18}"
                print(f"{name:<8} {rho_s:>5} {ctx:>8} {x.mean():6.3f} {q[0]:6.3f} {q[1]:6.3f} "
                      f"{x.mean() / R:17.3f} {worst}")


def _best_ms(fn, reps):
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def timings(args):
    gen = torch.Generator().manual_seed(args.seed + 1)
    print(f"\nbest of {args.reps} wall times, drift trace rho 0.69, context 65,536:")
    for b in (1, 8):
        topk = drift_trace(gen, b, 65_536, 0.69)
        print(f"  B={b}: torch reference CPU {_best_ms(lambda: mtp_union_reference(topk), args.reps):8.3f} ms"
              f"   host twin {_best_ms(lambda: mtp_union_host(topk), args.reps):8.3f} ms")
        if torch.cuda.is_available():
            dev = topk.cuda()

            def cuda_run(fn):
                def go():
                    fn(dev)
                    torch.cuda.synchronize()
                return go

            mtp_union(dev)  # load the library, warm up
            print(f"        CUDA kernel {_best_ms(cuda_run(mtp_union), args.reps):8.3f} ms"
                  f"   torch reference CUDA {_best_ms(cuda_run(mtp_union_reference), args.reps):8.3f} ms"
                  f" (incl. launch + sync)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64, help=f"multiple of {PLANE_BATCH} for the plane column")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time", action="store_true", help="also time the three implementations")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    ratios(args)
    if args.time:
        timings(args)


if __name__ == "__main__":
    main()
