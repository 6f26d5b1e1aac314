"""Record pack / unpack / direct moves of the exchange: native executors and the torch reference.

Tensor shapes (byte layouts in ``csrc/include/sparkinfer/pack.h``):

* ``Shard``: a rank's paged cache, ``cache`` uint8 ``[L, rows, width]`` or a sequence of ``L``
  per-layer tensors, uint8 ``[rows, width]`` or ``[n_blocks, block_size, width]`` with any block
  stride (vLLM allocates one tensor per layer, and its per-layer views may interleave layers block
  by block), with ``block_table`` int32 ``[B, max_blocks]`` and ``block_size``: record (request b,
  local ordinal o) of layer l is row ``o % block_size`` of block ``block_table[b, o // block_size]``
  of layer l. The kernels reach the layers through a table of their addresses (``layer_ptrs``
  int64 ``[L]`` on the data's device) and one block stride. A step's shard over the same caches
  passes the last step's shard as ``prior`` and shares its table: no copy to the device per step,
  and a captured graph keeps reading the table it captured.
* ``layers`` int32 ``[J]``: the cache layers that travel, in slab order.
* ``req``, ``local``, ``slot`` int32 ``[>= n]``: plane rows; only the first ``n`` entries are used.
* packed region uint8 ``[J, n, width]`` (dense, contiguous: one copy moves it).
* workspace uint8 ``[J, ws_rows, width]``; may be a layer-strided view, rows must be contiguous.

``count`` is an int32 scalar tensor on the data's device (an entry of the count plane) or a host
int (the eager chunked path), and ``cap`` its upper bound. The kernels and their host twins read
the count from memory, so the Python side never reads it back: a captured graph replays with new
plans, and an exchange with device-side sizing makes no host read at all. The CUDA grid is fixed
by the SM count (a few CTAs per SM striding over the records, :func:`grid_ctas`), not by ``cap``.

Errors. A count above ``cap`` or any index out of range goes to an error word (int32, layout in
``csrc/include/sparkinfer/common.h`` and :mod:`sparkinfer.comm.flags`; first error wins). Pass
``err`` (an int32 tensor: the fabric's ``move_err``, or any word on the data's device or in pinned
host memory for CUDA data) and errors are only recorded there, on the CPU as on the GPU, for the
caller to read a step later (:func:`check_error_word` reads and clears one); every move skips when
the word is already set, so an unpack never consumes bytes whose arrival wait timed out. Without
``err`` the host path raises at once; a CUDA move cannot raise from its kernel, so it refuses to
run without one. Records are never silently dropped.

Arrival. ``pack(..., arrive=(flag, seq, counter))`` or ``direct(..., arrive=(flag, seq, counter))``
(records straight into a peer's region) makes the kernel that wrote them publish the region: each
CTA fences system-wide after its stores and counts itself on ``counter`` (the address of a zeroed
device int32 kept for that flag alone); the last one fences again, sets the counter back to zero (a
replayed graph counts from zero again) and release-stores the int64 at address ``seq`` into the
int64 at address ``flag`` (the peer's arrival flag), unless the error word is set. The caller owns
the counter: ``CudaFabric.arrival_flag`` returns all three addresses. A host move takes ``(flag,
seq)`` (its twin runs in one thread and counts nothing).
"""

from __future__ import annotations

import ctypes
from dataclasses import InitVar, dataclass
from functools import lru_cache

import torch

from sparkinfer import native

from . import flags as F

_i32, _i64, _vp = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
_CACHE_ARGS = [_vp, _i64, _i64, _i32, _vp, _i64, _i32, _i32, _i32]  # pack.h si_pack_cache fields


