"""NVFP4 latent records: ``nvfp4_ds_mla:fp8-rope-368`` and ``nvfp4_ds_mla:bf16-rope-432``.

368 (dynamic per-token outer scale s_t, fp8 rope)::

    [0,256)   512 E2M1 codes      [256,288) 32 E4M3 group scales c_g
    [288,292) fp32 rope scale r   [292,296) fp32 s_t   [296,304) zero
    [304,368) 64 E4M3 rope codes

432 (per-cache constant outer scale S, bf16 rope)::

    [0,256) codes   [256,288) group scales   [288,304) zero   [304,432) 64 bf16 rope

Encode: s_t = max(amax/2688, tiny); c_g = E4M3(amax_g / (6*s)); m_g = s * d_g;
code_i = E2M1(x_i / m_g) (0 when m_g == 0). Decode: x_i = value(code_i) * d_g * s.
"""

from __future__ import annotations

import torch

from sparkinfer.core import layouts

from . import codecs as C
from .base import RecordFormat

_GROUPS = layouts.LATENT_DIM // layouts.NVFP4_GROUP


def _encode_latent(x: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x fp32 [N, 512], s fp32 [N] -> (packed codes [N, 256], group scale codes [N, 32])."""
    n = x.shape[0]
    xg = x.view(n, _GROUPS, layouts.NVFP4_GROUP)
    scale_codes = C.e4m3_encode(xg.abs().amax(dim=2) / (6.0 * s)[:, None])
    m = s[:, None] * C.e4m3_decode(scale_codes)  # [N, 32]
    codes = torch.where((m > 0)[..., None], C.e2m1_encode(xg / m[..., None]), torch.zeros((), dtype=torch.uint8))
    return C.e2m1_pack(codes.view(n, -1)), scale_codes


def _decode_latent(recs: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    n = recs.shape[0]
    values = C.e2m1_decode(C.e2m1_unpack(recs[:, :256])).view(n, _GROUPS, layouts.NVFP4_GROUP)
    d = C.e4m3_decode(recs[:, 256:288].contiguous())
    return (values * d[..., None] * s[:, None, None]).view(n, layouts.LATENT_DIM)


class Nvfp4Fp8Rope368(RecordFormat):
    layout = layouts.NVFP4_368
    fmt_id = 1

    def _encode_ref(self, latent, rope):
        n = latent.shape[0]
        s = torch.clamp_min(latent.abs().amax(dim=1) / 2688.0, C.TINY)
        packed, scale_codes = _encode_latent(latent, s)
        r = torch.clamp_min(rope.abs().amax(dim=1) / 448.0, C.TINY)
        out = torch.zeros(n, 368, dtype=torch.uint8)
        out[:, 0:256] = packed
        out[:, 256:288] = scale_codes
        out[:, 288:292] = C.f32_to_bytes(r)
        out[:, 292:296] = C.f32_to_bytes(s)
        out[:, 304:368] = C.e4m3_encode(rope / r[:, None])
        return out

    def _decode_ref(self, recs):
        r = C.bytes_to_f32(recs[:, 288:292])
        s = C.bytes_to_f32(recs[:, 292:296])
        return _decode_latent(recs, s), C.e4m3_decode(recs[:, 304:368].contiguous()) * r[:, None]


class Nvfp4Bf16Rope432(RecordFormat):
    layout = layouts.NVFP4_432
    fmt_id = 2

    def __init__(self, outer_scale: float = 1.0):
        outer_scale = float(outer_scale)
        # S must survive the fp32 round trip and keep every m_g = S * d_g finite and non-zero.
        if not (outer_scale > 0 and torch.isfinite(torch.tensor(outer_scale, dtype=torch.float32))
                and float(torch.tensor(outer_scale, dtype=torch.float32)) >= C.TINY):
            raise ValueError(f"outer_scale must be a positive finite fp32 value >= 2**-126, got {outer_scale}")
        self.outer_scale = float(torch.tensor(outer_scale, dtype=torch.float32))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} (432 B, S={self.outer_scale})>"

    def _encode_ref(self, latent, rope):
        n = latent.shape[0]
        s = torch.full((n,), self.outer_scale, dtype=torch.float32)
        packed, scale_codes = _encode_latent(latent, s)
        out = torch.zeros(n, 432, dtype=torch.uint8)
        out[:, 0:256] = packed
        out[:, 256:288] = scale_codes
        out[:, 304:432] = C.bf16_encode(rope)
        return out

    def _decode_ref(self, recs):
        s = torch.full((recs.shape[0],), self.outer_scale, dtype=torch.float32)
        return _decode_latent(recs, s), C.bf16_decode(recs[:, 304:432])
