"""Prefetch overlap: how long each layer's ``SelectedDecode.attend`` waits for its records, with and
without per-layer arrival, on four real host-fabric ranks.

One decode step of a Full layer and the Shared layers that reuse its top-k (pattern ``FSSS``,
prefetch depth 3: one layered exchange of 4 layers issued at F). Each layer runs
``SelectedDecode.attend`` (ring get, the step's own records patched in) with its attention replaced
by a compute stand-in (``--compute-ms``: a sleep standing for the layer's GPU time, attention, MoE
and projections, during which the copy engine moves the next sections; the CPU torch attention
would take seconds per step here and bury the transfer in noise). The time inside ``attend`` spent
in the ring's ``get`` is the wait; it is reported per layer (p50 over the steps, rank 0; every
rank runs the same), with the step's wall time.

* ``packed``: ``SelectedExchange(layer_arrival=False)``, one copy and one arrival per pair: F waits
  for the whole group's records;
* ``overlap``: per-layer arrival (the default): F waits for F's section only, the Shared sections
  land while F and the layers before them compute.

``--sizing device`` runs the GPU path's form instead: no copy thread; the calling thread stores
F's sections into the peers' regions and the fabric's side thread (the CUDA fabric's side stream)
the Shared ones (``packed``: the calling thread stores everything).

The cost model's chunk formula (``costmodel.chunk_exposed_us``) is fitted from the two runs without
compute (``packed`` waits ``fixed + J x`` in total, ``overlap`` at F ``fixed + x``) and then
predicts the total wait at each compute time. These are HOST-FABRIC numbers (memcpy by a copy
thread between processes sharing a few CPU cores), a check of the protocol, not of PCIe.

    python benchmarks/prefetch_overlap.py --compute-ms 0 1 2 5 --steps 30 [--sizing device]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

WORLD = 4
PATTERN = "FSSS"
FMT = "nvfp4_ds_mla:fp8-rope-368"
BLOCK = 64


def _rank(rank, world, batch, rows, topk, context, compute_ms, steps, warmup, sizing):
    import torch.distributed as dist

    from sparkinfer.comm.exchange import SelectedExchange
    from sparkinfer.comm.host_fabric import HostFabric
    from sparkinfer.core.slab import SlabLayout
    from sparkinfer.comm.synthetic import build_shard
    from sparkinfer.core.topology import DcpLayout, IndexSharePattern
    from sparkinfer.formats import get_format
    from sparkinfer.decode import selected_decode
    from sparkinfer.decode.selected_decode import SelectedDecode

    fmt = get_format(FMT)
    W, L, H = fmt.record_bytes, len(PATTERN), 2
    g = torch.Generator().manual_seed(0)  # the same records and top-k on every rank
    # encoded records of a few distinct latents, tiled: valid bytes without encoding the whole cache
    base = fmt.encode(torch.randn(256, 512, generator=g), torch.randn(256, 64, generator=g), backend="host")
    full = base[torch.randint(0, 256, (L * batch * context,), generator=g)].view(L, batch, context, W)
    shard = build_shard(full, DcpLayout(world, 1), rank, BLOCK, torch.Generator().manual_seed(1))
    ctx = context - rows  # the step's own rows sit at positions ctx .. ctx + rows - 1
    topk_ids = torch.stack([torch.randperm(ctx, generator=g)[:topk] for _ in range(batch * rows)]).to(torch.int32)
    gq = torch.Generator().manual_seed(2 + rank)
    q_nope, q_rope = torch.randn(batch * rows, H, 512, generator=gq), torch.randn(batch * rows, H, 64, generator=gq)
    new = full[0, torch.arange(batch).repeat_interleave(rows), ctx + torch.arange(rows).repeat(batch)]
    pattern = IndexSharePattern.parse(PATTERN, L)
    out_lse = torch.zeros(batch * rows, H, 512), torch.zeros(batch * rows, H)
    out = {}
    for c_ms in compute_ms:
        def stand_in(*args, c_ms=c_ms, **kwargs):  # the layer's compute (module docstring)
            time.sleep(c_ms / 1e3)
            return out_lse
        selected_decode.sparse_mla_decode = stand_in
        # both modes side by side, alternating step by step, so the shared machine's load hits them alike
        fabrics, runs = [], {}
        try:
            for mode in ("packed", "overlap"):
                fabrics.append(HostFabric(SlabLayout(world, W, capacity=batch * rows * topk, max_layers=L, depth=2),
                                          timeout_s=60))
                ex = SelectedExchange(fabrics[-1], sizing, layer_arrival=mode == "overlap")
                dec = SelectedDecode(ex, fmt, DcpLayout(world, 1), pattern, max_batch=batch, rows=rows, topk=topk,
                                     depth=L - 1, scale=0.07, backend="torch")
                runs[mode] = (dec, [], [], [])  # decoder, (start, end) of each layer's get, issue times, step s
                get, waits = dec.ring.get, runs[mode][1]

                def timed_get(layer, get=get, waits=waits):
                    t = time.perf_counter()
                    ws = get(layer)
                    waits[-1][layer] = (t, time.perf_counter())
                    return ws
                dec.ring.get = timed_get
            for it in range(warmup + steps):
                for mode, (dec, waits, issued, steps_s) in runs.items():
                    dist.barrier()
                    waits.append([None] * L)
                    t0 = time.perf_counter()
                    dec.begin_step(shard.cache, shard.block_table, BLOCK, torch.full((batch,), ctx))
                    dec.full_layer(0, topk_ids)
                    issued.append(time.perf_counter())  # this rank's copies are queued
                    for layer in range(L):
                        dec.attend(layer, q_nope, q_rope, new)
                    steps_s.append(time.perf_counter() - t0)
            for mode, (dec, waits, issued, steps_s) in runs.items():
                # perf_counter is CLOCK_MONOTONIC, one clock for every process of the machine: F's net
                # wait starts when the last rank had queued its copies (ranks plan at different speeds
                # on a loaded machine; that skew is not transfer)
                every: list = [None] * world
                dist.all_gather_object(every, issued)
                last = [max(e[i] for e in every) for i in range(len(issued))]
                kept = list(zip(waits, last))[warmup:]
                raw = [[e - s for s, e in w] for w, _ in kept]
                net = [[w[0][1] - max(w[0][0], t)] + r[1:] for (w, t), r in zip(kept, raw)]
                out[(mode, c_ms)] = {"wait_ms": [1e3 * statistics.median(w[l] for w in raw) for l in range(L)],
                                     "net_f_ms": 1e3 * statistics.median(n[0] for n in net),
                                     "total_ms": 1e3 * statistics.median(sum(n) for n in net),
                                     "step_ms": 1e3 * statistics.median(steps_s[warmup:]),
                                     "bytes": dec.step_stats().bytes_sent}
        finally:
            for f in fabrics:
                f.close()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rows", type=int, default=4, help="query rows per request (1 + MTP drafts)")
    ap.add_argument("--topk", type=int, default=512)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--compute-ms", type=float, nargs="+", default=[0.0, 1.0, 2.0, 5.0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--sizing", choices=("host", "device"), default="host",
                    help="host: copy-thread copies per section; device: the GPU path's form, F's sections stored "
                         "by the calling thread, the Shared sections by the fabric's side thread")
    args = ap.parse_args(argv)
    if 0.0 not in args.compute_ms:
        args.compute_ms = [0.0] + args.compute_ms  # the fit needs the runs without compute
    from sparkinfer.comm.launch import run_ranks
    from sparkinfer.core import costmodel as cm

    res = run_ranks(_rank, WORLD, args.batch, args.rows, args.topk, args.context, args.compute_ms, args.steps,
                    args.warmup, args.sizing, timeout_s=1800, pg_timeout_s=600)[0]
    J = len(PATTERN)
    print(f"host fabric, {args.sizing}-sized, {WORLD} ranks, pattern {PATTERN} (depth {J - 1}: one exchange of {J} layers), "
          f"batch {args.batch} x {args.rows} rows x top-k {args.topk}, {FMT}, "
          f"{res[('overlap', 0.0)]['bytes'] / 1e6:.2f} MB sent per rank per step; rank 0, p50 of {args.steps} steps")
    print("wait L<l>: time in layer l's ring get inside attend; F net: F's wait after the last rank queued its "
          "copies; sum: F net + the Shared layers' waits")
    print(f"{'mode':8s} {'compute ms':>10s} " + " ".join(f"{'wait L' + str(l) + ' ms':>11s}" for l in range(J))
          + f" {'F net ms':>9s} {'sum ms':>7s} {'step ms':>8s}")
    for (mode, c), r in sorted(res.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"{mode:8s} {c:10.1f} " + " ".join(f"{w:11.2f}" for w in r["wait_ms"])
              + f" {r['net_f_ms']:9.2f} {r['total_ms']:7.2f} {r['step_ms']:8.2f}")
    # fit fixed and x from the runs without compute (the host fabric's section cost is ~0)
    packed0, first0 = res[("packed", 0.0)]["total_ms"], res[("overlap", 0.0)]["net_f_ms"]
    x = max(0.0, (packed0 - first0) / (J - 1))
    fixed = max(0.0, first0 - x)
    print(f"fit from compute 0: fixed {fixed:.2f} ms, x {x:.2f} ms per layer section")
    print(f"{'compute ms':>10s} {'packed model':>12s} {'measured':>9s} {'overlap model':>13s} {'measured':>9s}")
    for c in args.compute_ms:
        pm = cm.chunk_exposed_us(J, x, fixed, 0.0, c, overlap=False)
        om = cm.chunk_exposed_us(J, x, fixed, 0.0, c)
        print(f"{c:10.1f} {pm:12.2f} {res[('packed', c)]['total_ms']:9.2f} {om:13.2f} "
              f"{res[('overlap', c)]['total_ms']:9.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
