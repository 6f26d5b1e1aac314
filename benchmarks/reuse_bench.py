"""Reuse tracker cost per layer: numpy ReuseTracker (reference) vs DeviceReuseTracker (torch).

GLM-5.2 decode shapes: DCP4, MTP3 (4 rows per request), top-k 2048, union 1.75 k = 3,584 tokens
per request (prior-art.md), 64K context, a pool of 4 k records per request per layer per
destination (per-layer quotas, docs/design/policy.md section 5). Each step keeps 70% of a
request's previous union and draws the rest from its prefix; the union also holds the step's 4
speculative positions; 1..4 of them commit. Every layer is visited once per step (default 4: a
Full layer and its Shared layers); the timed steps come after the pools are full, so every
commit also evicts.

One "layer" is what a decode step calls per layer: ``slots`` (the held mask is ``slots >= 0``)
and ``commit``, for both trackers; a third tracker takes all layers in one ``slots_layers`` /
``commit_layers`` call (time divided by the layers). The torch trackers run with
``validate=False`` (the hot-path mode, no host read-back) unless ``--validate``. The three run
in lockstep, layer by layer, so all see the same machine load; every timed result is compared
with the reference (outside the timing). The table gives medians over the timed layers of wall
time and of this thread's CPU time (on a loaded machine the CPU time is the steadier number; on
CUDA the wall time, with a synchronize around each call, is the one).

    python benchmarks/reuse_bench.py [--batches 1,8,32] [--device cuda] [--no-numpy]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

from sparkinfer.core.reuse import ReuseTracker
from sparkinfer.core.topology import DcpLayout
from sparkinfer.plan.reuse_device import DeviceReuseTracker

DCP, ROWS, TOPK, CONTEXT = 4, 4, 2048, 65536
UNION = 3584  # 1.75 x top-k for 4 MTP rows
POOL_PER_REQUEST = 4 * TOPK  # records per request per layer per destination
KEEP = 0.7  # step-to-step share of the union kept


def make_steps(batch: int, steps: int, seed: int):
    """Per step: (union int64 [B, UNION], committed_len int64 [B])."""
    rng = np.random.default_rng(seed)
    length = np.full(batch, CONTEXT, np.int64)
    prev = np.stack([rng.choice(CONTEXT, UNION - ROWS, replace=False) for _ in range(batch)])
    out = []
    for _ in range(steps):
        union = np.empty((batch, UNION), np.int64)
        for b in range(batch):
            old = rng.choice(prev[b], int(KEEP * UNION), replace=False)
            fresh = rng.choice(length[b], 2 * UNION, replace=False)
            fresh = fresh[~np.isin(fresh, old)][:UNION - ROWS - len(old)]
            union[b] = np.concatenate([rng.permutation(np.concatenate([old, fresh])),
                                       length[b] + np.arange(ROWS)])  # the speculative rows
        committed = length + rng.integers(1, ROWS + 1, size=batch)
        out.append((union, committed))
        prev, length = union[:, :UNION - ROWS], committed
    return out


def _timed(fn, sync):
    """(fn(), wall s, CPU s of this thread)."""
    sync()
    w, c = time.perf_counter(), time.thread_time()
    out = fn()
    sync()
    return out, time.perf_counter() - w, time.thread_time() - c


def _one_layer(tracker, layer, reqs, union, counts, committed):
    """One layer's calls: (held, slots, commit result)."""
    slots = tracker.slots(layer, reqs, union, counts)
    return slots >= 0, slots, tracker.commit(layer, reqs, union, counts, committed)  # held: one lookup


def _all_layers(tracker, layers, reqs, union, counts, committed):
    """Every layer in one call each; per layer (held, slots, commit result) like ``_one_layer``."""
    ids = list(range(layers))
    unions, cnts = union.expand(layers, -1, -1), counts.expand(layers, -1)
    slots = tracker.slots_layers(ids, reqs, unions, cnts)
    res = tracker.commit_layers(ids, reqs, unions, cnts, committed)
    return [(slots[la] >= 0, slots[la], res.layer(la)) for la in ids]


def _same(dev_out, ref_out) -> bool:
    (held, slots, res), (r_held, r_slots, r_res) = dev_out, ref_out
    got = res.to_host()
    return (np.array_equal(held.cpu().numpy(), r_held) and np.array_equal(slots.cpu().numpy(), r_slots)
            and np.array_equal(got.evicted, r_res.evicted)
            and all(np.array_equal(a, b) for x, y in zip(got.stored, r_res.stored) for a, b in zip(x, y)))