def _as_blocks(l: int, t, block_size: int) -> torch.Tensor:
    """Layer ``l`` as uint8 [n_blocks, block_size, width] with contiguous rows inside a block."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() not in (2, 3):
        raise ValueError(f"shard layer {l} must be uint8 [rows, width] or [n_blocks, block_size, width], got "
                         f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    if t.dim() == 2:
        if t.shape[0] % block_size or t.stride(0) != t.shape[1] or t.stride(1) != 1:
            raise ValueError(f"shard layer {l}: [rows, width] needs contiguous rows and rows % block_size == 0, "
                             f"got {tuple(t.shape)} strides {t.stride()} with block_size {block_size}")
        return t.view(t.shape[0] // block_size, block_size, t.shape[1])
    if t.shape[1] != block_size or t.stride(2) != 1 or t.stride(1) != t.shape[2]:
        raise ValueError(f"shard layer {l}: [n_blocks, block_size, width] needs block_size {block_size} and "
                         f"contiguous rows inside a block, got {tuple(t.shape)} strides {t.stride()}")
    return t


@dataclass(frozen=True)
class Shard:
    """One rank's paged record cache (see module docstring for the row rule)."""

    cache: torch.Tensor | tuple
    block_table: torch.Tensor
    block_size: int
    prior: InitVar["Shard | None"] = None  # a shard whose table to share when its layers are these

    def __post_init__(self, prior):
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        per_layer = isinstance(self.cache, (list, tuple))
        if not per_layer and (self.cache.dtype != torch.uint8 or self.cache.dim() != 3):
            raise ValueError(f"shard cache must be uint8 [L, rows, width] or a sequence of per-layer tensors, "
                             f"got {self.cache.dtype} {tuple(self.cache.shape)}")
        layers = tuple(_as_blocks(l, t, self.block_size) for l, t in enumerate(self.cache))
        if not layers:
            raise ValueError("shard cache has no layers")
        first = layers[0]
        for l, t in enumerate(layers):
            if t.shape != first.shape or t.stride(0) != first.stride(0) or t.device != first.device:
                raise ValueError(f"shard layer {l} is {tuple(t.shape)} (block stride {t.stride(0)}) on {t.device}; "
                                 f"layer 0 is {tuple(first.shape)} (block stride {first.stride(0)}) on "
                                 f"{first.device}: all layers must match")
        if self.block_table.dtype != torch.int32 or self.block_table.dim() != 2:
            raise ValueError(f"block_table must be int32 [B, max_blocks], got {self.block_table.dtype} "
                             f"{tuple(self.block_table.shape)}")
        if not self.block_table.is_contiguous():
            raise ValueError("block_table must be contiguous")
        if self.block_table.device != first.device:
            raise ValueError("block_table and cache must be on the same device")
        object.__setattr__(self, "layers", layers)  # uint8 [n_blocks, block_size, width] each
        addrs = tuple(t.data_ptr() for t in layers)
        same = prior is not None and prior.layer_addrs == addrs and prior.device == first.device
        object.__setattr__(self, "layer_addrs", addrs)
        object.__setattr__(self, "layer_ptrs", prior.layer_ptrs if same else
                           torch.tensor(addrs, dtype=torch.int64, device=first.device))

    @property
    def width(self) -> int:
        return self.layers[0].shape[2]

    @property
    def device(self) -> torch.device:
        return self.layers[0].device

    def blocks_of(self, req: torch.Tensor, local: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, row inside the block) of (req, local) pairs (torch reference; no bounds checks)."""
        req, local = req.long(), local.long()
        return self.block_table.long()[req, local // self.block_size], local % self.block_size

    def cache_args(self) -> list:
        bt, first = self.block_table, self.layers[0]
        return [native.ptr(self.layer_ptrs), first.shape[0], first.stride(0), len(self.layers),
                native.ptr(bt) if bt.numel() else None, bt.stride(0), bt.shape[0], bt.shape[1], self.block_size]


def _check_index(name: str, t: torch.Tensor, n: int, device) -> None:
    if t.dtype != torch.int32 or t.dim() != 1 or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous int32 vector, got {t.dtype} {tuple(t.shape)}")
    if t.shape[0] < n:
        raise ValueError(f"{name} holds {t.shape[0]} entries, {n} needed")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, data on {device}")


def _check_ws(ws: torch.Tensor, n_layers: int, width: int) -> None:
    if ws.dtype != torch.uint8 or ws.dim() != 3 or ws.shape[0] != n_layers or ws.shape[2] != width:
        raise ValueError(f"workspace must be uint8 [{n_layers}, rows, {width}], got {ws.dtype} {tuple(ws.shape)}")
    if ws.stride(2) != 1 or ws.stride(1) != width:
        raise ValueError("workspace rows must be contiguous")


def _status(op: str, status: int, word=None) -> None:
    """Raise for a call's status; range errors only when no error word records them."""
    if status == 3 and word is not None:
        return
    if status == 1:
        raise ValueError(f"{op}: invalid size argument")
    if status == 2:
        raise RuntimeError(f"{op}: CUDA launch failed")
    if status == 3:
        raise ValueError(f"{op}: the record count is outside [0, capacity] or a record index (request, local "
                         "ordinal, layer or slot) is out of range")
    if status:
        raise RuntimeError(f"{op}: status {status}")


