"""Replicated indexer benchmark (sparkinfer.indexer): scoring + top-k over the whole cache.

On a CUDA GPU: GLM-5.2's indexer (32 index heads x 128, top-k 2048) over T
cached tokens for M query rows (4 = one request at MTP3, 32 = eight), timing
the Triton scoring kernel, the top-k selection (select_topk) and both
together (triton.testing.do_bench, median), and printing the key bytes read
(T * 132) over the scoring time. The selected sets are checked against the
reference (float64 scoring) on the same inputs: it prints how many ids differ,
which can only be near-ties (see tests/test_indexer.py).

Without a GPU it says so and times only the torch reference at a reduced shape.

    python benchmarks/indexer_bench.py [--tokens 8192 65536 262144] [--rows 4 32]
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from sparkinfer.formats import get_format
from sparkinfer.indexer import indexer_scores, indexer_topk_torch, select_topk


def make_inputs(m, hi, t, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    records = get_format("indexer_fp8").encode(torch.randn(t, 128, generator=g)).to(device)
    q = torch.randn(m, hi, 128, generator=g).to(device, torch.bfloat16)
    w = torch.rand(m, hi, generator=g).to(device)
    pos = (t - m + torch.arange(m)).to(device)  # the last M positions, as MTP verification rows
    return q, w, records, pos


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 65536, 262144])
    ap.add_argument("--rows", type=int, nargs="+", default=[4, 32])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--k", type=int, default=2048)
    args = ap.parse_args()

    if not torch.cuda.is_available():
        m, t, k = 4, 4096, 512
        print(f"no CUDA device: timing the torch reference only, at a reduced shape M={m} Hi={args.heads} "
              f"T={t} k={k}")
        q, w, rec, pos = make_inputs(m, args.heads, t, "cpu")
        indexer_topk_torch(q, w, rec, pos, k)
        t0 = time.perf_counter()
        indexer_topk_torch(q, w, rec, pos, k)
        print(f"reference (float64 scores + stable sort): {(time.perf_counter() - t0) * 1e3:.2f} ms")
        return 0

    import triton.testing

    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name(dev)}; Hi={args.heads} k={args.k}")
    print(f"{'T':>8} {'M':>4} {'score us':>9} {'topk us':>8} {'total us':>9} {'key GB/s':>9} {'ids != ref':>10}")
    for t in args.tokens:
        for m in args.rows:
            q, w, rec, pos = make_inputs(m, args.heads, t, dev, seed=t + m)
            score = lambda: indexer_scores(q, w, rec, pos, backend="triton", check_values=False)
            scores = score()
            select = lambda: select_topk(scores, args.k)
            total = lambda: select_topk(score(), args.k)
            s_us = triton.testing.do_bench(score, warmup=10, rep=100) * 1e3
            k_us = triton.testing.do_bench(select, warmup=10, rep=100) * 1e3
            t_us = triton.testing.do_bench(total, warmup=10, rep=100) * 1e3
            ids = select().cpu()
            ref = indexer_topk_torch(q.cpu(), w.cpu(), rec.cpu(), pos.cpu(), args.k)
            diff = sum(len(set(a) ^ set(b)) for a, b in zip(ids.tolist(), ref.tolist()))
            print(f"{t:8d} {m:4d} {s_us:9.1f} {k_us:8.1f} {t_us:9.1f} {t * 132 / s_us / 1e3:9.1f} {diff:10d}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
