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

// A slot's block, slot / d for a block size d in [1, 2**31) and 0 <= slot < 2**31, as one 64-bit product
// and a shift (Granlund and Montgomery's theorem 4.2 with N = 31): l = ceil(log2 d) and
// m = ceil(2**(31 + l) / d) give 2**(31 + l) <= m d < 2**(31 + l) + d <= 2**(31 + l) + 2**l, so
// floor(slot m / 2**(31 + l)) = floor(slot / d); m < 2**32, so slot m < 2**63.
struct SlotDivisor {
  uint32_t m;
  int32_t shift;
};
SI_HD SlotDivisor slot_divisor(int64_t d) {
  int l = 0;
  while ((int64_t(1) << l) < d) ++l;
  return {(uint32_t)(((uint64_t(1) << (31 + l)) + (uint64_t)d - 1) / (uint64_t)d), 31 + l};
}
SI_HD uint32_t slot_block(uint32_t slot, SlotDivisor sd) { return (uint32_t)((uint64_t)slot * sd.m >> sd.shift); }

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

// Codes of a (byte 0) and b (byte 1): e4m3_encode's, on sm_89+ in one conversion (round to nearest even,
// saturating to +-448 as the clamp does; the clamp below -448 is kept, it also takes NaN to -448).
SI_HD uint32_t e4m3_encode2(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  unsigned short r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(fmaxf(b, -448.0f)), "f"(fmaxf(a, -448.0f)));
  return r;
#else
  return e4m3_encode(a) | (uint32_t)e4m3_encode(b) << 8;
#endif
}

SI_HD float e4m3_decode(uint8_t c) {
  const uint32_t mag = c & 0x7fu;
  // a normal code is fp32 with its exponent rebiased (7 -> 127) and its 3 mantissa bits on top;
  // a subnormal one is m * 2**-9 (exact)
  float a = mag >= 8u ? bits_f32((mag << 20) + (120u << 23)) : (float)mag * 0.001953125f;
  if (mag == 0x7fu) a = NAN;
  return bits_f32(f32_bits(a) | ((uint32_t)(c & 0x80u) << 24));
}

// The values of codes c2 & 0xff and c2 >> 8 (e4m3_decode), on sm_89+ in one conversion (E4M3 -> fp16x2 is
// exact: every E4M3 value is an fp16 value) and two exact fp16 -> fp32 ones.
SI_HD void e4m3_decode2(uint32_t c2, float& a, float& b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  unsigned int h;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"((unsigned short)c2));
  asm("cvt.f32.f16 %0, %1;" : "=f"(a) : "h"((unsigned short)(h & 0xffffu)));
  asm("cvt.f32.f16 %0, %1;" : "=f"(b) : "h"((unsigned short)(h >> 16)));
#else
  a = e4m3_decode((uint8_t)c2), b = e4m3_decode((uint8_t)(c2 >> 8));
#endif
}

// E2M1: magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6; ties to the even code, so the
// boundary tie goes down at 0.25, 1.25, 2.5, 5 and up at 0.75, 1.75, 3.5.
// The magnitude code of a in [0, 6] (not NaN) as the fp32 2**23 + code: the least of 2a, 2 + a and
// 4 + a / 2, each rounded to an integer by adding 2**23 (one rounding, ties to even; the products by
// 2 and 1/2 are exact). E2M1 is 0.5 apart on [0, 2) (code 2a), 1 apart on [2, 4) (2 + a), 2 apart
// on [4, 6] (4 + a / 2), and outside its own interval each term rounds to at least the code (checked
// for every fp32 in [0, 6], csrc/tools/check_nvfp4_codes.cpp). No compare chain, no branch: three FP operations and two minimums.
SI_HD float e2m1_biased(float a) {
  return fminf(fminf(fmaf(a, 2.0f, 8388608.0f), a + 8388610.0f), fmaf(a, 0.5f, 8388612.0f));
}
SI_HD uint32_t e2m1_magnitude(float a) { return f32_bits(e2m1_biased(a)) - 0x4b000000u; }