@lru_cache(maxsize=None)
def _host():
    lib = native.declare(native.host_lib(), {
        "si_pack_pack_host": _CACHE_ARGS + [_vp, _i32, _vp, _vp, _vp, _i64, _i64, _vp, _vp, _vp, _vp],
        "si_pack_unpack_host": [_vp, _i32, _vp, _i64, _i64, _vp, _vp, _i64, _i64, _vp],
        "si_pack_direct_host": _CACHE_ARGS + [_vp, _i32, _vp, _vp, _vp, _vp, _i64, _i64, _vp, _i64, _i64, _vp, _vp,
                                              _vp],
    })
    lib.si_pack_grid_host.argtypes, lib.si_pack_grid_host.restype = [_i64, _i32, _i32], _i64
    return lib


@lru_cache(maxsize=None)
def _cuda():
    lib = native.cuda_lib()
    if lib is None:
        raise RuntimeError("CUDA tensors given but the CUDA library is unavailable (no nvcc build or no device)")
    native.declare(lib, {
        "si_pack_pack_cuda": _CACHE_ARGS + [_vp, _i32, _vp, _vp, _vp, _i64, _i64, _vp, _vp, _vp, _vp, _vp, _vp],
        "si_pack_unpack_cuda": [_vp, _i32, _vp, _i64, _i64, _vp, _vp, _i64, _i64, _vp, _vp],
        "si_pack_direct_cuda": _CACHE_ARGS + [_vp, _i32, _vp, _vp, _vp, _vp, _i64, _i64, _vp, _i64, _i64, _vp, _vp,
                                              _vp, _vp, _vp],
    })
    lib.si_pack_grid_cuda.argtypes, lib.si_pack_grid_cuda.restype = [_i64, _i32], _i64
    return lib


def grid_ctas(cap: int, n_layers: int, sms: int | None = None) -> int:
    """CTAs of one move launch: for a device with ``sms`` SMs (host formula), or the current CUDA
    device's launch (``sms`` None). Bounded by a few per SM whatever ``cap``."""
    if sms is None:
        return int(_cuda().si_pack_grid_cuda(cap, n_layers))
    return int(_host().si_pack_grid_host(cap, n_layers, sms))


def _err_arg(err, device):
    """Address of the caller's error word (None: none given, a host move raises at once)."""
    if err is None:
        if device.type == "cuda":
            raise ValueError("a CUDA move needs err= (its kernel records errors instead of raising): pass the "
                             "fabric's word (err=fabric.move_err) or an int32 tensor of your own on the data's "
                             "device, and read it with check_error_word(err)")
        return None
    ok_place = err.device == device or (device.type == "cuda" and err.device.type == "cpu" and err.is_pinned())
    if err.dtype != torch.int32 or err.numel() < 1 or not ok_place:
        raise ValueError(f"err must be an int32 tensor on {device} (or pinned host memory for CUDA data), got "
                         f"{err.dtype} {tuple(err.shape)} on {err.device}")
    return ctypes.c_void_p(err.data_ptr())


