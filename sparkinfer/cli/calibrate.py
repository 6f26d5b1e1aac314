"""``sparkinfer calibrate``: measure this machine's transport parameters and write a node profile.

Without a CUDA device (the only mode implemented so far) it measures the HOST
FABRIC, the shared-memory stand-in for the GPU links that the host transport
and the demo use, and says so in the profile:

* ``bw_dir_GBps``    single-thread memcpy of a large buffer (numpy ``copyto``)
* ``bw_bidir_GBps``  two threads copying at once (both "directions" of a port)
* ``copy_us``        one small copy of a 368-byte record slab (per-copy overhead)
* ``link_latency_us`` one thread hand-off (``threading.Event`` ping-pong, half a round trip)
* ``collective_us``  one barrier round of ``world_size`` threads (a collective's sync)
* ``exchange_us``    one hand-off plus a pack and an unpack copy (an exchange's fixed part)
* ``hbm_GBps``       the memcpy rate again (pack/unpack run at memory speed)

Compute terms (indexer, attention, base step time) cannot be measured without the
model on a GPU; they are copied from ``--base`` (default ``rtx_pro_6000_x4``) and
the profile's ``source`` says which fields were measured and which were copied.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from dataclasses import replace

HELP = "measure transport parameters on this machine (CPU: the host fabric) and write a profile JSON"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="sparkinfer_profile.json", help="profile JSON to write")
    p.add_argument("--name", default=None, help="profile name (default: host-<hostname>)")
    p.add_argument("--base", default="rtx_pro_6000_x4",
                   help="profile whose compute terms are copied (name or JSON path)")
    p.add_argument("--mb", type=int, default=64, help="buffer size for bandwidth, MiB (default 64)")
    p.add_argument("--world-size", type=int, default=None, help="ranks (default: the base profile's)")
    p.add_argument("--quick", action="store_true", help="fewer repetitions (tests)")


def _best(fn, reps: int) -> float:
    """Best of ``reps`` wall times of ``fn()`` in seconds (least disturbed by other load)."""
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure_memcpy(nbytes: int, reps: int) -> tuple[float, float]:
    """(one-thread GB/s, two-threads-together GB/s) of large copies."""
    import numpy as np

    src = [np.ones(nbytes, np.uint8) for _ in range(2)]
    dst = [np.zeros(nbytes, np.uint8) for _ in range(2)]
    one = nbytes / _best(lambda: np.copyto(dst[0], src[0]), reps) / 1e9

    def both():
        t = threading.Thread(target=np.copyto, args=(dst[1], src[1]))  # numpy releases the GIL
        t.start()
        np.copyto(dst[0], src[0])
        t.join()

    two = 2 * nbytes / _best(both, reps) / 1e9
    return one, two


def measure_small_copy_us(record_bytes: int, n: int) -> float:
    import numpy as np

    src, dst = np.ones(record_bytes, np.uint8), np.zeros(record_bytes, np.uint8)
    t = _best(lambda: [np.copyto(dst, src) for _ in range(n)], 5)
    return t / n * 1e6


def measure_handoff_us(n: int) -> float:
    """Half a round trip between two threads through ``threading.Event``."""
    ping, pong = threading.Event(), threading.Event()

    def echo():
        for _ in range(n):
            ping.wait()
            ping.clear()
            pong.set()

    t = threading.Thread(target=echo)
    t.start()
    start = time.perf_counter()
    for _ in range(n):
        ping.set()
        pong.wait()
        pong.clear()
    dt = time.perf_counter() - start
    t.join()
    return dt / n / 2 * 1e6


def measure_barrier_us(world_size: int, n: int) -> float:
    bar = threading.Barrier(world_size)

    def member():
        for _ in range(n):
            bar.wait()

    threads = [threading.Thread(target=member) for _ in range(world_size - 1)]
    for t in threads:
        t.start()
    start = time.perf_counter()
    for _ in range(n):
        bar.wait()
    dt = time.perf_counter() - start
    for t in threads:
        t.join()
    return dt / n * 1e6


def calibrate(base, world_size: int, nbytes: int, quick: bool, name: str):
    reps = 3 if quick else 10
    n = 200 if quick else 2000
    one, two = measure_memcpy(nbytes, reps)
    copy_us = measure_small_copy_us(368, n)
    hand = measure_handoff_us(n)
    barrier = measure_barrier_us(world_size, n // 4)
    measured = dict(bw_dir_GBps=round(one, 3), bw_bidir_GBps=round(max(two, one), 3),
                    link_latency_us=round(hand, 3), collective_us=round(barrier, 3),
                    exchange_us=round(hand + 2 * copy_us, 3), copy_us=round(copy_us, 3),
                    hbm_GBps=round(one, 3))
    copied = ("index_ns_per_token", "attn_us_per_ktok", "base_us", "base_row_us")
    source = (f"sparkinfer calibrate on {os.uname().nodename} (CPU only: HOST FABRIC measured, not GPU links): "
              f"measured {', '.join(measured)}; copied from profile {base.name!r}: {', '.join(copied)}")
    prof = replace(base, name=name, world_size=world_size, source=source,
                   description=f"host fabric of {os.uname().nodename} ({os.cpu_count()} CPUs)", **measured)
    return prof, measured


def run(args: argparse.Namespace) -> int:
    from sparkinfer.core.costmodel import load_profile

    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    base = load_profile(args.base)
    ws = args.world_size or base.world_size
    if ws < 1:
        raise ValueError(f"--world-size must be >= 1, got {ws}")
    if args.mb < 1:
        raise ValueError(f"--mb must be >= 1, got {args.mb}")
    if has_cuda:
        print("a CUDA device is present, but GPU-link calibration is not implemented yet: "
              "measuring the host fabric only")
    else:
        print("no CUDA device: measuring the HOST FABRIC (shared-memory copies and thread hand-offs), "
              "not GPU links")
    name = args.name or f"host-{os.uname().nodename}"
    prof, measured = calibrate(base, ws, args.mb << 20, args.quick, name)
    for k, v in measured.items():
        print(f"  {k:<18}{v:>12.3f}")
    print(f"  (compute terms copied from {base.name!r})")
    prof.save(args.out)
    print("wrote", args.out)
    return 0
