"""ctypes bindings of the record codecs in csrc/ (host twin and CUDA kernels).

C ABI (csrc/host/records_host.cpp, csrc/cuda/records.cu):
    si_records_encode(fmt, latent*, rope*, n, slots*|NULL, cache*, num_slots, stride, S, scale_format)
    si_records_decode(fmt, cache*, num_slots, stride, idx*|NULL, n, latent*, rope*, S)
    si_records_encode_cuda / si_records_decode_cuda: the same on device pointers plus a stream (a slot
        past num_slots is skipped / decoded as zeros there: the forward's device check flags it,
        where the host twin refuses the call; NVFP4 encode needs 16-byte aligned rows and cache).
    si_records_write_paged(fmt, latent*, lat_stride, lat_bf16, rope*, rope_stride, rope_bf16, n, slots*,
        cache*, num_blocks, block_size, s0, s1, null_block, S, scale_format, value_flag*, slot_flag*)
        and si_records_write_paged_cuda (plus a stream): a layer forward's whole cache write
        (``write_paged``).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from sparkinfer.native import check_status as _raise
from sparkinfer.native import cuda_lib, declare, host_lib, ptr, stream_handle

_i32, _i64, _f32, _p = ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


_WRITE_PAGED = [_i32, _p, _i64, _i32, _p, _i64, _i32, _i64, _p, _p, _i64, _i64, _i64, _i64, _i64, _f32, _i32, _p, _p]
_BF16 = {torch.float32: 0, torch.bfloat16: 1}  # the input dtypes the paged writer reads


@functools.lru_cache(maxsize=None)
def _host():
    return declare(host_lib(), {
        "si_records_encode": [_i32, _p, _p, _i64, _p, _p, _i64, _i64, _f32, _i32],
        "si_records_decode": [_i32, _p, _i64, _i64, _p, _i64, _p, _p, _f32],
        "si_records_layout": [_i32],
        "si_records_codec": [_i32, _p, _i64, _p],
        "si_records_slot_blocks": [_p, _i64, _i64, _p],
        "si_records_write_paged": _WRITE_PAGED,
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
        "si_records_write_paged_cuda": [*_WRITE_PAGED, _p],
    })


def _opt(t):
    return ptr(t) if t is not None else None


def _aligned16(t) -> bool:
    return t is None or t.data_ptr() % 16 == 0


def encode(fmt, latent: torch.Tensor, rope, cache: torch.Tensor, slots) -> None:
    """Encode fp32 latent/rope into cache [num_slots, record_bytes] at slots (None: row i).

    On a GPU the NVFP4 kernel reads 16-byte aligned rows and writes 16-byte aligned records: a row
    tensor that starts off that alignment is copied (a fresh allocation is aligned); a cache that
    does is refused (the engine's caches and ``RecordFormat.encode``'s output are aligned)."""
    n = latent.shape[0]
    if cache.device.type == "cuda":
        if fmt.fmt_id in (1, 2):
            latent = latent if _aligned16(latent) else latent.clone()
            rope = rope if _aligned16(rope) else rope.clone()
            if not _aligned16(cache):
                raise ValueError(f"{fmt.name} encode on a GPU needs a 16-byte aligned cache")
        st = _cuda().si_records_encode_cuda(fmt.fmt_id, ptr(latent), _opt(rope), n, _opt(slots), ptr(cache),
                                            cache.shape[0], fmt.record_bytes, fmt.outer_scale, fmt.scale_format_id,
                                            stream_handle(cache.device))
    else:
        st = _host().si_records_encode(fmt.fmt_id, ptr(latent), _opt(rope), n, _opt(slots), ptr(cache),
                                       cache.shape[0], fmt.record_bytes, fmt.outer_scale, fmt.scale_format_id)
    _raise(st, f"{fmt.name} encode")


def write_paged(fmt, latent: torch.Tensor, rope, cache: torch.Tensor, slots: torch.Tensor, null_block: int,
                value_flag: torch.Tensor, slot_flag: torch.Tensor) -> None:
    """A layer forward's cache write in one launch (the CUDA kernel on a GPU, the host twin on CPU):
    encode latent [n, D] (rope [n, 64]), float32 or bfloat16 rows with a contiguous last dim, into
    the paged cache uint8 [num_blocks, block_size, record_bytes] of any block and slot strides (last
    dim contiguous) at slots int64 [n] (contiguous; -1 skips). A slot below -1, in ``null_block`` or
    past the cache is skipped and sets ``slot_flag``; a non-finite value sets ``value_flag`` (int32
    [1] words of ``device_checks``). Nothing is checked here: the forward's inputs are what the
    engine hands every layer (``paged_sparse_mla.forward_write_records``)."""
    nb, bs = cache.shape[:2]
    args = (fmt.fmt_id, latent.data_ptr(), latent.stride(0), _BF16[latent.dtype],
            None if rope is None else rope.data_ptr(), 0 if rope is None else rope.stride(0),
            0 if rope is None else _BF16[rope.dtype], latent.shape[0], slots.data_ptr(), cache.data_ptr(), nb, bs,
            cache.stride(0), cache.stride(1), null_block, fmt.outer_scale, fmt.scale_format_id,
            value_flag.data_ptr(), slot_flag.data_ptr())
    if cache.device.type == "cuda":
        st = _cuda().si_records_write_paged_cuda(*args, stream_handle(cache.device))
    else:
        st = _host().si_records_write_paged(*args)
    _raise(st, f"{fmt.name} paged write")


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


def host_slot_blocks(slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """The CUDA paged write's block of each slot (int64 in [0, 2**31)), records.h's division-free
    slot_block on the host -> int32."""
    slots = slots.to(torch.int64).contiguous()
    out = torch.empty(slots.numel(), dtype=torch.int32)
    _raise(_host().si_records_slot_blocks(ptr(slots), slots.numel(), block_size, ptr(out)), "slot blocks")
    return out


def host_codec(what: str, x: torch.Tensor) -> torch.Tensor:
    """Run one element codec of csrc/ over fp32 x -> uint8 [n, bytes per element]."""
    cid, width = _CODEC_IDS[what]
    x = x.to(torch.float32).contiguous().view(-1)
    out = torch.empty(x.numel(), width, dtype=torch.uint8)
    _raise(_host().si_records_codec(cid, ptr(x), x.numel(), ptr(out)), f"{what} codec")
    return out
