"""TP workers for the engines of this suite, forked from a server that has imported vLLM once.

Why: vLLM's CPU platform starts every TP worker with ``spawn``, and a spawned worker spends about
10 s of CPU importing torch and vLLM before it does anything. On CI's 2 cores a TP2 engine waited
about 10 s for its workers and a TP4 engine about 20 s, and the suite starts dozens of them.

How: ``install()`` points vLLM's multiprocessing executor at a ``forkserver`` context whose server
preloads vLLM's worker modules (``PRELOAD``), so a worker is a fork of that server and starts in well
under a second. A spawned worker gets its parent's environment and its stdout/stderr at the moment
it starts, and test code relies on both (``monkeypatch.setenv`` before an engine, ``capfd`` reading
the workers' warnings). A forked server child would instead get the server's, so ``Process`` sends
both along and the child installs them before vLLM's worker code runs.

What the fork cannot give: a variable that acts when the interpreter starts or a library loads
(``START_VARIABLES``: ``PYTHONPATH`` runs a test's ``sitecustomize``, ``OMP_NUM_THREADS`` sizes
libgomp's pool when torch loads, ``TRITON_INTERPRET`` is read when kernels are defined). When one
of them differs from what the server started with, that worker is spawned as vLLM would, and one
line on stderr says so.

``SPARKINFER_TEST_SPAWN=1`` when a worker starts spawns it (vLLM's own behaviour): to rule this module
out when a test fails, and for an engine whose workers compute for minutes. Forked workers ran the
host-reads engine's interpreted Triton kernels 10-30% slower than spawned ones (8 tokens: 144-159 s
against 121-131 s, a forkserver with or without the preload alike; the cause is not known), which
outweighs the 10 s saved at start.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from multiprocessing import forkserver, reduction

PRELOAD = ["vllm.v1.executor.multiproc_executor", "vllm.v1.worker.cpu_worker"]
START_VARIABLES = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "LD_PRELOAD", "LD_LIBRARY_PATH",
                   "OMP_NUM_THREADS", "TRITON_INTERPRET")
STDIO = (1, 2)


def _start_values(env) -> dict:
    return {k: env.get(k) for k in START_VARIABLES}


class _ParentFd:
    """One of the parent's file descriptors, duplicated into the child when the process starts."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):  # pickled while the process starts: the fd rides along with its request
        return _detach, (reduction.DupFd(self.fd),)


def _detach(dup) -> int:
    return dup.detach()


def _run(env: dict, stdio: tuple, target, kwargs: dict):
    """The worker, in a child of the server: the parent's environment and stdout/stderr, then vLLM's."""
    os.environ.clear()
    os.environ.update(env)
    for fd, inherited in zip(STDIO, stdio):
        if inherited != fd:
            os.dup2(inherited, fd)
            os.close(inherited)
    target(**kwargs)


_server_start: dict | None = None  # START_VARIABLES as the process's one forkserver started with them


class PreloadedContext:
    """What vLLM's executor uses of a multiprocessing context (``Process``, ``Pipe``, ``Lock``), with
    workers forked from the preloaded server, or spawned where the fork cannot stand in for spawn."""

    def __init__(self):
        self._fork = multiprocessing.get_context("forkserver")
        self._spawn = multiprocessing.get_context("spawn")

    def __getattr__(self, name):
        return getattr(self._fork, name)

    def Process(self, target, kwargs, **options):
        global _server_start
        if os.environ.get("SPARKINFER_TEST_SPAWN") == "1":
            return self._spawn.Process(target=target, kwargs=kwargs, **options)
        values = _start_values(os.environ)
        if _server_start is None:
            _server_start = values  # the server starts with the first worker, in its environment
        differs = sorted(k for k, v in values.items() if v != _server_start[k])
        if differs:
            print(f"worker_processes: spawning {options.get('name', 'a worker')}: {', '.join(differs)} differs "
                  "from the preloaded server's", file=sys.stderr, flush=True)
            return self._spawn.Process(target=target, kwargs=kwargs, **options)
        return self._fork.Process(target=_run, args=(dict(os.environ), tuple(map(_ParentFd, STDIO)), target, kwargs),
                                  **options)


def install() -> bool:
    """Route vLLM's TP workers through the preloaded server for this process; False where vLLM is absent."""
    try:
        from vllm.v1.executor import multiproc_executor
    except ImportError:
        return False
    forkserver.set_forkserver_preload(PRELOAD)
    context = PreloadedContext()
    multiproc_executor.get_mp_context = lambda: context
    return True
