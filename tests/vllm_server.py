"""`vllm serve` for tests: start on a free loopback port, wait until it answers, always stop it.

    with serve(cli, model_dir, ["--dtype", "float32", ...], log_path) as base:
        ...  # base = "http://127.0.0.1:PORT"

The server gets its own process group, so stopping it also ends the engine's worker processes
(SIGTERM, then SIGKILL after 30 s). CPU settings every CPU test needs are in the environment.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

CPU_SERVE_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(cli: str | Path, model_dir: str | Path, args: list[str], log_path: str | Path,
          env: dict[str, str] | None = None, limit_s: float = 420):
    port = free_port()
    full_env = dict(os.environ, **CPU_SERVE_ENV, **(env or {}))
    full_env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server runs its engine in a child process
    base = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([str(cli), "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
                                 *map(str, args)], stdout=log, stderr=subprocess.STDOUT, env=full_env,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + limit_s
        while True:
            assert proc.poll() is None, "vllm serve exited:\n" + Path(log_path).read_text()[-3000:]
            assert time.monotonic() < deadline, f"vllm serve did not come up in {limit_s:.0f} s"
            try:
                urllib.request.urlopen(base + "/v1/models", timeout=5).read()
                break
            except OSError:
                time.sleep(1)
        yield base
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