SI_HD uint8_t e2m1_encode(float y) {  // NaN -> 0, past +-6 -> +-6
  const uint32_t c = e2m1_magnitude(fminf(fmaxf(fabsf(y), 0.0f), 6.0f));
  return (uint8_t)((c != 0 && (f32_bits(y) >> 31)) ? (c | 8u) : c);  // magnitude 0 is +0
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
// RN(1 / m) for m in [2**-22, 4) (Divisor's m1) without a division: a first guess from the bits
// (within 5.1%), one cubic and two Newton steps in FMAs, and the one case their last rounding misses
// (m's mantissa all ones: the quotient sits just above a tie) moved up one ulp. Equal to the IEEE
// 1.0f / m for every fp32 m in that range (csrc/tools/check_nvfp4_codes.cpp).
SI_HD float rcp_rn(float m) {
  float y = bits_f32(0x7ef311c3u - f32_bits(m));
  float e = fmaf(-m, y, 1.0f);
  y = fmaf(y, fmaf(e, e, e), y);
  e = fmaf(-m, y, 1.0f);
  y = fmaf(y, e, y);
  e = fmaf(-m, y, 1.0f);
  y = fmaf(y, e, y);
  return (f32_bits(m) & 0x7fffffu) == 0x7fffffu ? bits_f32(f32_bits(y) + 1u) : y;
}

// Quotients x / m without a division: scaling x and m by the power of two p that takes m into [1, 2)
// (into [2, 4) past 2**127; m subnormal: below 1) changes no quotient; with r = RN(1 / m1),
// q0 = x * r and one FMA correction, q = q0 + r * (x - m1 * q0), is RN(x / m1) whenever that is at
// least 2**-100 (checked for every m1 in [1, 2) with x within 6 ulps of each E2M1 and E4M3 boundary
// times m1, and for every fp32 over the constant divisors 2688 and 448, csrc/tools/check_nvfp4_codes.cpp;
// E2M1: 2e8 random pairs too; below 2**-100 both E2M1 and E4M3 codes are 0). m <= 0, NaN or inf:
// p = 0, x * p is 0 (x finite) or NaN. quotient() also keeps x's sign on a zero quotient (the residual is taken as
// m1 q0 - x, which is +0 there, so q0 = -0 survives) and holds q0 at FLT_MAX in the residual, so a
// quotient past it is +inf, not NaN (-inf gives NaN: E4M3 encodes both as -448).
struct Divisor {
  float p, m1, r1;
};

SI_HD Divisor divisor(float m) {
  const bool ok = m > 0.0f && m <= 3.40282347e38f;
  const uint32_t e = f32_bits(m) & 0x7f800000u;
  const float p = ok ? bits_f32(0x7f000000u - (e < 0x7e800000u ? e : 0x7e800000u)) : 0.0f;  // 2**(127 - exp)
  const float m1 = ok ? m * p : 1.0f;
  return {p, m1, rcp_rn(m1)};
}

// x / m as above: the IEEE quotient wherever an E4M3 code or a scale (2688, 448) reads it.
SI_HD float quotient(float x, Divisor d) {
  const float xs = x * d.p, q0 = xs * d.r1;
  return fmaf(-d.r1, fmaf(d.m1, fminf(q0, 3.40282347e38f), -xs), q0);  // -0 stays -0: x - m1 q0 is +0
}

// quotient for an x no larger in magnitude than the amax its divisor came from (a 368 rope value over
// max(amax / 448, 2**-126), the record's rope scale): x * p * r1 is then at most about 448, never past
// FLT_MAX, so the clamp is idle and left out (the same bits: a NaN quotient stays NaN either way).
SI_HD float quotient_bounded(float x, Divisor d) {
  const float xs = x * d.p, q0 = xs * d.r1;
  return fmaf(-d.r1, fmaf(d.m1, q0, -xs), q0);
}

// 368: dynamic per-token outer scale s_t = max(amax / 2688, 2**-126); 432: a per-cache constant S.
// The group scale's code: E4M3 of amax_g / (6 s), 6 s one per token (d6s = divisor(6 s)).
// The constants divide unscaled (p = 1, their reciprocals folded at compile time): a scaled dividend would
// lose the residual's low bits where the quotient nears 2**-126.
SI_HD float nvfp4_token_scale(float token_amax) {
  return fmaxf(quotient(token_amax, Divisor{1.0f, 2688.0f, 1.0f / 2688.0f}), kTiny);
}
SI_HD uint8_t nvfp4_group_scale(float group_amax, Divisor d6s) { return e4m3_encode(quotient(group_amax, d6s)); }
// The rope's fp8 scale max(amax / 448, 2**-126) of a 368 record.
SI_HD float nvfp4_rope_scale(float rope_amax) {
  return fmaxf(quotient(rope_amax, Divisor{1.0f, 448.0f, 1.0f / 448.0f}), kTiny);
}

// Bytes of a (0..3) and b (4..7) picked by the selector's nibbles: CUDA's __byte_perm (one PRMT).
SI_HD uint32_t byte_perm(uint32_t a, uint32_t b, uint32_t sel) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(a, b, sel);
#else
  const uint64_t v = (uint64_t)b << 32 | a;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= (uint32_t)(v >> (8 * ((sel >> (4 * i)) & 7u)) & 0xffu) << (8 * i);
  return r;
#endif
}

