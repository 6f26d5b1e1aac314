"""fp8 records: ``fp8_ds_mla`` (656 B, vLLM/FlashMLA's sparse MLA format) and the
132-byte indexer key.

656::

    [0,512)   512 E4M3 latent values, four tiles of 128
    [512,528) four fp32 tile scales
    [528,656) 64 bf16 rope values

scale_format "ue8m0" (vLLM's writer): scale_t = 2**ceil(log2(max(amax_t * R, 1e-4))),
R the fp32 constant 1/448; "arbitrary_fp32": scale_t = max(amax_t / 448, tiny).

132::

    [0,128) 128 E4M3 key values   [128,132) fp32 scale 2**ceil(log2(max(amax, 1e-4) / 448))
"""

from __future__ import annotations

import torch

from sparkinfer.core import layouts

from . import codecs as C
from .base import RecordFormat

_R = torch.tensor(1.0 / 448.0, dtype=torch.float32)  # the fp32 constant, rounded once
_FLOOR = torch.tensor(1e-4, dtype=torch.float32)
SCALE_FORMATS = {"ue8m0": 0, "arbitrary_fp32": 1}


class Fp8DsMla656(RecordFormat):
    layout = layouts.FP8_DS_MLA
    fmt_id = 3

    def __init__(self, scale_format: str = "ue8m0"):
        if scale_format not in SCALE_FORMATS:
            raise ValueError(f"scale_format must be one of {sorted(SCALE_FORMATS)}, got {scale_format!r}")
        self.scale_format = scale_format
        self.scale_format_id = SCALE_FORMATS[scale_format]

    def __repr__(self) -> str:
        return f"<{type(self).__name__} fp8_ds_mla (656 B, {self.scale_format})>"

    def _tile_scales(self, tile_amax: torch.Tensor) -> torch.Tensor:
        if self.scale_format == "arbitrary_fp32":
            return torch.clamp_min(tile_amax / 448.0, C.TINY)
        return C.pow2_ceil(torch.maximum(tile_amax * _R, _FLOOR))

    def _encode_ref(self, latent, rope):
        n = latent.shape[0]
        tiles = latent.view(n, 4, layouts.FP8_TILE)
        scales = self._tile_scales(tiles.abs().amax(dim=2))
        out = torch.empty(n, 656, dtype=torch.uint8)
        out[:, 0:512] = C.e4m3_encode(tiles / scales[..., None]).view(n, 512)
        out[:, 512:528] = C.f32_to_bytes(scales).view(n, 16)
        out[:, 528:656] = C.bf16_encode(rope)
        return out

    def _decode_ref(self, recs):
        n = recs.shape[0]
        scales = C.bytes_to_f32(recs[:, 512:528].reshape(n, 4, 4))
        codes = recs[:, 0:512].contiguous().view(n, 4, layouts.FP8_TILE)
        return (C.e4m3_decode(codes) * scales[..., None]).view(n, 512), C.bf16_decode(recs[:, 528:656])


class IndexerFp8132(RecordFormat):
    layout = layouts.INDEXER_FP8
    fmt_id = 4
    value_dim = layouts.INDEX_DIM
    rope_dim = 0

    def _encode_ref(self, key, _rope=None):
        n = key.shape[0]
        s = C.pow2_ceil(torch.maximum(key.abs().amax(dim=1), _FLOOR) / 448.0)
        out = torch.empty(n, 132, dtype=torch.uint8)
        out[:, 0:128] = C.e4m3_encode(key / s[:, None])
        out[:, 128:132] = C.f32_to_bytes(s)
        return out

    def _decode_ref(self, recs):
        s = C.bytes_to_f32(recs[:, 128:132])
        return C.e4m3_decode(recs[:, 0:128].contiguous()) * s[:, None], None
