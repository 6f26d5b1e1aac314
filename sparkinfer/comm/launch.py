"""Start ``world`` local processes (forkserver) in one gloo process group and run a function on each.

Used by the host-fabric tests, the transport benchmark and the demo. Each rank runs
``fn(rank, world, *args)``; its return value (or its formatted exception) comes back to the
parent. A rank that does not finish within ``timeout_s`` is terminated (only the processes started
here) and reported, so a protocol bug shows up as a failure, never as a hung parent.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import tempfile
import traceback


def _entry(fn, rank, world, init_file, pg_timeout_s, args, results):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # four ranks share few cores; intra-op threads only add contention
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        out = fn(rank, world, *args)
        results.put((rank, True, out))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class RankFailure(RuntimeError):
    pass


def _context():
    """A forkserver that imported torch once: ranks fork from it instead of each importing torch
    again (seconds per rank on a loaded machine), and unlike forking this process they inherit no
    thread pools."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "sparkinfer.comm.host_fabric"])
    return ctx


def run_ranks(fn, world: int, *args, timeout_s: float = 120.0, pg_timeout_s: float = 30.0) -> list:
    """Run ``fn`` on ``world`` ranks; return the per-rank results (rank order).

    Raises RankFailure with every failing rank's traceback if any rank raised or timed out.
    """
    ctx = _context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="si-launch-") as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [ctx.Process(target=_entry, args=(fn, r, world, init_file, pg_timeout_s, args, results), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        got: dict = {}
        failures = []
        try:
            import time

            deadline = time.monotonic() + timeout_s
            while len(got) < world:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(world)) - set(got))
                    failures.append(f"rank(s) {missing} did not finish within {timeout_s:g} s")
                    break
                try:
                    rank, ok, out = results.get(timeout=min(left, 1.0))
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs) if r not in got and p.exitcode not in (None, 0)]
                    if dead:
                        failures.append(f"rank(s) {dead} died (exit codes {[procs[r].exitcode for r in dead]})")
                        break
                    continue
                got[rank] = out
                if not ok:
                    failures.append(f"rank {rank} raised:\n{out}")
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.terminate()
                    p.join(timeout=5)
    if failures:
        raise RankFailure("\n".join(failures))
    return [got[r] for r in range(world)]