// The top bytes (sign and exponent) of x[0], x[2], x[4], x[6] in one word: three byte permutes.
SI_HD uint32_t top_bytes4(const float* x) {
  return byte_perm(byte_perm(f32_bits(x[0]), f32_bits(x[2]), 0x73u), byte_perm(f32_bits(x[4]), f32_bits(x[6]), 0x73u),
                   0x5410u);
}

// 8 values -> their packed codes as a little-endian word (element i in bits 4i..4i+3): the E2M1 codes of
// x_i / m_g, quotient's steps with x taken as |x| * p, NaN -> 0 (a NaN's code is 0); |x| * p = inf
// gives q = NaN -> clamped to 6 (code 7, as x / m = inf).
SI_HD uint32_t e2m1_codes8(const float* x, Divisor d) {
  uint32_t mag = 0;
  for (int i = 0; i < 8; ++i) {
    const float xs = fmaxf(fabsf(x[i]) * d.p, 0.0f);
    const float q0 = xs * d.r1;
    const float q = fmaf(d.r1, fmaf(-d.m1, q0, xs), q0);
    mag += f32_bits(e2m1_biased(fminf(fabsf(q), 6.0f))) << (4 * i);  // one shift-add: bias removed below
  }
  mag -= 0x4b000000u * 0x11111111u;  // the eight biases, modulo 2**32
  // sign bits: the even elements' top bytes shifted down by 4 land on bits 3, 11, 19, 27 (their
  // nibbles' bit 3), the odd elements' already sit on bits 7, 15, 23, 31
  const uint32_t sign = (top_bytes4(x) >> 4 & 0x08080808u) | (top_bytes4(x + 1) & 0x80808080u);
  // the sign only on a nonzero code (+0): nibble + 7 carries into its bit 3 iff the nibble is 1..7
  return mag | (sign & (mag + 0x77777777u));
}

// A group's 16 codes (8 bytes, element 2i in the low nibble of byte i) for its scale's value (the E4M3
// value of its scale code), outer scale s.
SI_HD void nvfp4_encode_group(const float* x, float scale, float s, uint32_t out[2]) {
  const Divisor d = divisor(s * scale);
  out[0] = e2m1_codes8(x, d);
  out[1] = e2m1_codes8(x + 8, d);
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
    const Divisor d6s = divisor(6.0f * s);
    for (int g = 0; g < kLatentDim / kGroup; ++g) {
      const uint8_t c = nvfp4_group_scale(amax(latent + g * kGroup, kGroup), d6s);
      rec[kNvfp4ScalesOff + g] = c;
      uint32_t w[2];
      nvfp4_encode_group(latent + g * kGroup, e4m3_decode(c), s, w);
      memcpy(rec + g * kGroup / 2, w, 8);  // little-endian host
    }
    for (int i = 288; i < kNvfp4RopeOff; ++i) rec[i] = 0;
    if (fmt == FMT_NVFP4_368) {
      const float r = nvfp4_rope_scale(amax(rope, kRopeDim));
      store_f32(rec + kNvfp4RopeScaleOff, r);
      store_f32(rec + kNvfp4OuterScaleOff, s);
      const Divisor dr = divisor(r);
      for (int i = 0; i < kRopeDim; ++i) rec[kNvfp4RopeOff + i] = e4m3_encode(quotient_bounded(rope[i], dr));
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
