"""Device-sized selected-record exchange between processes on one GPU, captured in a CUDA graph.

Two ranks (processes) share the GPU and talk through the CUDA fabric (IPC handles to each other's
slabs, device flags), as two DCP ranks of a node would. Shapes are GLM-5.2 decode's: ``--batch``
requests, a union of ``--union`` records per request (about 1.75 x top-k 2048 for MTP3 rows), a
Full layer and its three Shared layers in one exchange (``--layers`` 4), ``--width``-byte records.
Per rank: one eager exchange, then the same call captured in a CUDA graph; three new plans (new
unions, new caches) are copied into the captured buffers and each replay's workspace is checked
against the gather from the unsharded cache; then ``--iters`` back-to-back replays and eager calls
are timed, and ``--iters`` eager calls split into F's layer ready (``finish_layer(0)``: F's
sections, stored on the compute stream) and every layer ready (the Shared sections, stored on the
side stream). Prints one JSON object (also written to ``--json``).

Without CUDA (``--host``, what the dry run uses) the same protocol runs on the host fabric at the
shapes given, eagerly only: no capture, so ``graph`` is null.

    python benchmarks/device/graph_exchange.py [--batch 4] [--union 3584] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def _to(case, rank, dev):
    from sparkinfer.comm.pack import Shard

    sh, p = case.shard(rank), case.planes
    shard = Shard(sh.cache.to(dev), sh.block_table.to(dev), sh.block_size)
    planes = type(p)(p.count.to(dev), p.req.to(dev), p.local.to(dev), p.slot.to(dev), p.overflow)
    return shard, planes


def _mark(cuda: bool):
    """A point in time: an event on the compute stream (CUDA), else the host clock."""
    if not cuda:
        return time.perf_counter()
    import torch

    e = torch.cuda.Event(enable_timing=True)
    e.record()
    return e


def _us(a, b) -> float:
    return (b - a) * 1e6 if isinstance(a, float) else a.elapsed_time(b) * 1e3


def _rank(rank, world, args):
    import faulthandler

    import torch
    import torch.distributed as dist

    # a rank that hangs prints where (every thread's stack) before the caller's deadline
    faulthandler.dump_traceback_later(args["timeout_s"] - 15, exit=False)
    t_start = time.perf_counter()

    def say(what):  # progress on stderr: the stage's log shows how far each rank got
        print(f"[rank {rank} +{time.perf_counter() - t_start:6.1f} s] {what}", file=sys.stderr, flush=True)

    from sparkinfer.comm.exchange import SelectedExchange
    from sparkinfer.core.slab import SlabLayout
    from sparkinfer.comm.synthetic import make_case

    cuda = not args["host"]
    if cuda:
        from sparkinfer.comm.cuda_fabric import CudaFabric as Fab

        torch.cuda.set_device(rank % torch.cuda.device_count())
        dev = torch.device("cuda", torch.cuda.current_device())
    else:
        from sparkinfer.comm.host_fabric import HostFabric as Fab

        dev = torch.device("cpu")
    B, U, J, W = args["batch"], args["union"], args["layers"], args["width"]
    cap = B * U  # device sizing: planes cover the whole workspace, one round
    cases = [make_case(world, W, batch=B, seq_len=args["seq_len"], union_len=U, n_layers=J, block_size=64,
                       seed=s, held_frac=0.05) for s in (1, 2, 3, 4)]
    say(f"cases made (B {B} x U {U}, {J} layers, {W} B)")
    # a wait that never sees its flag fails the step (and names the peer) well inside the deadline
    fabric = Fab(SlabLayout(world, W, capacity=cap, max_layers=J, depth=2), timeout_s=args["wait_s"])
    say("fabric up")
    layers_list = list(range(J))
    try:
        ex = SelectedExchange(fabric, "device")
        layers = torch.tensor(layers_list, dtype=torch.int32, device=dev)
        shard, planes = _to(cases[0], rank, dev)  # the static buffers a graph captures
        ws = torch.zeros(J, cap, W, dtype=torch.uint8, device=dev)

        def sync():
            if cuda:
                fabric.check()  # syncs, then the fabric's wait and move error words

        def load(case):
            s, p = _to(case, rank, dev)
            for dst, src in ((shard.cache, s.cache), (shard.block_table, s.block_table), (planes.count, p.count),
                             (planes.req, p.req), (planes.local, p.local), (planes.slot, p.slot)):
                dst.copy_(src)
            ws.zero_()
            sync()

        def check(case):
            rows = case.delivered(rank)
            return bool(torch.equal(ws.cpu()[:, rows], case.expected_workspace(rank, layers_list)[:, rows]))

        eager = lambda: ex.exchange(planes, shard, layers, ws)  # noqa: E731
        load(cases[0])
        eager()
        sync()
        correct = {"eager": check(cases[0])}
        say(f"eager exchange done, correct {correct['eager']}")
        replay = eager
        if cuda:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                ex.exchange(planes, shard, layers, ws)
            replay = graph.replay
            say("captured")
        correct["replays"] = []
        for case in cases[1:]:
            load(case)
            dist.barrier()
            replay()
            sync()
            correct["replays"].append(check(case))
            say(f"replay {len(correct['replays'])} correct {correct['replays'][-1]}")

        def timed(fn, n):
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            sync()
            return (time.perf_counter() - t0) / n * 1e6

        def first_layer_split(n):
            """Median (F's layer ready, whole exchange ready) in us from the start of an eager
            exchange: with per-layer arrival F's section lands first while the Shared layers'
            sections are still moving on the side stream."""
            split = []
            for _ in range(n):
                dist.barrier()
                sync()
                marks = [_mark(cuda)]
                p = ex.start(planes, shard, layers, ws)
                ex.finish_layer(p, 0)
                marks.append(_mark(cuda))
                ex.finish(p)
                marks.append(_mark(cuda))
                sync()
                split.append([_us(marks[0], m) for m in marks[1:]])
            return [round(sorted(v)[n // 2], 1) for v in zip(*split)]

        n = args["iters"]
        eager_us = timed(eager, n)
        say(f"{n} eager exchanges timed: {eager_us:.1f} us each")
        graph_us = timed(replay, n) if cuda else None
        say(f"{n} replays timed: {graph_us} us each")
        first_us, whole_us = first_layer_split(n)
        say("first-layer split timed")
        remote = int(planes.count.sum() - planes.count.diagonal().sum())  # records that crossed processes
        recv = int(planes.count[:, rank].sum() - planes.count[rank, rank])
        return {"rank": rank, "correct": correct, "eager_us": round(eager_us, 1),
                "graph_us": None if graph_us is None else round(graph_us, 1),
                "first_layer_ready_us": first_us, "all_layers_ready_us": whole_us,
                "records_in": recv * J, "bytes_in": recv * J * W, "remote_records_all_pairs": remote * J}
    finally:
        fabric.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--union", type=int, default=3584, help="records per request's union (1.75 x 2048)")
    ap.add_argument("--seq-len", type=int, default=16384, help="tokens per request in the synthetic caches")
    ap.add_argument("--layers", type=int, default=4, help="layers per exchange (F + 3 S)")
    ap.add_argument("--width", type=int, default=368)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--host", action="store_true", help="host fabric, eager only (no CUDA needed)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--timeout", type=float, default=100.0,
                    help="seconds the ranks have in all (run_gpu_checks.sh gives the stage 120)")
    ap.add_argument("--wait-timeout", type=float, default=15.0, help="the fabric's flag-wait timeout")
    a = ap.parse_args()
    import torch

    from sparkinfer.comm.launch import run_ranks

    if not a.host and not torch.cuda.is_available():
        print("no CUDA device: run with --host for the host-fabric protocol check", file=sys.stderr)
        return 2
    args = {"host": a.host, "batch": a.batch, "union": a.union, "seq_len": a.seq_len, "layers": a.layers,
            "width": a.width, "iters": a.iters, "timeout_s": a.timeout, "wait_s": a.wait_timeout}
    ranks = run_ranks(_rank, a.world, args, timeout_s=a.timeout, pg_timeout_s=a.timeout - 10)
    ok = all(r["correct"]["eager"] and all(r["correct"]["replays"]) for r in ranks)
    graph = [r["graph_us"] for r in ranks if r["graph_us"] is not None]
    out = {"check": "device-sized exchange, CUDA graph capture and replay" if not a.host else
           "device-sized exchange on the host fabric (eager only)",
           "fabric": "host" if a.host else "cuda", "device": None if a.host else torch.cuda.get_device_name(),
           "world": a.world, "batch": a.batch, "union": a.union, "layers": a.layers, "width": a.width,
           "all_correct": ok, "ranks": ranks,
           "eager_us_max": max(r["eager_us"] for r in ranks), "graph_us_max": max(graph) if graph else None,
           "gbps_into_rank0_graph": (ranks[0]["bytes_in"] / (ranks[0]["graph_us"] * 1e3)
                                     if ranks[0]["graph_us"] else None)}
    text = json.dumps(out, indent=1)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
