"""Transport benchmark: the selected-record exchange, stage by stage.

Host mode (default; any machine): spawns N ranks on the host fabric (processes, shared memory, one
copy thread per rank) and runs the real exchange over synthetic planes for every
records-per-step x record-width combination. Per exchange it reports own-record (direct), pack,
copy issue (including waits for free regions), arrival wait and unpack time separately (p50 over
the iterations; total p50 / p99), bytes this rank sent, and effective GB/s (bytes sent / whole
exchange); rank 0's workspace is checked against the unsharded gather. These are HOST-FABRIC numbers (memcpy between processes on
the CPU), a check of the protocol's overhead, not a prediction of PCIe P2P copy-engine speed.

Device mode (``--device``; one CUDA GPU): the pack / unpack kernels against the measured
device-to-device copy roofline, and copy-engine copies D2D and H2D (pinned) over a size sweep,
which shows why records are packed into one copy per pair (small copies run far below link speed).

    python benchmarks/transport_bench.py --ranks 2 4 --records 256 1024 2048 --csv out.csv
    python benchmarks/transport_bench.py --device
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time

import torch


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def _host_rank(rank, world, records, widths, layers, iters, warmup, sizings):
    from sparkinfer.comm.exchange import SelectedExchange
    from sparkinfer.comm.host_fabric import HostFabric
    from sparkinfer.core.slab import SlabLayout
    from sparkinfer.comm.synthetic import make_case

    rows = []
    for width, n, sizing in ((w, n, z) for w in widths for n in records for z in sizings):
        # one request whose union holds n tokens spread over a 4n context: each rank owns ~n/world
        case = make_case(world, width, batch=1, seq_len=4 * n, union_len=n, n_layers=layers,
                         block_size=64, seed=n + width)
        # host sizing: the slab fits the largest pair; device sizing: the planes' worst case B * U = n
        cap = n if sizing == "device" else max(1, int(case.planes.count.max()))
        fabric = HostFabric(SlabLayout(world, width, capacity=cap, max_layers=layers, depth=2))
        try:
            ex = SelectedExchange(fabric, sizing)
            ws = torch.zeros(layers, n, width, dtype=torch.uint8)
            shard, lay = case.shard(rank), torch.arange(layers, dtype=torch.int32)
            samples = []
            for it in range(warmup + iters):
                t = time.perf_counter()
                st = ex.exchange(case.planes, shard, lay, ws)
                total = time.perf_counter() - t
                if it >= warmup:
                    samples.append((st, total))
            if rank == 0:
                ok = torch.equal(ws, case.expected_workspace(0, list(range(layers))))
                tot = [s[1] for s in samples]
                count = case.planes.count[0].tolist()
                sent = (sum(count) - count[0]) * layers * width  # from the plan: device sizing counts nothing
                rows.append({
                    "fabric": "host", "sizing": sizing, "ranks": world, "records": n, "width": width,
                    "layers": layers, "bytes_sent_per_rank": sent,
                    **{f"{k}_p50_us": statistics.median(getattr(s, f"{k}_s") for s, _ in samples) * 1e6
                       for k in ("direct", "pack", "copy", "wait", "unpack")},
                    "total_p50_us": statistics.median(tot) * 1e6, "total_p99_us": _pct(tot, 99) * 1e6,
                    "gbps_p50": sent / statistics.median(tot) / 1e9, "correct": ok,
                })
        finally:
            fabric.close()
    return rows


def run_host(args) -> list[dict]:
    from sparkinfer.comm.launch import run_ranks

    rows = []
    for world in args.ranks:
        out = run_ranks(_host_rank, world, args.records, args.widths, args.layers, args.iters, args.warmup,
                        args.sizing, timeout_s=600)
        rows += out[0]
    return rows


def _time_cuda(fn, iters):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    ts = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        ts.append(start.elapsed_time(end) * 1e-3)
    return ts


def run_device(args) -> list[dict]:
    from sparkinfer.comm import pack as P
    from sparkinfer.comm.synthetic import make_case

    dev = torch.device("cuda")
    rows = []
    big = 256 << 20
    a = torch.empty(big, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    roof = _time_cuda(lambda: b.copy_(a), args.iters)
    roof_gbps = 2 * big / statistics.median(roof) / 1e9  # read + write
    rows.append({"fabric": "device", "op": "d2d_roofline", "bytes": big, "p50_us": statistics.median(roof) * 1e6,
                 "gbps_p50": roof_gbps})
    for width in args.widths:
        for n in args.records:
            case = make_case(1, width, batch=1, seq_len=4 * n, union_len=n, n_layers=args.layers, block_size=64,
                             seed=n)
            sh = case.shard(0)
            shard = P.Shard(sh.cache.to(dev), sh.block_table.to(dev), sh.block_size)
            p = case.planes
            req, local, slot = p.req[0, 0].to(dev), p.local[0, 0].to(dev), p.slot[0, 0].to(dev)
            cnt = p.count[0, 0].to(dev)
            cap = p.req.shape[-1]
            layers = torch.arange(args.layers, dtype=torch.int32, device=dev)
            out = torch.empty(args.layers * cap * width, dtype=torch.uint8, device=dev)
            ws = torch.empty(args.layers, cap, width, dtype=torch.uint8, device=dev)
            nbytes = 2 * args.layers * int(p.count[0, 0]) * width  # read + write
            err = torch.zeros(1, dtype=torch.int32, device=dev)
            for op, fn in (("pack", lambda: P.pack(shard, layers, req, local, cnt, cap, out, err=err)),
                           ("unpack", lambda: P.unpack(out, args.layers, cnt, cap, slot, ws, err=err))):
                ts = _time_cuda(fn, args.iters)
                rows.append({"fabric": "device", "op": op, "records": n, "width": width, "bytes": nbytes,
                             "p50_us": statistics.median(ts) * 1e6, "p99_us": _pct(ts, 99) * 1e6,
                             "gbps_p50": nbytes / statistics.median(ts) / 1e9,
                             "roofline_frac": nbytes / statistics.median(ts) / 1e9 / roof_gbps})
            P.check_error_word(err)
    side = torch.cuda.Stream()
    host = torch.empty(64 << 20, dtype=torch.uint8).pin_memory()
    for size in (4 << 10, 32 << 10, 256 << 10, 2 << 20, 16 << 20, 64 << 20):
        for op, src, dst in (("ce_d2d", a[:size], b[:size]), ("ce_h2d", host[:size], b[:size])):
            def copy():
                side.wait_stream(torch.cuda.current_stream())  # start after the timing event
                with torch.cuda.stream(side):
                    dst.copy_(src, non_blocking=True)
                torch.cuda.current_stream().wait_stream(side)
            ts = _time_cuda(copy, args.iters)
            rows.append({"fabric": "device", "op": op, "bytes": size, "p50_us": statistics.median(ts) * 1e6,
                         "p99_us": _pct(ts, 99) * 1e6, "gbps_p50": size / statistics.median(ts) / 1e9})
    return rows


def show(rows, title):
    from rich.console import Console
    from rich.table import Table

    keys = list(dict.fromkeys(k for r in rows for k in r))
    t = Table(title=title)
    for k in keys:
        t.add_column(k, justify="right")
    for r in rows:
        t.add_row(*[f"{r[k]:.3g}" if isinstance(r.get(k), float) else str(r.get(k, "")) for k in keys])
    Console(width=240).print(t)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", action="store_true", help="GPU kernels and copy engines (one CUDA device)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--records", type=int, nargs="+", default=[256, 1024, 2048],
                    help="union records per step (one request)")
    ap.add_argument("--widths", type=int, nargs="+", default=[368, 432, 656])
    ap.add_argument("--sizing", nargs="+", choices=["host", "device"], default=["host", "device"],
                    help="host: counts read once per exchange, copy-thread copies; device: no host read, "
                         "pack straight into the peer's region (see docs/design/transport.md)")
    ap.add_argument("--layers", type=int, default=3, help="layers per exchange (S1/S2/S3 share one map)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--csv", default=None, help="write the rows here as CSV")
    args = ap.parse_args(argv)
    if args.device:
        if not torch.cuda.is_available():
            print("--device needs a CUDA GPU", file=sys.stderr)
            return 2
        rows = run_device(args)
        title = f"device transport parts on {torch.cuda.get_device_name()}"
    else:
        rows = run_host(args)
        title = "HOST fabric (processes + shared memory + copy thread; not a GPU measurement)"
    show(rows, title)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
            w.writeheader()
            w.writerows(rows)
    bad = [r for r in rows if r.get("correct") is False]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
