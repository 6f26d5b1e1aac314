"""Replicated indexer benchmark (sparkinfer.indexer): scoring + top-k over the whole cache.

On a CUDA GPU: GLM-5.2's indexer (32 index heads x 128, top-k 2048) over T
cached tokens for M query rows (4 = one request at MTP3, 32 = eight), timing
the Triton scoring kernel, the top-k selection (select_topk) and both
together (triton.testing.do_bench, median), and printing the key bytes read
(T * 132) over the scoring time. The selected sets are checked against the
reference (float64 scoring) on the same inputs: it prints how many ids differ,
which can only be near-ties (see tests/indexer/test_indexer.py). Then the
engine's two Triton forms of the whole top-k, each one call: the tiled one over
a planned list (``indexer_topk_rows``) and the paged one straight from the pages
(``triton_paged.paged_topk_rows``, the cache as 64-token pages of a block
table), with "paged == tiled" whether their ids are equal (they must be).

Without a GPU it says so and times only the torch reference at a reduced shape.

    python benchmarks/indexer_bench.py [--tokens 8192 65536 262144] [--rows 4 32]

--prefill-memory: one prefill chunk (the last --chunk positions of each context, their rows
scored against the whole context) through the tiled top-k (``indexer_topk_rows``), printing per
context the peak bytes that scoring and selection allocate beyond the inputs (``peak_bytes``) and
the time. On CUDA (Triton) the peak is torch.cuda.max_memory_allocated over the call minus what was
allocated before it; on CPU (the torch path: the interpreter is far too slow for these shapes)
it is the highest running sum of the allocations and frees that torch's profiler records
(profile_memory) during the call. The peak must not grow with the context.

    python benchmarks/indexer_bench.py --prefill-memory --contexts 16384 65536 --chunk 2048 --json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from sparkinfer.formats import get_format
from sparkinfer.indexer import indexer_scores, indexer_topk_rows, indexer_topk_torch, select_topk, tiled


def make_inputs(m, hi, t, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    records = get_format("indexer_fp8").encode(torch.randn(t, 128, generator=g)).to(device)
    q = torch.randn(m, hi, 128, generator=g).to(device, torch.bfloat16)
    w = torch.rand(m, hi, generator=g).to(device)
    pos = (t - m + torch.arange(m)).to(device)  # the last M positions, as MTP verification rows
    return q, w, records, pos


def cpu_peak_bytes(fn):
    """(fn's result, the peak of the running sum of CPU allocations minus frees during fn), from the
    memory events torch's profiler records."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    now = peak = 0
    for e in events:
        if e.device_type() == torch._C._autograd.DeviceType.CPU:
            now += e.nbytes()
            peak = max(peak, now)
    return out, peak


def prefill_memory(contexts, chunk, heads, k, device, tile_bytes=None):
    """Per context: the tiled top-k of one prefill chunk (rows = the context's last ``chunk``
    positions, q in bf16 as the engine's fp8 codes are exact in it) -> a dict of the measurements.
    ``untiled_formula_bytes`` is not measured: M x T x 12, the old path's fp32 scores plus int64 keys."""
    rows = []
    backend = "triton" if device.type == "cuda" else "torch"  # the interpreter's numpy is not torch's memory
    q, w, rec, pos = make_inputs(chunk, heads, 64, device)  # warm-up: first-call allocations stay out
    indexer_topk_rows(q, w, rec, pos, k, **tiled.one_list(chunk, 64, device), backend=backend, check_values=False)
    for t in contexts:
        q, w, rec, pos = make_inputs(chunk, heads, t, device, seed=t)
        lists = tiled.one_list(chunk, t, device)
        call = lambda: indexer_topk_rows(q, w, rec, pos, k, **lists, backend=backend, check_values=False,
                                         tile_bytes=tile_bytes)
        if device.type == "cuda":
            call()  # compile this context's launches outside the measurement
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            ids = call()
            torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            peak = torch.cuda.max_memory_allocated() - base
            how = "torch.cuda.max_memory_allocated - memory_allocated before (Triton)"
        else:
            t0 = time.perf_counter()
            ids, peak = cpu_peak_bytes(call)
            seconds = time.perf_counter() - t0
            how = "torch.profiler memory events, peak running sum (torch path, profiler on)"
        tile = tiled.pick_tile(chunk, t, 8 if backend == "triton" else 8 * (3 * heads + 4),
                               tiled.TILE_BYTES if tile_bytes is None else tile_bytes)
        rows.append({"context": t, "chunk": chunk, "heads": heads, "k": k, "device": device.type,
                     "backend": backend, "tile": tile, "passes": -(-t // tile), "peak_bytes": int(peak),
                     "seconds": round(seconds, 3), "selected_rows_full": int((ids[:, -1] >= 0).sum()),
                     "untiled_formula_bytes": chunk * t * (4 + 8), "measured": how})
    return rows


def _engine_forms(q, w, rec, pos, k, block_size=64):
    """(tiled us, paged us, equal ids) of the engine's two Triton top-k forms over the T records, in
    workspaces of their own made before the timing: the tiled call with one list for all rows, the
    paged one with the records as pages of one request's block table (T a multiple of block_size)."""
    import triton.testing

    from sparkinfer.core.indexer_tiles import ENGINE_TILE_BYTES, paged_tile, paged_workspace_bytes, topk_rows_bytes
    from sparkinfer.indexer import TopkWorkspace
    from sparkinfer.indexer.triton_paged import paged_topk_rows

    m, t, dev = q.shape[0], rec.shape[0], q.device
    ids = [torch.empty(m, k, dtype=torch.int32, device=dev) for _ in range(2)]
    ws = TopkWorkspace(topk_rows_bytes(m, k, t, ENGINE_TILE_BYTES), dev)
    lists = tiled.one_list(m, t, dev)
    tiled_call = lambda: indexer_topk_rows(q, w, rec, pos, k, **lists, check_values=False,
                                           tile_bytes=ENGINE_TILE_BYTES, workspace=ws, out=ids[0])
    pages, tile = rec.view(t // block_size, block_size, rec.shape[1]), paged_tile(t)
    table = torch.arange(t // block_size, dtype=torch.int32, device=dev)[None]
    req, pws = torch.zeros(m, dtype=torch.int64, device=dev), TopkWorkspace(paged_workspace_bytes(m, k, tile), dev)
    paged_call = lambda: paged_topk_rows(q, w, pages, table, req, pos, k, tile=tile, workspace=pws, out=ids[1])
    tiled_call(), paged_call()
    same = torch.equal(ids[0], ids[1])
    return (triton.testing.do_bench(tiled_call, warmup=10, rep=100) * 1e3,
            triton.testing.do_bench(paged_call, warmup=10, rep=100) * 1e3, same)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 65536, 262144])
    ap.add_argument("--rows", type=int, nargs="+", default=[4, 32])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--prefill-memory", action="store_true", help="peak memory of one prefill chunk per context")
    ap.add_argument("--contexts", type=int, nargs="+", default=[16384, 65536])
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--json", action="store_true", help="print the --prefill-memory rows as JSON")
    args = ap.parse_args()

    if args.prefill_memory:
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        rows = prefill_memory(args.contexts, args.chunk, args.heads, args.k, dev)
        if args.json:
            print(json.dumps(rows, indent=1))
        else:
            for r in rows:
                print(f"context {r['context']:>8} chunk {r['chunk']} tile {r['tile']} passes {r['passes']}: "
                      f"peak {r['peak_bytes'] / 2**20:.1f} MiB in {r['seconds']:.2f} s ({r['backend']}, {r['device']})")
        return 0

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
    print(f"{'T':>8} {'M':>4} {'score us':>9} {'topk us':>8} {'total us':>9} {'key GB/s':>9} {'ids != ref':>10} "
          f"{'tiled us':>9} {'paged us':>9} {'paged == tiled':>14}")
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
            tiled_us, paged_us, same = _engine_forms(q, w, rec, pos, args.k)
            print(f"{t:8d} {m:4d} {s_us:9.1f} {k_us:8.1f} {t_us:9.1f} {t * 132 / s_us / 1e3:9.1f} {diff:10d} "
                  f"{tiled_us:9.1f} {paged_us:9.1f} {str(same):>14}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