def run(ref, dev, dev_all, steps, layers, timed, device):
    """Drive the three trackers in lockstep (the same load for all); per-layer (wall, CPU) seconds
    of the timed steps, medians; every timed layer's outputs compared (outside the timing)."""
    batch = steps[0][0].shape[0]
    reqs, counts = list(range(batch)), np.full(batch, UNION)
    d_reqs, d_counts = torch.tensor(reqs, device=device), torch.as_tensor(counts, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = {"numpy": [], "torch": [], "torch, all layers in one call": []}
    evicted = 0
    for i, (union, committed) in enumerate(steps):
        d_union, d_committed = torch.as_tensor(union, device=device), torch.as_tensor(committed, device=device)
        outs = {}
        for layer in range(layers):
            outs[layer, "torch"], *t_d = _timed(
                lambda: _one_layer(dev, layer, d_reqs, d_union, d_counts, d_committed), sync)
            if ref is not None:
                outs[layer, "numpy"], *t_r = _timed(
                    lambda: _one_layer(ref, layer, reqs, union, counts, committed), lambda: None)
            if i >= len(steps) - timed:
                times["torch"].append(t_d)
                if ref is not None:
                    times["numpy"].append(t_r)
        got, *t_a = _timed(lambda: _all_layers(dev_all, layers, d_reqs, d_union[None], d_counts[None],
                                                d_committed), sync)
        if i < len(steps) - timed:
            continue
        times["torch, all layers in one call"].append([t / layers for t in t_a])
        for layer in range(layers):
            if ref is not None and not (_same(outs[layer, "torch"], outs[layer, "numpy"])
                                        and _same(got[layer], outs[layer, "numpy"])):
                raise SystemExit(f"device tracker differs from the reference: batch {batch}, step {i}, "
                                 f"layer {layer}")
            evicted += int(got[layer][2].evicted.sum())
    return {k: np.median(np.array(v), axis=0) * 1e3 if v else None for k, v in times.items()}, evicted


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--device", default="cpu", help="torch device of the device tracker (cpu or cuda)")
    ap.add_argument("--layers", type=int, default=4, help="layers (pool partitions) per step: 4 = a Full "
                    "layer and its 3 Shared layers, one exchange; a per-layer call touches one partition")
    ap.add_argument("--warmup", type=int, default=12, help="steps before timing (fills the pools)")
    ap.add_argument("--timed", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steady numbers on a "
                    "shared machine; numpy is single-threaded here too)")
    ap.add_argument("--no-numpy", action="store_true", help="skip the numpy reference (and the check)")
    ap.add_argument("--validate", action="store_true", help="torch tracker checks input values (a read-back)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs, torch {torch.__version__} "
          f"({torch.get_num_threads()} threads), device tracker on {device}, validate={args.validate}")
    print(f"DCP{DCP}, {ROWS} rows (MTP3), top-k {TOPK}, union {UNION}/request, pool {POOL_PER_REQUEST} "
          f"records/request/layer/destination, {args.layers} layers, {args.warmup} warm-up + "
          f"{args.timed} timed steps; ms per layer (slots + commit), median wall / CPU of this thread")
    print("| batch | numpy | torch | torch, all layers in one call | CPU speedup (one call) | checked |")
    print("|---|---|---|---|---|---|")
    layout = DcpLayout(DCP, 1)
    for batch in (int(b) for b in args.batches.split(",")):
        steps = make_steps(batch, args.warmup + args.timed, seed=batch)
        cap = POOL_PER_REQUEST * batch * args.layers
        dev, dev_all = (DeviceReuseTracker(layout, cap, args.layers, max_requests=max(batch, 1), device=device,
                                           validate=args.validate) for _ in range(2))
        ref = None if args.no_numpy else ReuseTracker(layout, cap, args.layers)
        med, evicted = run(ref, dev, dev_all, steps, args.layers, args.timed, device)
        cells = ["-" if v is None else f"{v[0]:.2f} / {v[1]:.2f}" for v in med.values()]
        r, d, a = med.values()
        speed = "-" if r is None else f"{r[1] / d[1]:.1f}x ({r[1] / a[1]:.1f}x)"
        check = "no" if r is None else f"equal ({evicted} evictions)"
        print(f"| {batch} | {' | '.join(cells)} | {speed} | {check} |")
    print(f"load average {os.getloadavg()[0]:.2f} after")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
