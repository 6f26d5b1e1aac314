"""Sparse MLA decode benchmark (sparkinfer.attention.sparse_mla_decode) with a roofline.

Roofline (printed always, from first principles): per call at M = batch x 4 query rows (MTP3), H
heads, K listed indices per row of which a fraction ``--valid-frac`` is this rank's (1.0 on the
selected path's gathered workspace; 0.25 on the stock DCP4 path, where each rank attends its
shard with all 64 heads), S splits:
  bytes = M*Kv*record_bytes (gathered records) + M*K*4 (indices) + M*H*576*2 (bf16 q)
          + M*H*(512+1)*4 (out, lse) + [S > 1] 2*S*M*H*(512+1)*4 (partials written and merged)
  FLOPs = 2*M*H*Kv*(576 + 2*512)  (QK once with bf16 q, PV twice: the hi/lo probability split)
and the time at ``--mem-tbs`` (1.79 TB/s, RTX PRO 6000 GDDR7) and at ``--tc-tflops`` (dense bf16
tensor-core peak; 500 is an assumed figure for the RTX PRO 6000, not a measurement). Decode
attention here is memory-bound (tens of FLOPs per byte against a ridge of ~280).

On a CUDA GPU it also times the Triton kernel (triton.testing.do_bench, median, preallocated outputs
and workspace, index range check off) and the torch reference, and prints microseconds per call,
gathered bytes over the kernel time, the fraction of the memory roofline reached and the largest
difference from the reference. What a GPU run must show: the kernel within ~2x of max(memory
time, ~5 us of launch + one wave) at every shape, and below the published SOTA to beat, an upstream
Triton sparse-MLA fallback for sm_12x whose split-K change took a decode attention call from 213 to
28.7 us (RTX 5090, topk 2048, H = 8, T = 1-4 rows).

Without a GPU it prints the roofline and times only the torch reference at a reduced shape (the
Triton interpreter's speed means nothing).

    python benchmarks/attention_bench.py [--batches 1 2 4 8] [--k 2048] [--heads 16] [--valid-frac 1.0]
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from sparkinfer.attention import sparse_mla_decode
from sparkinfer.formats import MAIN_FORMATS, get_format


def make_inputs(fmt, m, h, k, t, device, seed=0, valid_frac=1.0):
    g = torch.Generator().manual_seed(seed)
    records = fmt.encode(torch.randn(t, 512, generator=g), torch.randn(t, 64, generator=g)).to(device)
    q_nope = torch.randn(m, h, 512, generator=g).to(device, torch.bfloat16)
    q_rope = torch.randn(m, h, 64, generator=g).to(device, torch.bfloat16)
    # Distinct records per row, as the indexer's top-k gives; other ranks' entries are -1.
    indices = torch.stack([torch.randperm(t, generator=g)[:k] for _ in range(m)])
    indices[torch.rand(m, k, generator=g) >= valid_frac] = -1
    return q_nope, q_rope, records, indices.to(device, torch.int32)


def roofline(record_bytes, m, h, k, valid_frac, splits, mem_tbs, tc_tflops):
    """(bytes, FLOPs, memory-bound us, tensor-core-bound us) of one call; see the module docstring."""
    kv = k * valid_frac
    nbytes = m * kv * record_bytes + m * k * 4 + m * h * 576 * 2 + m * h * 513 * 4
    if splits > 1:
        nbytes += 2 * splits * m * h * 513 * 4
    flops = 2 * m * h * kv * (576 + 2 * 512)
    return nbytes, flops, nbytes / (mem_tbs * 1e6), flops / (tc_tflops * 1e6)


def print_roofline(args, formats, splits_of):
    print(f"roofline at {args.mem_tbs} TB/s and {args.tc_tflops} TFLOPS (bf16, assumed); H={args.heads} "
          f"K={args.k} valid={args.valid_frac}")
    print(f"{'format':28} {'M':>4} {'S':>3} {'MB moved':>9} {'GFLOP':>7} {'FLOP/B':>7} {'mem us':>7} {'tc us':>7}")
    for fmt in formats:
        for b in args.batches:
            m = b * args.rows_per_request
            s = splits_of(m)
            nbytes, flops, mem_us, tc_us = roofline(fmt.record_bytes, m, args.heads, args.k, args.valid_frac, s,
                                                    args.mem_tbs, args.tc_tflops)
            print(f"{fmt.name:28} {m:4d} {s:3d} {nbytes / 1e6:9.2f} {flops / 1e9:7.2f} {flops / nbytes:7.1f} "
                  f"{mem_us:7.2f} {tc_us:7.2f}")


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
    ap.add_argument("--valid-frac", type=float, default=1.0,
                    help="fraction of each row's K indices that are this rank's (0.25: stock DCP4)")
    ap.add_argument("--dot-precision", default="bf16x2", choices=["bf16x2", "bf16"])
    ap.add_argument("--mem-tbs", type=float, default=1.79, help="memory bandwidth, TB/s")
    ap.add_argument("--tc-tflops", type=float, default=500.0, help="dense bf16 tensor-core peak, TFLOPS")
    args = ap.parse_args()
    scale = 1 / math.sqrt(576)
    formats = [get_format(n) for n in args.formats]

    if not torch.cuda.is_available():
        from sparkinfer.attention.triton_decode import num_splits_for

        # The split count the wrapper would pick on a 188-SM RTX PRO 6000.
        print_roofline(args, formats, lambda m: num_splits_for(m, args.heads, args.k, 188))
        m, h, k, t = args.rows_per_request, args.heads, 256, 4096
        print(f"no CUDA device: timing the torch reference only, at a reduced shape M={m} H={h} K={k} T={t}")
        print(f"{'format':28} {'ref ms':>8}")
        for fmt in formats:
            inputs = make_inputs(fmt, m, h, k, t, "cpu", valid_frac=args.valid_frac)
            ms = cpu_time(lambda: sparse_mla_decode(*inputs[:3], fmt, inputs[3], scale, backend="torch"))
            print(f"{fmt.name:28} {ms:8.2f}")
        return 0

    import triton.testing

    from sparkinfer.attention.triton_decode import DecodeWorkspace, default_num_splits

    dev = torch.device("cuda")
    print_roofline(args, formats, lambda m: default_num_splits(m, args.heads, args.k, dev))
    print(f"{torch.cuda.get_device_name(dev)}; H={args.heads} K={args.k} T={args.tokens} valid={args.valid_frac} "
          f"rows/request={args.rows_per_request} dot={args.dot_precision}")
    print(f"{'format':28} {'batch':>5} {'M':>4} {'kernel us':>10} {'roof us':>8} {'of roof':>7} {'ref us':>10} "
          f"{'gathered MB':>11} {'GB/s':>7} {'max|d out|':>10} {'max|d lse|':>10}")
    for fmt in formats:
        for b in args.batches:
            m = b * args.rows_per_request
            qn, qr, rec, idx = make_inputs(fmt, m, args.heads, args.k, args.tokens, dev, seed=b,
                                           valid_frac=args.valid_frac)
            splits = default_num_splits(m, args.heads, args.k, dev)
            ws = DecodeWorkspace.allocate(m, args.heads, args.k, splits, dev)
            o_buf = torch.empty(m, args.heads, 512, device=dev)
            l_buf = torch.empty(m, args.heads, device=dev)
            run = lambda: sparse_mla_decode(qn, qr, rec, fmt, idx, scale, backend="triton", check_indices=False,
                                            dot_precision=args.dot_precision, out=o_buf, lse=l_buf, workspace=ws)
            ref = lambda: sparse_mla_decode(qn, qr, rec, fmt, idx, scale, backend="torch", check_indices=False)
            out, lse = run()
            ref_out, ref_lse = ref()
            us = triton.testing.do_bench(run, warmup=25, rep=200) * 1e3
            ref_us = triton.testing.do_bench(ref, warmup=5, rep=50) * 1e3
            gathered = int((idx >= 0).sum()) * fmt.record_bytes
            roof_us = roofline(fmt.record_bytes, m, args.heads, args.k, args.valid_frac, splits, args.mem_tbs,
                               args.tc_tflops)[2]
            print(f"{fmt.name:28} {b:5d} {m:4d} {us:10.1f} {roof_us:8.2f} {roof_us / us:7.2f} {ref_us:10.1f} "
                  f"{gathered / 1e6:11.2f} {gathered / us / 1e3:7.1f} {(out - ref_out).abs().max().item():10.2e} "
                  f"{(lse - ref_lse).abs().max().item():10.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
