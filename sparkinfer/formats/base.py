"""The record-format object: validation, dispatch and the paged-cache entry points.

A format owns one byte layout (``sparkinfer.core.layouts``) and three
implementations of it that produce identical bytes:

* the torch reference (``_encode_ref`` / ``_decode_ref`` of each subclass),
* the host build of ``csrc/`` (``backend="host"``),
* the CUDA build (``backend="cuda"``, tensors on a GPU).

``encode``/``decode`` pick the reference on CPU and the kernel on a GPU;
``write``/``gather`` are the paged-cache operations the cache writer and the
transport use.
"""

from __future__ import annotations

import torch

from sparkinfer.core.layouts import RecordLayout

_FLOAT_INPUTS = (torch.float32, torch.bfloat16)


def check_values(t, name: str, width: int, checks=None) -> torch.Tensor:
    """Validate a [N, width] float32/bf16 finite tensor; return it as contiguous fp32.

    ``checks`` (``sparkinfer.decode.device_checks.DeviceChecks``, the hot path's form): finiteness is
    not read back here but flagged on the device (``record_values``), read a step later."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of shape [N, {width}], got {type(t).__name__}")
    if t.dim() != 2 or t.shape[1] != width:
        raise ValueError(f"{name} must have shape [N, {width}], got {list(t.shape)}")
    if t.dtype not in _FLOAT_INPUTS:
        raise ValueError(f"{name} must be float32 or bfloat16, got {t.dtype}")
    t = t.to(torch.float32).contiguous()  # bf16 -> fp32 is exact
    if checks is not None:
        checks.flag_nonfinite("record_values", t)
    elif not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name} contains NaN or infinity; records can only hold finite values")
    return t


class RecordFormat:
    """Base class; subclasses set ``layout``, ``fmt_id`` and the reference codec."""

    layout: RecordLayout
    fmt_id: int  # si::RecordFormat in csrc/include/sparkinfer/records.h
    value_dim: int = 512  # latent width (128 for the indexer key)
    rope_dim: int = 64  # 0 for the indexer key
    scale_format_id: int = 0
    outer_scale: float = 1.0

    @property
    def name(self) -> str:
        return self.layout.name

    @property
    def record_bytes(self) -> int:
        return self.layout.record_bytes

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} ({self.record_bytes} B)>"

    # ---- validation -------------------------------------------------------------
    def _inputs(self, latent, rope, checks=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        latent = check_values(latent, "latent" if self.rope_dim else "key", self.value_dim, checks)
        if self.rope_dim == 0:
            if rope is not None:
                raise ValueError(f"{self.name} encodes a key only: call encode(key)")
            return latent, None
        if rope is None:
            raise ValueError(f"{self.name} needs rope [N, {self.rope_dim}] as well as latent")
        rope = check_values(rope, "rope", self.rope_dim, checks)
        if rope.shape[0] != latent.shape[0]:
            raise ValueError(f"latent has {latent.shape[0]} tokens but rope has {rope.shape[0]}")
        if rope.device != latent.device:
            raise ValueError("latent and rope must be on the same device")
        return latent, rope

    def check_records(self, recs, name: str = "records") -> torch.Tensor:
        if not isinstance(recs, torch.Tensor) or recs.dtype != torch.uint8 or recs.dim() != 2:
            got = f"{recs.dtype} {list(recs.shape)}" if isinstance(recs, torch.Tensor) else type(recs).__name__
            raise ValueError(f"{name} must be a torch.uint8 tensor [N, {self.record_bytes}], got {got}")
        if recs.shape[1] != self.record_bytes:
            raise ValueError(f"{name} are {recs.shape[1]} bytes wide but {self.name} records are "
                             f"{self.record_bytes} bytes; wrong format for this cache?")
        return recs

    # ---- public codec -----------------------------------------------------------
    def encode(self, latent, rope=None, backend: str = "auto", *, checks=None) -> torch.Tensor:
        """latent [N, 512] (indexer: key [N, 128]), rope [N, 64] fp32/bf16 -> uint8 [N, record_bytes].

        backend: "auto" (reference on CPU, kernel on GPU), "torch", "host", "cuda". ``checks``: see
        ``check_values`` (no host read of the values).
        """
        latent, rope = self._inputs(latent, rope, checks)
        backend = self._backend(backend, latent.device)
        if backend == "torch":
            return self._encode_ref(latent, rope)
        out = torch.empty(latent.shape[0], self.record_bytes, dtype=torch.uint8, device=latent.device)
        from . import native
        native.encode(self, latent, rope, out, None)
        return out

    def decode(self, recs, backend: str = "auto"):
        """uint8 [N, record_bytes] -> (latent fp32 [N, 512], rope fp32 [N, 64]); indexer: key fp32 [N, 128]."""
        recs = self.check_records(recs)
        backend = self._backend(backend, recs.device)
        if backend == "torch":
            latent, rope = self._decode_ref(recs.contiguous())
        else:
            from . import native
            latent, rope = native.gather(self, recs.contiguous(), None)
        return latent if self.rope_dim == 0 else (latent, rope)

    # ---- paged cache ------------------------------------------------------------
    def write(self, cache: torch.Tensor, slots: torch.Tensor, latent, rope=None) -> None:
        """Encode token i into ``cache[slots[i]]`` (slot -1: skip).

        cache: uint8 [num_slots, record_bytes] or any uint8 tensor whose last
        dims flatten to that (e.g. [num_blocks, block_size, record_bytes]);
        slots: int64 [N]. Runs the CUDA kernel on a GPU, the host build on CPU.
        Checked on the host; a layer's forward writes through ``native.write_paged``
        (``decode.paged_sparse_mla.forward_write_records``).
        """
        latent, rope = self._inputs(latent, rope)
        flat = self._flat_cache(cache)
        slots = self._check_slots(slots, latent.shape[0], flat.shape[0], latent.device)
        from . import native
        native.encode(self, latent, rope, flat, slots)

    def gather(self, cache: torch.Tensor, indices: torch.Tensor):
        """Decode ``cache[indices[i]]`` (index -1: zeros) -> like ``decode``."""
        flat = self._flat_cache(cache)
        idx = self._check_slots(indices, indices.shape[0] if isinstance(indices, torch.Tensor) else -1,
                                flat.shape[0], flat.device)
        from . import native
        latent, rope = native.gather(self, flat, idx)
        return latent if self.rope_dim == 0 else (latent, rope)

    def _flat_cache(self, cache) -> torch.Tensor:
        if not isinstance(cache, torch.Tensor) or cache.dtype != torch.uint8 or cache.shape[-1] != self.record_bytes:
            raise ValueError(f"cache must be a torch.uint8 tensor [..., {self.record_bytes}] for {self.name}")
        if not cache.is_contiguous():
            raise ValueError("cache must be contiguous")
        return cache.view(-1, self.record_bytes)

    @staticmethod
    def _check_slots(slots, n: int, num_slots: int, device) -> torch.Tensor:
        if not isinstance(slots, torch.Tensor) or slots.dim() != 1 or slots.shape[0] != n:
            raise ValueError(f"slots/indices must be a 1-D integer tensor of length {n}")
        if slots.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"slots/indices must be int32 or int64, got {slots.dtype}")
        if slots.device != device:
            raise ValueError("slots/indices must be on the cache's device")
        slots = slots.to(torch.int64).contiguous()
        if slots.numel() and (int(slots.min()) < -1 or int(slots.max()) >= num_slots):
            raise ValueError(f"slots/indices must lie in [-1, {num_slots}); got range "
                             f"[{int(slots.min())}, {int(slots.max())}]")
        return slots

    @staticmethod
    def _backend(backend: str, device: torch.device) -> str:
        if backend == "auto":
            return "cuda" if device.type == "cuda" else "torch"
        if backend not in ("torch", "host", "cuda"):
            raise ValueError(f"backend must be auto, torch, host or cuda, got {backend!r}")
        if backend == "cuda" and device.type != "cuda":
            raise ValueError("backend='cuda' needs tensors on a CUDA device")
        if backend == "host" and device.type != "cpu":
            raise ValueError("backend='host' needs CPU tensors")
        return backend

    # ---- subclass hooks ---------------------------------------------------------
    def _encode_ref(self, latent: torch.Tensor, rope: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def _decode_ref(self, recs: torch.Tensor):
        raise NotImplementedError
