"""ctypes bindings of the union kernel (csrc/cuda/union.cu) and its host twin.

Both take the same arguments (``csrc/include/sparkinfer/union.h``): int32
pointers to topk [B, R, K], union [B, R*K], remap [B, R, K], counts [B] and an
int32 scratch of ``B * workspace_ints(R*K)`` entries; the CUDA entry adds a stream.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from sparkinfer import native

_I32 = ctypes.c_int32
_P = ctypes.c_void_p
_RUN_ARGS = [_P, _I32, _I32, _I32, _P, _P, _P, _P, ctypes.c_int64]


@functools.lru_cache(maxsize=None)
def _host():
    lib = native.host_lib()
    lib.si_union_host_workspace_ints.argtypes = [_I32]
    lib.si_union_host_workspace_ints.restype = ctypes.c_int64
    return native.declare(lib, {"si_union_host_run": _RUN_ARGS})


@functools.lru_cache(maxsize=None)
def _cuda():
    lib = native.cuda_lib()
    if lib is None or not hasattr(lib, "si_union_cuda_run"):
        return None
    return native.declare(lib, {"si_union_cuda_run": _RUN_ARGS + [_P]})


def cuda_available() -> bool:
    return _cuda() is not None


def workspace_ints(n: int) -> int:
    """int32 scratch entries one request of ``n = R*K`` top-k entries needs."""
    w = _host().si_union_host_workspace_ints(n) if 0 <= n < 2**31 else -1
    if w < 0:
        raise ValueError(f"R*K = {n} is outside the union kernel's range")
    return w


def check_topk(topk, validate: bool = True) -> tuple[int, int, int]:
    """Check a top-k tensor's type, dtype and rank; returns (B, R, K). With ``validate`` also
    its values (ids >= -1), which reads them back (a device sync on a GPU). The union contract's
    input check (``union.py``), here so the bindings and the torch reference share it."""
    if not isinstance(topk, torch.Tensor):
        raise ValueError(f"topk must be a torch.Tensor, got {type(topk).__name__}")
    if topk.dtype != torch.int32:
        raise ValueError(f"topk must be int32 [B, R, K], got dtype {topk.dtype}")
    if topk.dim() != 3:
        raise ValueError(f"topk must be int32 [B, R, K], got shape {tuple(topk.shape)}")
    if validate and topk.numel() and bool((topk < -1).any()):
        bad = int(topk.min())
        raise ValueError(f"topk holds token id {bad}; ids must be >= 0, with -1 as the only pad")
    return tuple(topk.shape)


def _call(entry, topk: torch.Tensor, validate: bool, *extra, out=None):
    """Run ``entry`` on topk's device: into ``out`` = (union, remap, counts, scratch), contiguous int32
    tensors of at least the sizes below (a caller's preallocated buffers), else into new ones."""
    b, r, k = check_topk(topk, validate)
    per_request = workspace_ints(r * k)  # range check before any allocation
    dev = topk.device
    topk = topk.contiguous()
    if out is None:
        out = (torch.empty((b, r * k), dtype=torch.int32, device=dev),
               torch.empty((b, r, k), dtype=torch.int32, device=dev),
               torch.empty((b,), dtype=torch.int32, device=dev),
               torch.empty((max(b * per_request, 1),), dtype=torch.int32, device=dev))
    uni, remap, counts, ws = out
    args = [native.ptr(topk), b, r, k, native.ptr(uni), native.ptr(remap), native.ptr(counts),
            native.ptr(ws), ws.numel(), *extra]
    # Locals keep the buffers alive through the call; on a GPU the caching allocator
    # orders the scratch's reuse after the kernel on this stream.
    native.check_status(entry(*args), entry.__name__)
    return uni, remap, counts


def mtp_union_host(topk: torch.Tensor, validate: bool = True, out=None):
    """The host twin of the CUDA union kernel; ``topk`` must be a CPU tensor (``out``: ``_call``)."""
    if isinstance(topk, torch.Tensor) and topk.device.type != "cpu":
        raise ValueError(f"mtp_union_host needs a CPU tensor, got one on {topk.device}")
    return _call(_host().si_union_host_run, topk, validate, out=out)


def mtp_union_cuda(topk: torch.Tensor, validate: bool = True, out=None):
    """The CUDA union kernel on ``topk``'s device and current stream (``out``: ``_call``)."""
    lib = _cuda()
    if lib is None:
        raise RuntimeError("the CUDA library with si_union_cuda_run is not built "
                           "(python -m sparkinfer.native.build --cuda)")
    if not (isinstance(topk, torch.Tensor) and topk.is_cuda):
        raise ValueError("mtp_union_cuda needs a CUDA tensor")
    with torch.cuda.device(topk.device):
        return _call(lib.si_union_cuda_run, topk, validate, native.stream_handle(topk.device), out=out)
