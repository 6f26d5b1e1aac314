"""Run the two test suites side by side and fail when either fails (the README's test command).

    python tests/run_suites.py [extra pytest args for both suites]

* ``system``: ``python -m pytest tests --ignore=tests/vllm`` in this interpreter (the package's own
  tests: planning, kernels under the Triton interpreter, multi-process ranks);
* ``vllm``: ``.venv-vllm/bin/python -m pytest tests/vllm`` (vLLM engines of the tiny model).

Why side by side: the vLLM suite is mostly engine start-ups and TP1 engines, one busy process on a
2-core machine, so a second core sits idle for much of its ~25 minutes; the system suite (~6 minutes
alone) fills it. The system suite runs at a lower scheduling priority (``nice``) so that it takes the
idle core rather than slowing the longer suite. Each suite writes its own log under
``build/test-logs/``; a suite's log is printed whole when it ends, so the two outputs never
interleave, and the exit status is the first non-zero of the two.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOGS = ROOT / "build" / "test-logs"
VENV_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def suites(extra: list[str]) -> dict[str, list[str]]:
    return {
        "vllm": [str(VENV_PYTHON), "-m", "pytest", "tests/vllm", "-q", "--durations=25", *extra],
        "system": ["nice", "-n", "10", sys.executable, "-m", "pytest", "tests", "-q", "--ignore=tests/vllm",
                   "--durations=15", *extra],
    }


def main(argv: list[str]) -> int:
    if not VENV_PYTHON.exists():
        print(f"no {VENV_PYTHON}: run `bash vllm_patches/install_cpu.sh` first", file=sys.stderr)
        return 2
    LOGS.mkdir(parents=True, exist_ok=True)
    procs = {}
    t0 = time.monotonic()
    for name, cmd in suites(argv).items():
        log = open(LOGS / f"{name}.log", "w")
        procs[name] = (subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy()),
                       log)
        print(f"[{name}] started: {' '.join(cmd)} (log: {LOGS / (name + '.log')})", flush=True)
    status = {}
    while len(status) < len(procs):
        for name, (proc, log) in procs.items():
            if name in status or proc.poll() is None:
                continue
            log.close()
            status[name] = proc.returncode
            print(f"\n===== [{name}] exit {proc.returncode} after {time.monotonic() - t0:.0f} s =====", flush=True)
            print((LOGS / f"{name}.log").read_text(), flush=True)
        time.sleep(1)
    failed = {n: rc for n, rc in status.items() if rc != 0}
    print(f"suites: {status} in {time.monotonic() - t0:.0f} s" + (f"; FAILED: {sorted(failed)}" if failed else ""))
    return next(iter(failed.values()), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
