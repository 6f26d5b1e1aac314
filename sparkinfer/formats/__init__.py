"""Record formats: ``get_format(name, **options)``.

    fmt = get_format("nvfp4_ds_mla:fp8-rope-368")   # 368 B
    fmt = get_format("nvfp4_ds_mla:bf16-rope-432", outer_scale=1.0)   # 432 B
    fmt = get_format("fp8_ds_mla", scale_format="ue8m0" | "arbitrary_fp32")   # 656 B
    fmt = get_format("indexer_fp8")   # 132 B
    recs = fmt.encode(latent [N,512], rope [N,64])   # -> uint8 [N, record_bytes]
    latent, rope = fmt.decode(recs)                   # -> fp32 [N,512], fp32 [N,64]
    key = get_format("indexer_fp8").decode(get_format("indexer_fp8").encode(key))

Short names (``nvfp4_368``, ``nvfp4_432``) and widths (``"368"``) are accepted.
"""

from __future__ import annotations

from sparkinfer.core.layouts import layout

from .base import RecordFormat
from .fp8 import Fp8DsMla656, IndexerFp8132
from .nvfp4 import Nvfp4Bf16Rope432, Nvfp4Fp8Rope368

_CLASSES = {cls.layout.name: cls for cls in (Nvfp4Fp8Rope368, Nvfp4Bf16Rope432, Fp8DsMla656, IndexerFp8132)}
_OPTIONS = {
    "nvfp4_ds_mla:fp8-rope-368": (),
    "nvfp4_ds_mla:bf16-rope-432": ("outer_scale",),
    "fp8_ds_mla": ("scale_format",),
    "indexer_fp8": (),
}

ALL_FORMATS = tuple(_CLASSES)
MAIN_FORMATS = ALL_FORMATS[:3]


def get_format(name: str, **options) -> RecordFormat:
    """The format object for a name; unknown names and options raise ValueError."""
    if isinstance(name, RecordFormat):
        return name
    canonical = layout(name).name  # raises ValueError listing the known names
    bad = set(options) - set(_OPTIONS[canonical])
    if bad:
        allowed = ", ".join(_OPTIONS[canonical]) or "none"
        raise ValueError(f"{canonical} takes options: {allowed}; got {sorted(bad)}")
    return _CLASSES[canonical](**options)


__all__ = ["get_format", "RecordFormat", "ALL_FORMATS", "MAIN_FORMATS"]