def _arrive_args(arrive, device) -> list:
    """[flag, seq(, counter)] addresses of a move's arrival signal (the counter on CUDA only), or Nones."""
    cuda = device.type == "cuda"
    if arrive is None:
        return [None, None] + ([None] if cuda else [])
    if len(arrive) != (3 if cuda else 2):
        raise ValueError(f"arrive must be (flag, seq, counter) addresses for a CUDA move, (flag, seq) for a host "
                         f"move, got {len(arrive)} entries for {device}: the counter is the flag's zeroed int32 "
                         "CTA counter (CudaFabric.arrival_flag returns all three)")
    flag, seq = int(arrive[0]), int(arrive[1])
    if not flag or not seq or flag % 8 or seq % 8:
        raise ValueError(f"arrive needs 8-byte aligned (flag, seq) int64 addresses, got ({flag:#x}, {seq:#x})")
    if not cuda:
        return [ctypes.c_void_p(flag), ctypes.c_void_p(seq)]
    counter = int(arrive[2])
    if not counter or counter % 4:
        raise ValueError(f"arrive needs a 4-byte aligned int32 counter address, got {counter:#x}")
    return [ctypes.c_void_p(flag), ctypes.c_void_p(seq), ctypes.c_void_p(counter)]


def check_error_word(err: torch.Tensor) -> None:
    """Raise if a move recorded an error in ``err`` since the last check, and clear it (reads the
    word: a device word syncs its stream). For tests, benchmarks and engine start
    (``CudaFabric.check``); the engine reads its fabric's word a step later (``comm.errors``)."""
    code = int(err.item())
    if code:
        err.zero_()
        raise ValueError(f"pack kernel: {F.describe_error(code)}")


def _count_arg(count, device):
    """(address of the int32 count, object keeping it alive). Plane entries are passed in place;
    a host int (the eager-only chunked path) goes through a ctypes int (host) or a tiny upload (CUDA)."""
    if isinstance(count, torch.Tensor):
        if count.dtype != torch.int32 or count.numel() != 1 or count.device != device:
            raise ValueError(f"count must be one int32 on {device}, got {count.dtype} {tuple(count.shape)} "
                             f"on {count.device}")
        return native.ptr(count), count
    if device.type == "cuda":
        t = torch.tensor(int(count), dtype=torch.int32, device=device)
        return native.ptr(t), t
    c = ctypes.c_int32(int(count))
    return ctypes.addressof(c), c


def _ptr(t: torch.Tensor):
    return native.ptr(t) if t.numel() else None


def _ws_ptr(ws: torch.Tensor):
    """A workspace's base address: it may be a layer-strided view (the kernels take its layer stride
    and row count), which ``native.ptr`` would refuse; ``_check_ws`` checked its rows are contiguous."""
    return ctypes.c_void_p(ws.data_ptr()) if ws.numel() else None


def _stream(device):
    return native.stream_handle(device)


def pack(shard: Shard, layers: torch.Tensor, req, local, count, cap: int, out: torch.Tensor, *,
         err: torch.Tensor | None = None, arrive: tuple[int, ...] | None = None) -> None:
    """``out[:J*n*width]`` viewed as [J, n, width] <- the shard's records (request, local) of ``layers``;
    ``err`` and ``arrive``: module docstring."""
    dev, width, J = shard.device, shard.width, layers.shape[0]
    for name, t in (("layers", layers), ("req", req), ("local", local)):
        _check_index(name, t, J if name == "layers" else cap, dev)
    if out.dtype != torch.uint8 or not out.is_contiguous() or out.numel() < J * cap * width:
        raise ValueError(f"packed region must be contiguous uint8 with >= {J * cap * width} bytes")
    word, sig = _err_arg(err, dev), _arrive_args(arrive, dev)
    n_ptr, _keep = _count_arg(count, dev)
    if dev.type == "cuda":
        st = _cuda().si_pack_pack_cuda(*shard.cache_args(), _ptr(layers), J, _ptr(req), _ptr(local), n_ptr, cap,
                                       width, _ptr(out), word, *sig, _stream(dev))
    else:
        st = _host().si_pack_pack_host(*shard.cache_args(), _ptr(layers), J, _ptr(req), _ptr(local), n_ptr, cap,
                                       width, _ptr(out), word, *sig)
    _status("pack", st, word)


