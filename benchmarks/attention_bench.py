"""Sparse MLA decode benchmark (sparkinfer.attention.sparse_mla_decode).

On a CUDA GPU: the real decode shapes of GLM-5.2 at TP4 (H = 16 local heads,
K = 2048 selected records per row, batch 1-8 requests x 4 query rows for MTP3)
over a pool of T records, for each record format. It times the Triton kernel
(triton.testing.do_bench, median, index range check off) and the torch
reference, and prints microseconds per call, the record bytes the kernel
gathers (M * K * record_bytes) and that over the kernel time, and the largest
difference from the reference.

Without a GPU it says so and times only the torch reference at a reduced shape
(the Triton interpreter's speed means nothing).

    python benchmarks/attention_bench.py [--batches 1 2 4 8] [--k 2048] [--heads 16]
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from sparkinfer.attention import sparse_mla_decode
from sparkinfer.formats import MAIN_FORMATS, get_format


def make_inputs(fmt, m, h, k, t, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    records = fmt.encode(torch.randn(t, 512, generator=g), torch.randn(t, 64, generator=g)).to(device)
    q_nope = torch.randn(m, h, 512, generator=g).to(device, torch.bfloat16)
    q_rope = torch.randn(m, h, 64, generator=g).to(device, torch.bfloat16)
    # Distinct records per row, as the indexer's top-k gives.
    indices = torch.stack([torch.randperm(t, generator=g)[:k] for _ in range(m)]).to(device, torch.int32)
    return q_nope, q_rope, records, indices


def cpu_time(fn, reps=3):
    fn()
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--rows-per-request", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=65536, help="records in the pool")
    ap.add_argument("--formats", nargs="+", default=list(MAIN_FORMATS))
    ap.add_argument("--dot-precision", default="ieee", choices=["ieee", "tf32"])
    args = ap.parse_args()
    scale = 1 / math.sqrt(576)

    if not torch.cuda.is_available():
        m, h, k, t = args.rows_per_request, args.heads, 256, 4096
        print(f"no CUDA device: timing the torch reference only, at a reduced shape M={m} H={h} K={k} T={t}")
        print(f"{'format':28} {'ref ms':>8}")
        for name in args.formats:
            fmt = get_format(name)
            inputs = make_inputs(fmt, m, h, k, t, "cpu")
            ms = cpu_time(lambda: sparse_mla_decode(*inputs[:3], fmt, inputs[3], scale, backend="torch"))
            print(f"{fmt.name:28} {ms:8.2f}")
        return 0

    import triton.testing

    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name(dev)}; H={args.heads} K={args.k} T={args.tokens} "
          f"rows/request={args.rows_per_request} dot={args.dot_precision}")
    print(f"{'format':28} {'batch':>5} {'M':>4} {'kernel us':>10} {'ref us':>10} {'gathered MB':>11} "
          f"{'GB/s':>7} {'max|d out|':>10} {'max|d lse|':>10}")
    for name in args.formats:
        fmt = get_format(name)
        for b in args.batches:
            m = b * args.rows_per_request
            qn, qr, rec, idx = make_inputs(fmt, m, args.heads, args.k, args.tokens, dev, seed=b)
            run = lambda: sparse_mla_decode(qn, qr, rec, fmt, idx, scale, backend="triton", check_indices=False,
                                            dot_precision=args.dot_precision)
            ref = lambda: sparse_mla_decode(qn, qr, rec, fmt, idx, scale, backend="torch", check_indices=False)
            out, lse = run()
            ref_out, ref_lse = ref()
            us = triton.testing.do_bench(run, warmup=25, rep=200) * 1e3
            ref_us = triton.testing.do_bench(ref, warmup=5, rep=50) * 1e3
            gathered = m * args.k * fmt.record_bytes
            print(f"{fmt.name:28} {b:5d} {m:4d} {us:10.1f} {ref_us:10.1f} {gathered / 1e6:11.2f} "
                  f"{gathered / us / 1e3:7.1f} {(out - ref_out).abs().max().item():10.2e} "
                  f"{(lse - ref_lse).abs().max().item():10.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
