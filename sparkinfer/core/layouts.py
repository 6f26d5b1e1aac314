"""Byte layouts of every per-token record (torch-free).

This is the single Python statement of ``../shared/spec/record-formats.md``.
The torch codecs (``sparkinfer.formats``), the C++ header
(``csrc/include/sparkinfer/records.h``) and the Triton readers all follow these
offsets; ``tests/formats/test_formats.py`` (``test_layout_constants_agree_with_csrc``) checks that the C++ constants agree.

All fields are little-endian; offsets are bytes within one record.

368  nvfp4_ds_mla:fp8-rope-368
     [0,256)   latent: 512 E2M1 codes, element 2i low nibble, 2i+1 high nibble
     [256,288) 32 E4M3 group scales (group g = latent[16g,16g+16))
     [288,292) fp32 rope scale r
     [292,296) fp32 per-token outer scale s_t
     [296,304) zero
     [304,368) rope: 64 E4M3
432  nvfp4_ds_mla:bf16-rope-432
     [0,256) latent codes, [256,288) group scales, [288,304) zero,
     [304,432) rope: 64 bf16
656  fp8_ds_mla
     [0,512) latent: 512 E4M3, [512,528) 4 fp32 tile scales (128 each),
     [528,656) rope: 64 bf16
132  indexer_fp8
     [0,128) key: 128 E4M3, [128,132) fp32 power-of-two scale
"""

from __future__ import annotations

from dataclasses import dataclass

LATENT_DIM = 512  # kv_lora_rank
ROPE_DIM = 64  # qk_rope_head_dim
INDEX_DIM = 128  # index_head_dim

NVFP4_GROUP = 16
FP8_TILE = 128
E4M3_MAX = 448.0
E2M1_MAX = 6.0
TINY = 2.0 ** -126


@dataclass(frozen=True)
class Field:
    name: str
    offset: int
    nbytes: int


@dataclass(frozen=True)
class RecordLayout:
    """One record ABI: its name, width and field table."""

    name: str
    short: str
    record_bytes: int
    fields: tuple[Field, ...]

    def field(self, name: str) -> Field:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(f"{self.name} has no field {name!r}; fields: {[f.name for f in self.fields]}")

    def __post_init__(self):
        end = 0
        for f in self.fields:
            assert f.offset == end, f"{self.name}: field {f.name} at {f.offset}, expected {end}"
            end += f.nbytes
        assert end == self.record_bytes, f"{self.name}: fields cover {end} of {self.record_bytes} bytes"
        assert self.record_bytes % 4 == 0


NVFP4_368 = RecordLayout(
    "nvfp4_ds_mla:fp8-rope-368", "nvfp4_368", 368,
    (Field("latent", 0, 256), Field("group_scales", 256, 32), Field("rope_scale", 288, 4),
     Field("outer_scale", 292, 4), Field("pad", 296, 8), Field("rope", 304, 64)),
)
NVFP4_432 = RecordLayout(
    "nvfp4_ds_mla:bf16-rope-432", "nvfp4_432", 432,
    (Field("latent", 0, 256), Field("group_scales", 256, 32), Field("pad", 288, 16),
     Field("rope", 304, 128)),
)
FP8_DS_MLA = RecordLayout(
    "fp8_ds_mla", "fp8_ds_mla", 656,
    (Field("latent", 0, 512), Field("tile_scales", 512, 16), Field("rope", 528, 128)),
)
INDEXER_FP8 = RecordLayout(
    "indexer_fp8", "indexer_fp8", 132,
    (Field("key", 0, 128), Field("scale", 128, 4)),
)

MAIN_LAYOUTS = (NVFP4_368, NVFP4_432, FP8_DS_MLA)
ALL_LAYOUTS = MAIN_LAYOUTS + (INDEXER_FP8,)

_BY_NAME = {}
for _l in ALL_LAYOUTS:
    _BY_NAME[_l.name] = _l
    _BY_NAME[_l.short] = _l
    _BY_NAME[str(_l.record_bytes)] = _l


def canonical_name(name: str) -> str:
    """Full format name for a full name, a short name (``nvfp4_368``) or a width (``"368"``)."""
    return layout(name).name


def layout(name: str) -> RecordLayout:
    try:
        return _BY_NAME[str(name)]
    except KeyError:
        known = ", ".join(sorted(lay.name for lay in ALL_LAYOUTS))
        raise ValueError(f"unknown record format {name!r}; expected one of: {known} "
                         f"(short names: nvfp4_368, nvfp4_432)") from None
