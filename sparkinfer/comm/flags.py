"""Bindings of the host fabric's atomic flags (csrc/host/comm_flags.cpp)."""

from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from sparkinfer import native

WAIT_OK, WAIT_TIMEOUT, WAIT_ABORTED = 0, 1, 2


@lru_cache(maxsize=None)
def _lib():
    lib = native.host_lib()
    lib.si_comm_flag_store.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.si_comm_flag_store.restype = None
    lib.si_comm_flag_load.argtypes = [ctypes.c_void_p]
    lib.si_comm_flag_load.restype = ctypes.c_int64
    lib.si_comm_flag_wait.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64,
                                      ctypes.c_int64, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64,
                                      ctypes.c_void_p]
    lib.si_comm_flag_wait.restype = ctypes.c_int32
    return lib


def _addr(words: torch.Tensor, index: int) -> int:
    return words.data_ptr() + 8 * index


def store(words: torch.Tensor, index: int, value: int) -> None:
    """Release-store ``value`` into int64 word ``index`` of shared ``words``."""
    _lib().si_comm_flag_store(_addr(words, index), value)


def load(words: torch.Tensor, index: int) -> int:
    return _lib().si_comm_flag_load(_addr(words, index))


def wait(words: torch.Tensor, first: int, peers: list[int], stride: int, target: int,
         abort_first: int, n_abort: int, timeout_s: float) -> tuple[int, list[int]]:
    """Wait until word ``first + p * stride`` >= target for every p in ``peers`` (GIL released).

    Returns (WAIT_OK | WAIT_TIMEOUT | WAIT_ABORTED, peers still pending).
    """
    idx = (ctypes.c_int32 * max(1, len(peers)))(*peers)
    pending = ctypes.c_int64(0)
    rc = _lib().si_comm_flag_wait(_addr(words, first), idx, len(peers), stride, target,
                                  _addr(words, abort_first), n_abort, int(timeout_s * 1e9), ctypes.byref(pending))
    return rc, [p for k, p in enumerate(peers) if pending.value >> k & 1]
