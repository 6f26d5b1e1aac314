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
    store_at(_addr(words, index), value)


def store_at(address: int, value: int) -> None:
    """Release-store ``value`` into the shared int64 at ``address``."""
    _lib().si_comm_flag_store(address, value)


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


# --- The device error word (csrc/include/sparkinfer/common.h; keep the two in sync) ---------------
# int32, 0 = no error; the first error wins and stays until the host clears the word:
#   bits 0..7 status, bits 8..15 peer + 1 (0: none), bits 16..23 check, bits 24..30 op.
ERR_RANGE, ERR_TIMEOUT = 3, 4
CHECK_COUNT, CHECK_RECORD, CHECK_SLOT, CHECK_WAIT = 1, 2, 3, 4
OP_PACK, OP_UNPACK, OP_DIRECT, OP_WAIT = 1, 2, 3, 4

_STATUS = {1: "invalid argument", 2: "CUDA launch failed", ERR_RANGE: "out of range", ERR_TIMEOUT: "timed out"}
_CHECK = {CHECK_COUNT: "a record count outside [0, capacity]",
          CHECK_RECORD: "a source record index (request, local ordinal, block or layer)",
          CHECK_SLOT: "a destination workspace slot", CHECK_WAIT: "a flag wait"}
_OP = {OP_PACK: "pack", OP_UNPACK: "unpack", OP_DIRECT: "direct", OP_WAIT: "flag wait"}


def error_word(status: int, check: int, op: int, peer: int | None = None) -> int:
    """The word a kernel stores (si_error_word)."""
    return (status & 0xFF) | ((-1 if peer is None else peer) + 1 & 0xFF) << 8 | (check & 0xFF) << 16 | (op & 0x7F) << 24


def decode_error(word: int) -> dict | None:
    """``{"status", "check", "op", "peer"}`` of a set error word (peer None when none), None for 0."""
    if not word:
        return None
    peer = (word >> 8 & 0xFF) - 1
    return {"status": word & 0xFF, "check": word >> 16 & 0xFF, "op": word >> 24 & 0x7F,
            "peer": None if peer < 0 else peer}


def describe_error(word: int) -> str:
    """One line naming the check behind a set error word (empty for 0)."""
    e = decode_error(word)
    if e is None:
        return ""
    op, check, status = e["op"], e["check"], e["status"]
    what = (f"{_OP.get(op, f'op {op}')}: {_CHECK.get(check, f'check {check}')} "
            f"{_STATUS.get(status, f'status {status}')}")
    return what + (f" (peer {e['peer']} never signalled)" if e["peer"] is not None else "") + f" [word {word:#x}]"
