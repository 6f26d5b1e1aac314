"""ctypes bindings of the record codecs in csrc/ (host twin and CUDA kernels).

C ABI (csrc/host/records_host.cpp, csrc/cuda/records.cu):
    si_records_encode(fmt, latent*, rope*, n, slots*|NULL, cache*, num_slots, stride, S, scale_format)
    si_records_decode(fmt, cache*, num_slots, stride, idx*|NULL, n, latent*, rope*, S)
    si_records_encode_cuda / si_records_decode_cuda: the same on device pointers plus a stream (a slot
        past num_slots is skipped / decoded as zeros there: the forward's device check flags it,
        where the host twin refuses the call).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from sparkinfer.native import check_status as _raise
from sparkinfer.native import cuda_lib, declare, host_lib, ptr, stream_handle

_i32, _i64, _f32, _p = ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


@functools.lru_cache(maxsize=None)
def _host():
    return declare(host_lib(), {
        "si_records_encode": [_i32, _p, _p, _i64, _p, _p, _i64, _i64, _f32, _i32],
        "si_records_decode": [_i32, _p, _i64, _i64, _p, _i64, _p, _p, _f32],
        "si_records_layout": [_i32],
        "si_records_codec": [_i32, _p, _i64, _p],
    })


@functools.lru_cache(maxsize=None)
def _cuda():
    lib = cuda_lib()
    if lib is None:
        raise RuntimeError("tensors are on a GPU but the sparkinfer CUDA library is not built: "
                           "run `python -m sparkinfer.native.build --require-cuda` (needs nvcc)")
    return declare(lib, {
        "si_records_encode_cuda": [_i32, _p, _p, _i64, _p, _p, _i64, _i64, _f32, _i32, _p],
        "si_records_decode_cuda": [_i32, _p, _i64, _i64, _p, _i64, _p, _p, _f32, _p],
    })


def _opt(t):
    return ptr(t) if t is not None else None


def encode(fmt, latent: torch.Tensor, rope, cache: torch.Tensor, slots) -> None:
    """Encode fp32 latent/rope into cache [num_slots, record_bytes] at slots (None: row i)."""
    n = latent.shape[0]
    if cache.device.type == "cuda":
        st = _cuda().si_records_encode_cuda(fmt.fmt_id, ptr(latent), _opt(rope), n, _opt(slots), ptr(cache),
                                            cache.shape[0], fmt.record_bytes, fmt.outer_scale, fmt.scale_format_id,
                                            stream_handle(cache.device))
    else:
        st = _host().si_records_encode(fmt.fmt_id, ptr(latent), _opt(rope), n, _opt(slots), ptr(cache),
                                       cache.shape[0], fmt.record_bytes, fmt.outer_scale, fmt.scale_format_id)
    _raise(st, f"{fmt.name} encode")


def gather(fmt, cache: torch.Tensor, idx):
    """Decode cache[idx[i]] (None: every record) -> (latent fp32 [n, D], rope fp32 [n, 64] or None)."""
    n = cache.shape[0] if idx is None else idx.shape[0]
    latent = torch.empty(n, fmt.value_dim, dtype=torch.float32, device=cache.device)
    rope = torch.empty(n, fmt.rope_dim, dtype=torch.float32, device=cache.device) if fmt.rope_dim else None
    if cache.device.type == "cuda":
        st = _cuda().si_records_decode_cuda(fmt.fmt_id, ptr(cache), cache.shape[0], fmt.record_bytes, _opt(idx), n,
                                            ptr(latent), _opt(rope), fmt.outer_scale, stream_handle(cache.device))
    else:
        st = _host().si_records_decode(fmt.fmt_id, ptr(cache), cache.shape[0], fmt.record_bytes, _opt(idx), n,
                                       ptr(latent), _opt(rope), fmt.outer_scale)
    _raise(st, f"{fmt.name} decode")
    return latent, rope


def layout_offset(what: int) -> int:
    """Field offsets compiled into csrc/ (see si_records_layout), for the layout test."""
    return _host().si_records_layout(what)


_CODEC_IDS = {"e4m3": (0, 1), "e2m1": (1, 1), "bf16": (2, 2), "pow2_ceil": (3, 4)}


def host_codec(what: str, x: torch.Tensor) -> torch.Tensor:
    """Run one element codec of csrc/ over fp32 x -> uint8 [n, bytes per element]."""
    cid, width = _CODEC_IDS[what]
    x = x.to(torch.float32).contiguous().view(-1)
    out = torch.empty(x.numel(), width, dtype=torch.uint8)
    _raise(_host().si_records_codec(cid, ptr(x), x.numel(), ptr(out)), f"{what} codec")
    return out
