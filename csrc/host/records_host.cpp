// Host twin of the record kernels: the same per-record functions
// (sparkinfer/records.h) run in a loop. Exported with a C ABI for ctypes
// (bindings in sparkinfer/formats/native.py).
#include "sparkinfer/records.h"

namespace {

int32_t check(int32_t fmt, int64_t n, const int64_t* idx, int64_t num_slots, int64_t stride) {
  if (si::record_bytes(fmt) == 0 || n < 0 || stride < si::record_bytes(fmt)) return SI_ERR_ARG;
  if (idx != nullptr)
    for (int64_t i = 0; i < n; ++i)
      if (idx[i] < -1 || idx[i] >= num_slots) return SI_ERR_RANGE;
  if (idx == nullptr && n > num_slots) return SI_ERR_RANGE;
  return SI_OK;
}

}  // namespace

// Encode n tokens into cache records at slots[i] (slots == NULL: slot i;
// slot -1: skip). latent [n, 512] (indexer: [n, 128]), rope [n, 64] fp32.
// cache: num_slots records, each `stride` bytes apart.
extern "C" int32_t si_records_encode(int32_t fmt, const float* latent, const float* rope, int64_t n,
                                     const int64_t* slots, uint8_t* cache, int64_t num_slots,
                                     int64_t stride, float outer_scale, int32_t scale_format) {
  const int32_t st = check(fmt, n, slots, num_slots, stride);
  if (st != SI_OK) return st;
  const int ld = si::latent_dim(fmt), rd = si::rope_dim(fmt);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t slot = slots ? slots[i] : i;
    if (slot < 0) continue;
    si::encode_record(fmt, latent + i * ld, rope ? rope + i * rd : nullptr, cache + slot * stride,
                      outer_scale, scale_format);
  }
  return SI_OK;
}

// The layer forward's cache write, one call: encode n tokens into a paged cache [num_blocks,
// block_size, record] whose blocks are s0 bytes apart and slots s1 (vLLM's block-outermost DCP layer
// views interleave the layers' pages), reading latent [n, D] / rope [n, 64] rows lat_stride /
// rope_stride elements apart, fp32 or bf16 (lat_bf16 / rope_bf16). Slot -1 skips; a bad slot
// (si::bad_slot) is skipped and sets *slot_flag; a row holding a NaN or an infinity sets *value_flag
// and is encoded as any row (the flags are the forward's device checks, read a step later).
extern "C" int32_t si_records_write_paged(int32_t fmt, const void* latent, int64_t lat_stride, int32_t lat_bf16,
                                          const void* rope, int64_t rope_stride, int32_t rope_bf16, int64_t n,
                                          const int64_t* slots, uint8_t* cache, int64_t num_blocks,
                                          int64_t block_size, int64_t s0, int64_t s1, int64_t null_block,
                                          float outer_scale, int32_t scale_format, int32_t* value_flag,
                                          int32_t* slot_flag) {
  if (si::record_bytes(fmt) == 0 || n < 0 || block_size < 1) return SI_ERR_ARG;
  const int ld = si::latent_dim(fmt), rd = si::rope_dim(fmt);
  float lat[si::kLatentDim], rp[si::kRopeDim];
  for (int64_t i = 0; i < n; ++i) {
    bool finite = true;
    for (int j = 0; j < ld; ++j) finite &= si::finite_f32(lat[j] = si::load_input(latent, i * lat_stride + j, lat_bf16));
    for (int j = 0; j < rd; ++j) finite &= si::finite_f32(rp[j] = si::load_input(rope, i * rope_stride + j, rope_bf16));
    if (!finite) *value_flag = 1;
    const int64_t slot = slots[i];
    if (si::bad_slot(slot, num_blocks, block_size, null_block)) {
      *slot_flag = 1;
      continue;
    }
    if (slot < 0) continue;
    si::encode_record(fmt, lat, rd ? rp : nullptr, cache + (slot / block_size) * s0 + (slot % block_size) * s1,
                      outer_scale, scale_format);
  }
  return SI_OK;
}

// Decode the records at idx[i] (idx == NULL: record i; -1: zeros) into
// latent [n, 512] (indexer: [n, 128]) and rope [n, 64] fp32.
extern "C" int32_t si_records_decode(int32_t fmt, const uint8_t* cache, int64_t num_slots, int64_t stride,
                                     const int64_t* idx, int64_t n, float* latent, float* rope,
                                     float outer_scale) {
  const int32_t st = check(fmt, n, idx, num_slots, stride);
  if (st != SI_OK) return st;
  const int ld = si::latent_dim(fmt), rd = si::rope_dim(fmt);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t slot = idx ? idx[i] : i;
    float* lat = latent + i * ld;
    float* rp = rope ? rope + i * rd : nullptr;
    if (slot < 0) {
      for (int j = 0; j < ld; ++j) lat[j] = 0.0f;
      for (int j = 0; rp && j < rd; ++j) rp[j] = 0.0f;
      continue;
    }
    si::decode_record(fmt, cache + slot * stride, lat, rp, outer_scale);
  }
  return SI_OK;
}

extern "C" int32_t si_records_layout(int32_t what) {
  // Field offsets for tests/test_layouts.py to compare with sparkinfer/core/layouts.py.
  switch (what) {
    case 0: return si::kNvfp4ScalesOff;
    case 1: return si::kNvfp4RopeScaleOff;
    case 2: return si::kNvfp4OuterScaleOff;
    case 3: return si::kNvfp4RopeOff;
    case 4: return si::kFp8ScalesOff;
    case 5: return si::kFp8RopeOff;
    case 6: return si::kIndexerScaleOff;
    default: return -1;
  }
}

// si::slot_block over slots in [0, 2**31) for a block size in [1, 2**31) (the CUDA paged write's block of a
// slot, a product and a shift), so a test can hold it against integer division.
extern "C" int32_t si_records_slot_blocks(const int64_t* slots, int64_t n, int64_t block_size, int32_t* out) {
  if (block_size < 1 || block_size > INT32_MAX) return SI_ERR_ARG;
  const si::SlotDivisor sd = si::slot_divisor(block_size);
  for (int64_t i = 0; i < n; ++i) {
    if (slots[i] < 0 || slots[i] > INT32_MAX) return SI_ERR_ARG;
    out[i] = (int32_t)si::slot_block((uint32_t)slots[i], sd);
  }
  return SI_OK;
}

// Element codecs over arrays, so tests can hold each one against the torch
// codecs and an independent nearest-value search. what: 0 E4M3, 1 E2M1,
// 2 bf16 (low byte, high byte), 3 pow2_ceil (fp32 bytes).
extern "C" int32_t si_records_codec(int32_t what, const float* x, int64_t n, uint8_t* out) {
  for (int64_t i = 0; i < n; ++i) {
    switch (what) {
      case 0: out[i] = si::e4m3_encode(x[i]); break;
      case 1: out[i] = si::e2m1_encode(x[i]); break;
      case 2: si::bf16_encode_values(x + i, 1, out + 2 * i); break;
      case 3: si::store_f32(out + 4 * i, si::pow2_ceil(x[i])); break;
      default: return SI_ERR_ARG;
    }
  }
  return SI_OK;
}
