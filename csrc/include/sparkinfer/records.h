// Per-record encode/decode logic for every record format, written once.
//
// The CUDA kernels (csrc/cuda/records.cu) run these functions in parallel
// (one lane per 16-value group) and the host twin (csrc/host/records_host.cpp)
// runs the same functions in a loop; max is exact and order-free, so both give
// identical bytes. The byte layouts are sparkinfer/core/layouts.py and
// ../shared/spec/record-formats.md.
//
// Every float step is one IEEE fp32 operation in the order the spec writes it:
// build with no FMA contraction, no flush-to-zero, IEEE division (see
// sparkinfer/native/build.py).
#pragma once

#include <math.h>
#include <string.h>

#include "sparkinfer/common.h"

namespace si {

// ---- format ids of the C ABI ------------------------------------------------
enum RecordFormat : int32_t {
  FMT_NVFP4_368 = 1,    // nvfp4_ds_mla:fp8-rope-368
  FMT_NVFP4_432 = 2,    // nvfp4_ds_mla:bf16-rope-432
  FMT_FP8_DS_MLA = 3,   // fp8_ds_mla (656)
  FMT_INDEXER_FP8 = 4,  // indexer key (132)
};
enum ScaleFormat : int32_t { SCALE_UE8M0 = 0, SCALE_ARBITRARY_FP32 = 1 };

constexpr int kLatentDim = 512;
constexpr int kRopeDim = 64;
constexpr int kIndexDim = 128;
constexpr int kGroup = 16;    // NVFP4 group
constexpr int kTile = 128;    // fp8_ds_mla tile
constexpr float kTiny = 1.17549435e-38f;  // 2**-126

// Field offsets (bytes), mirrored in sparkinfer/core/layouts.py.
constexpr int kNvfp4ScalesOff = 256;
constexpr int kNvfp4RopeScaleOff = 288;   // 368 only
constexpr int kNvfp4OuterScaleOff = 292;  // 368 only
constexpr int kNvfp4RopeOff = 304;
constexpr int kFp8ScalesOff = 512;
constexpr int kFp8RopeOff = 528;
constexpr int kIndexerScaleOff = 128;

SI_HD int record_bytes(int32_t fmt) {
  return fmt == FMT_NVFP4_368 ? 368 : fmt == FMT_NVFP4_432 ? 432
       : fmt == FMT_FP8_DS_MLA ? 656 : fmt == FMT_INDEXER_FP8 ? 132 : 0;
}

// ---- scalar codecs -----------------------------------------------------------
SI_HD uint32_t f32_bits(float x) { uint32_t b; memcpy(&b, &x, 4); return b; }
SI_HD float bits_f32(uint32_t b) { float x; memcpy(&x, &b, 4); return x; }
SI_HD bool finite_f32(float x) { return (f32_bits(x) & 0x7f800000u) != 0x7f800000u; }
// Element i of a model's input row, fp32 or bf16 (bf16 -> fp32 is exact): what the paged writer reads.
SI_HD float load_input(const void* base, int64_t i, int32_t bf16) {
  return bf16 ? bits_f32((uint32_t)((const uint16_t*)base)[i] << 16) : ((const float*)base)[i];
}
// A paged write's slot: -1 skips; below -1, in vLLM's null block or past the cache it is bad (skipped, flagged).
SI_HD bool bad_slot(int64_t slot, int64_t num_blocks, int64_t block_size, int64_t null_block) {
  return slot < -1 || slot >= num_blocks * block_size || (slot >= 0 && slot / block_size == null_block);
}

// E4M3 (float8_e4m3fn): clamp to +-448, round to nearest even; -0 keeps its sign
// as torch's conversion does.
SI_HD uint8_t e4m3_encode(float x) {
  x = fminf(fmaxf(x, -448.0f), 448.0f);
  const uint32_t b = f32_bits(x);
  const uint8_t sign = (uint8_t)((b >> 24) & 0x80u);
  const float a = fabsf(x);
  if (a < 0.015625f) {  // below 2**-6: subnormal codes m * 2**-9, m = 0..8
    return sign | (uint8_t)rintf(a * 512.0f);  // exact scaling, RNE; 8 is the smallest normal
  }
  const uint32_t ab = b & 0x7fffffffu;
  const uint32_t rounded = ab + 0x7ffffu + ((ab >> 20) & 1u);  // RNE to 3 mantissa bits
  return sign | (uint8_t)((rounded >> 20) - (120u << 3));      // rebias exponent 127 -> 7
}

SI_HD float e4m3_decode(uint8_t c) {
  const int e = (c >> 3) & 15, m = c & 7;
  float a;
  if (e == 15 && m == 7) a = NAN;
  else if (e == 0) a = ldexpf((float)m, -9);
  else a = ldexpf((float)(8 + m), e - 10);
  return (c & 0x80) ? -a : a;
}

// E2M1: magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6; ties to the even code, so the
// boundary tie goes down at 0.25, 1.25, 2.5, 5 and up at 0.75, 1.75, 3.5.
SI_HD uint8_t e2m1_encode(float y) {
  const float a = fabsf(y);
  const uint8_t c = (uint8_t)((a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) +
                              (a > 2.5f) + (a >= 3.5f) + (a > 5.0f));
  return (c != 0 && (f32_bits(y) >> 31)) ? (uint8_t)(c | 8) : c;  // magnitude 0 is +0
}

SI_HD float e2m1_decode(uint8_t c) {
  const float mags[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float a = mags[c & 7];
  return (c & 8) ? -a : a;
}

SI_HD uint16_t bf16_encode(float x) {  // round to nearest even; inputs are finite
  const uint32_t b = f32_bits(x);
  return (uint16_t)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}
SI_HD float bf16_decode(uint16_t h) { return bits_f32((uint32_t)h << 16); }

// 2**ceil(log2(v)) for a positive normal v, exactly (no log2 rounding).
SI_HD float pow2_ceil(float v) {
  const uint32_t b = f32_bits(v);
  const uint32_t e = ((b >> 23) & 0xffu) + ((b & 0x7fffffu) != 0u);
  return bits_f32(e << 23);
}

SI_HD float amax(const float* x, int n) {
  float m = 0.0f;
  for (int i = 0; i < n; ++i) m = fmaxf(m, fabsf(x[i]));
  return m;
}

SI_HD void store_f32(uint8_t* dst, float v) { memcpy(dst, &v, 4); }
SI_HD float load_f32(const uint8_t* src) { float v; memcpy(&v, src, 4); return v; }

// ---- NVFP4 latent (368 and 432) ------------------------------------------------
// 368: dynamic per-token outer scale s_t; 432: a per-cache constant S.
SI_HD float nvfp4_token_scale(float token_amax) { return fmaxf(token_amax / 2688.0f, kTiny); }
SI_HD uint8_t nvfp4_group_scale(float group_amax, float s) { return e4m3_encode(group_amax / (6.0f * s)); }

// 16 latent values -> 8 bytes of E2M1 pairs (element 2i low nibble).
SI_HD void nvfp4_encode_group(const float* x, uint8_t scale_code, float s, uint8_t* out) {
  const float m = s * e4m3_decode(scale_code);
  for (int i = 0; i < kGroup / 2; ++i) {
    const uint8_t lo = m > 0.0f ? e2m1_encode(x[2 * i] / m) : 0;
    const uint8_t hi = m > 0.0f ? e2m1_encode(x[2 * i + 1] / m) : 0;
    out[i] = (uint8_t)(lo | (hi << 4));
  }
}

SI_HD void nvfp4_decode_group(const uint8_t* in, uint8_t scale_code, float s, float* x) {
  const float d = e4m3_decode(scale_code);
  for (int i = 0; i < kGroup / 2; ++i) {
    x[2 * i] = e2m1_decode(in[i] & 15) * d * s;
    x[2 * i + 1] = e2m1_decode(in[i] >> 4) * d * s;
  }
}

// ---- fp8 tiles (656 latent) and the indexer key -------------------------------
SI_HD float fp8_tile_scale(float tile_amax, int32_t scale_format) {
  if (scale_format == SCALE_ARBITRARY_FP32) return fmaxf(tile_amax / 448.0f, kTiny);
  const float u = tile_amax * (1.0f / 448.0f);  // the fp32 constant R = 1/448, one fp32 product
  return pow2_ceil(fmaxf(u, 1e-4f));
}
SI_HD float indexer_scale(float key_amax) { return pow2_ceil(fmaxf(key_amax, 1e-4f) / 448.0f); }

SI_HD void fp8_encode_values(const float* x, int n, float scale, uint8_t* out) {
  for (int i = 0; i < n; ++i) out[i] = e4m3_encode(x[i] / scale);
}
SI_HD void fp8_decode_values(const uint8_t* in, int n, float scale, float* x) {
  for (int i = 0; i < n; ++i) x[i] = e4m3_decode(in[i]) * scale;
}

SI_HD void bf16_encode_values(const float* x, int n, uint8_t* out) {
  for (int i = 0; i < n; ++i) {
    const uint16_t h = bf16_encode(x[i]);
    out[2 * i] = (uint8_t)(h & 0xff);
    out[2 * i + 1] = (uint8_t)(h >> 8);
  }
}
SI_HD void bf16_decode_values(const uint8_t* in, int n, float* x) {
  for (int i = 0; i < n; ++i) x[i] = bf16_decode((uint16_t)(in[2 * i] | (in[2 * i + 1] << 8)));
}

// ---- whole records, sequential (the host twin; kernels split these by group) ----
// latent: 512 floats (128 for the indexer key); rope: 64 floats (unused for the
// indexer); outer_scale: S of the 432 format.
SI_HD void encode_record(int32_t fmt, const float* latent, const float* rope, uint8_t* rec,
                         float outer_scale, int32_t scale_format) {
  if (fmt == FMT_NVFP4_368 || fmt == FMT_NVFP4_432) {
    const float s = fmt == FMT_NVFP4_368 ? nvfp4_token_scale(amax(latent, kLatentDim)) : outer_scale;
    for (int g = 0; g < kLatentDim / kGroup; ++g) {
      const uint8_t c = nvfp4_group_scale(amax(latent + g * kGroup, kGroup), s);
      rec[kNvfp4ScalesOff + g] = c;
      nvfp4_encode_group(latent + g * kGroup, c, s, rec + g * kGroup / 2);
    }
    for (int i = 288; i < kNvfp4RopeOff; ++i) rec[i] = 0;
    if (fmt == FMT_NVFP4_368) {
      const float r = fmaxf(amax(rope, kRopeDim) / 448.0f, kTiny);
      store_f32(rec + kNvfp4RopeScaleOff, r);
      store_f32(rec + kNvfp4OuterScaleOff, s);
      fp8_encode_values(rope, kRopeDim, r, rec + kNvfp4RopeOff);
    } else {
      bf16_encode_values(rope, kRopeDim, rec + kNvfp4RopeOff);
    }
  } else if (fmt == FMT_FP8_DS_MLA) {
    for (int t = 0; t < kLatentDim / kTile; ++t) {
      const float sc = fp8_tile_scale(amax(latent + t * kTile, kTile), scale_format);
      store_f32(rec + kFp8ScalesOff + 4 * t, sc);
      fp8_encode_values(latent + t * kTile, kTile, sc, rec + t * kTile);
    }
    bf16_encode_values(rope, kRopeDim, rec + kFp8RopeOff);
  } else if (fmt == FMT_INDEXER_FP8) {
    const float sc = indexer_scale(amax(latent, kIndexDim));
    fp8_encode_values(latent, kIndexDim, sc, rec);
    store_f32(rec + kIndexerScaleOff, sc);
  }
}

SI_HD void decode_record(int32_t fmt, const uint8_t* rec, float* latent, float* rope, float outer_scale) {
  if (fmt == FMT_NVFP4_368 || fmt == FMT_NVFP4_432) {
    const float s = fmt == FMT_NVFP4_368 ? load_f32(rec + kNvfp4OuterScaleOff) : outer_scale;
    for (int g = 0; g < kLatentDim / kGroup; ++g)
      nvfp4_decode_group(rec + g * kGroup / 2, rec[kNvfp4ScalesOff + g], s, latent + g * kGroup);
    if (fmt == FMT_NVFP4_368) fp8_decode_values(rec + kNvfp4RopeOff, kRopeDim, load_f32(rec + kNvfp4RopeScaleOff), rope);
    else bf16_decode_values(rec + kNvfp4RopeOff, kRopeDim, rope);
  } else if (fmt == FMT_FP8_DS_MLA) {
    for (int t = 0; t < kLatentDim / kTile; ++t)
      fp8_decode_values(rec + t * kTile, kTile, load_f32(rec + kFp8ScalesOff + 4 * t), latent + t * kTile);
    bf16_decode_values(rec + kFp8RopeOff, kRopeDim, rope);
  } else if (fmt == FMT_INDEXER_FP8) {
    fp8_decode_values(rec, kIndexDim, load_f32(rec + kIndexerScaleOff), latent);
  }
}

SI_HD int latent_dim(int32_t fmt) { return fmt == FMT_INDEXER_FP8 ? kIndexDim : kLatentDim; }
SI_HD int rope_dim(int32_t fmt) { return fmt == FMT_INDEXER_FP8 ? 0 : kRopeDim; }

}  // namespace si