def unpack(packed: torch.Tensor, n_layers: int, count, cap: int, slot, ws: torch.Tensor, *,
           err: torch.Tensor | None = None) -> None:
    """``ws[j, slot[i]] <- packed[j, i]`` for the first ``count`` records of a received region;
    nothing when ``err`` is set (the region's arrival wait failed: its bytes are stale)."""
    width = ws.shape[2]
    _check_ws(ws, n_layers, width)
    _check_index("slot", slot, cap, ws.device)
    if packed.dtype != torch.uint8 or not packed.is_contiguous() or packed.numel() < n_layers * cap * width:
        raise ValueError(f"received region must be contiguous uint8 with >= {n_layers * cap * width} bytes")
    word = _err_arg(err, ws.device)
    n_ptr, _keep = _count_arg(count, ws.device)
    if ws.device.type == "cuda":
        st = _cuda().si_pack_unpack_cuda(_ptr(packed), n_layers, n_ptr, cap, width, _ptr(slot), _ws_ptr(ws),
                                         ws.stride(0), ws.shape[1], word, _stream(ws.device))
    else:
        st = _host().si_pack_unpack_host(_ptr(packed), n_layers, n_ptr, cap, width, _ptr(slot), _ws_ptr(ws),
                                         ws.stride(0), ws.shape[1], word)
    _status("unpack", st, word)


def direct(shard: Shard, layers: torch.Tensor, req, local, slot, count, cap: int, ws: torch.Tensor, *,
           err: torch.Tensor | None = None, arrive: tuple[int, ...] | None = None) -> None:
    """``ws[j, slot[i]] <- shard record (req[i], local[i]) of layers[j]``: own records, no slab, or
    a device-sized exchange's records straight into a peer's region (``ws`` its view, ``arrive``
    its arrival flag: module docstring)."""
    dev, width, J = shard.device, shard.width, layers.shape[0]
    _check_ws(ws, J, width)
    for name, t in (("layers", layers), ("req", req), ("local", local), ("slot", slot)):
        _check_index(name, t, J if name == "layers" else cap, dev)
    word, sig = _err_arg(err, dev), _arrive_args(arrive, dev)
    n_ptr, _keep = _count_arg(count, dev)
    if dev.type == "cuda":
        st = _cuda().si_pack_direct_cuda(*shard.cache_args(), _ptr(layers), J, _ptr(req), _ptr(local), _ptr(slot),
                                         n_ptr, cap, width, _ws_ptr(ws), ws.stride(0), ws.shape[1],
                                         word, *sig, _stream(dev))
    else:
        st = _host().si_pack_direct_host(*shard.cache_args(), _ptr(layers), J, _ptr(req), _ptr(local), _ptr(slot),
                                         n_ptr, cap, width, _ws_ptr(ws), ws.stride(0), ws.shape[1], word, *sig)
    _status("direct", st, word)


# --- torch reference (what the tests compare the native moves against) ---------------------------

def pack_reference(shard: Shard, layers, req, local, n: int) -> torch.Tensor:
    """[J, n, width] records, gathered with torch indexing."""
    block, row = shard.blocks_of(req[:n], local[:n])
    return torch.stack([shard.layers[l][block, row] for l in layers.tolist()])


def unpack_reference(packed: torch.Tensor, slot, n: int, ws: torch.Tensor) -> None:
    ws[:, slot[:n].long()] = packed


def direct_reference(shard: Shard, layers, req, local, slot, n: int, ws: torch.Tensor) -> None:
    unpack_reference(pack_reference(shard, layers, req, local, n), slot, n, ws)
