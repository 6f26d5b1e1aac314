"""Loaders for the native libraries built from ``csrc/``.

``host_lib()`` returns the g++ build (host twins of every kernel), compiling it
on first use when the install step did not (an editable checkout after a header
changed, for instance). ``cuda_lib()`` returns the nvcc build or ``None``: it is
only loaded when torch sees a CUDA device, so importing sparkinfer never needs a
GPU or a driver.

Each binding module declares the signatures of the functions it calls with
``declare`` and turns their ``si_status`` results into exceptions with
``check_status``.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading

_lock = threading.Lock()

# si_status in csrc/include/sparkinfer/common.h
STATUS_TEXT = {1: "invalid argument", 2: "CUDA launch failed", 3: "index out of range", 4: "flag wait timed out"}


@functools.lru_cache(maxsize=None)
def host_lib() -> ctypes.CDLL:
    """The host build of csrc/ (always available where g++ is)."""
    from . import build

    with _lock:
        path = build.build_host()  # no-op when up to date
    return ctypes.CDLL(path)


@functools.lru_cache(maxsize=None)
def cuda_lib() -> ctypes.CDLL | None:
    """The CUDA build of csrc/, or None when there is no GPU or no build."""
    import torch

    from . import build

    if not torch.cuda.is_available():
        return None
    path = os.path.join(build.LIB_DIR, build.CUDA_LIB)
    if build.nvcc_path() is not None:
        with _lock:
            path = build.build_cuda()  # rebuilds only when csrc/ changed since the last build
    if not os.path.exists(path):
        return None
    return ctypes.CDLL(path)


def ptr(tensor) -> ctypes.c_void_p:
    """Raw data pointer of a contiguous torch tensor, for a C ABI call."""
    if not tensor.is_contiguous():
        raise ValueError("native calls need contiguous tensors; call .contiguous() first")
    return ctypes.c_void_p(tensor.data_ptr())


def device_key(device):
    """``device`` as the torch.device a per-device cache is keyed by: ``cuda`` and ``cuda:0`` (the
    current device) are one device, and a cache keyed by both would hold two error words, one that a
    kernel sets and one that the check reads (seen on the first GPU run)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def stream_handle(device) -> ctypes.c_void_p:
    """The current torch CUDA stream of ``device`` as a ``cudaStream_t``."""
    import torch

    return ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream)


def declare(lib: ctypes.CDLL, signatures: dict) -> ctypes.CDLL:
    """Set ``argtypes`` of each named C ABI function; they all return an int32 ``si_status``."""
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int32
    return lib


def check_status(status: int, what: str) -> None:
    """Raise RuntimeError naming ``what`` for a non-zero ``si_status``."""
    if status:
        raise RuntimeError(f"{what} failed: {STATUS_TEXT.get(status, f'status {status}')}")
