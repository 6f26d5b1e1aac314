"""Build the native libraries from ``csrc/`` with plain compiler calls.

Two shared libraries come out of ``csrc/``:

* ``libsparkinfer_host.so``: every ``csrc/host/*.cpp`` compiled with g++. These
  are the host twins of the CUDA kernels; they include the same
  ``__host__ __device__`` headers, so the per-record logic exists once.
* ``libsparkinfer_cuda.so``: every ``csrc/cuda/*.cu`` compiled with nvcc for the
  architectures in ``SPARKINFER_CUDA_ARCHS`` (default ``120,90``). Built only
  when nvcc exists; its absence is not an error on a CPU-only machine.

Both export a plain C ABI (``extern "C"``) that ``sparkinfer.native`` loads with
ctypes, so building needs no torch headers and takes seconds.

The float flags matter: the record formats are defined as a sequence of IEEE
fp32 operations (``../shared/spec/record-formats.md``), so contraction into FMA,
flush-to-zero and approximate division are all switched off.

Run as a script (``python -m sparkinfer.native.build [--cuda] [--archs 120,90]``)
or through ``setup.py``; this file imports nothing from sparkinfer so setup.py
can load it before the package is installed.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys

PKG_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_DIR = os.path.dirname(os.path.dirname(PKG_DIR))
CSRC_DIR = os.path.join(REPO_DIR, "csrc")
LIB_DIR = os.path.join(PKG_DIR, "lib")

HOST_LIB = "libsparkinfer_host.so"
CUDA_LIB = "libsparkinfer_cuda.so"
DEFAULT_ARCHS = "120,90"

HOST_FLAGS = ["-O2", "-std=c++17", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math"]
NVCC_FLAGS = [
    "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC",
    "--fmad=false", "--ftz=false", "--prec-div=true", "--prec-sqrt=true",
]


def _sources(subdir: str, ext: str) -> list[str]:
    return sorted(glob.glob(os.path.join(CSRC_DIR, subdir, f"*.{ext}")))


def _headers() -> list[str]:
    return sorted(glob.glob(os.path.join(CSRC_DIR, "include", "**", "*.h*"), recursive=True))


def _stale(target: str, inputs: list[str]) -> bool:
    if not os.path.exists(target):
        return True
    built = os.path.getmtime(target)
    return any(os.path.getmtime(p) > built for p in inputs)


def _run(cmd: list[str]) -> None:
    print(" ".join(cmd), file=sys.stderr)
    subprocess.run(cmd, check=True)


def build_host(out_dir: str = LIB_DIR, force: bool = False) -> str:
    """Compile csrc/host/*.cpp into one shared library; returns its path."""
    cxx = os.environ.get("CXX", "g++")
    srcs = _sources("host", "cpp")
    target = os.path.join(out_dir, HOST_LIB)
    if force or _stale(target, srcs + _headers()):
        os.makedirs(out_dir, exist_ok=True)
        tmp = target + f".tmp{os.getpid()}"
        _run([cxx, *HOST_FLAGS, "-I", os.path.join(CSRC_DIR, "include"), *srcs, "-o", tmp])
        os.replace(tmp, target)  # atomic: concurrent test processes never see half a file
    return target


def nvcc_path() -> str | None:
    return shutil.which(os.environ.get("NVCC", "nvcc"))


def gencode_flags(archs: str) -> list[str]:
    """``"120,90"`` -> ``-gencode arch=compute_120,code=sm_120 ...``."""
    flags = []
    for arch in (a.strip() for a in archs.split(",") if a.strip()):
        if not arch.isdigit():
            raise ValueError(f"SPARKINFER_CUDA_ARCHS entries must be numbers like 120 or 90, got {arch!r}")
        flags += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
    return flags


def build_cuda(out_dir: str = LIB_DIR, archs: str | None = None, force: bool = False) -> str | None:
    """Compile csrc/cuda/*.cu with nvcc; returns the path, or None without nvcc."""
    nvcc = nvcc_path()
    if nvcc is None:
        return None
    archs = archs or os.environ.get("SPARKINFER_CUDA_ARCHS", DEFAULT_ARCHS)
    srcs = _sources("cuda", "cu")
    target = os.path.join(out_dir, CUDA_LIB)
    if force or _stale(target, srcs + _headers()):
        os.makedirs(out_dir, exist_ok=True)
        tmp = target + f".tmp{os.getpid()}"
        _run([nvcc, *NVCC_FLAGS, *gencode_flags(archs), "-I", os.path.join(CSRC_DIR, "include"),
              *srcs, "-o", tmp])
        os.replace(tmp, target)
    return target


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cuda", action="store_true", help="also build the CUDA library (needs nvcc)")
    ap.add_argument("--require-cuda", action="store_true", help="fail when nvcc is missing")
    ap.add_argument("--archs", default=None, help=f"CUDA archs, default {DEFAULT_ARCHS}")
    ap.add_argument("--out", default=LIB_DIR, help="output directory")
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args(argv)
    print(build_host(args.out, args.force))
    if args.cuda or args.require_cuda:
        path = build_cuda(args.out, args.archs, args.force)
        if path is None:
            if args.require_cuda:
                print("nvcc not found (set NVCC or PATH)", file=sys.stderr)
                return 1
            print("nvcc not found: CUDA library skipped", file=sys.stderr)
        else:
            print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
