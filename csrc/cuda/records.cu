// CUDA record kernels: encode tokens into a paged cache at given slots, and
// decode selected records. The per-group logic is the same sparkinfer/records.h
// the host twin loops over, and amax reductions are order-free, so GPU and host
// bytes are identical.
//
// NVFP4 encode (encode_kernel, and write_paged_nvfp4_kernel, the layer forward's
// write, with the same per-token code): a token's lanes own whole 16-value groups.
// A lane loads its groups with 16-byte loads, reduces the group amax in registers
// and the token amax with shuffles, and turns each value into its E2M1 code with
// one exact quotient (a division-free reciprocal per group, two FMAs per value, records.h) and
// three roundings to integers (E2M1's three spacings), packed by shift-adds: no
// division, compare chain or branch per value, and no loop, so the kernel report's
// count of the SASS is what a warp issues. Four tokens run per warp (8 lanes each,
// four groups per lane; write_paged_nvfp4_kernel<4> at a prefill chunk: eight tokens, 4 lanes each), so
// the warp's per-token work (slot, addresses, scale shuffles, its scales' quotients: no IEEE division,
// records.h's quotient) is issued once for four (eight). The E4M3 scale and rope codes convert two at a
// time (records.h's e4m3_encode2 / e4m3_decode2: one cvt each way on sm_89+). Both need
// 16-byte aligned rows and records: si_records_encode_cuda checks, the binding
// copies misaligned rows; si_records_write_paged_cuda sends other strides, and caches of 2**31 slots or
// more, to write_paged_kernel (a warp per token). The fp8 records (656, 132) go through
// encode_fp8_kernel and write_paged_kernel, a warp per record.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "sparkinfer/records.h"

namespace {

constexpr int kWarp = 32;
constexpr int kWarpsPerBlock = 4;

__device__ __forceinline__ float warp_max(float v, int width) {
  for (int off = width / 2; off > 0; off /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off, width));
  return v;
}

// 16-byte alignment of a pointer, uniform across the warp where the warp's pointers share it: picks
// vector or byte-wise accesses (the engine's rows and records are aligned; a strided view may not be).
__host__ __device__ __forceinline__ bool aligned16(const void* p) { return ((uintptr_t)p & 15u) == 0; }

// Accumulators of the write's value check: a NaN or an infinity makes v * 0 NaN, and a NaN stays. bf16
// words are checked two values to an instruction (a bf16x2 FMA: bf16's infinities and NaNs are fp32's).
struct NonFinite {
  __nv_bfloat162 pairs = __floats2bfloat162_rn(0.0f, 0.0f);
  float values = 0.0f;
  __device__ __forceinline__ void add(uint32_t bf16_pair) {
    pairs = __hfma2(*reinterpret_cast<const __nv_bfloat162*>(&bf16_pair), __floats2bfloat162_rn(0.0f, 0.0f), pairs);
  }
  __device__ __forceinline__ void add(float v) { values = fmaf(v, 0.0f, values); }
  __device__ __forceinline__ bool any() const {
    const float2 p = __bfloat1622float2(pairs);
    return values != values || p.x != p.x || p.y != p.y;
  }
};

// 16-byte loads of N (a multiple of 8) consecutive row values at base + off, fp32 or bf16 (bf16 -> fp32
// is exact): the address is 16-byte aligned. check: every value added to it.
template <int N>
__device__ __forceinline__ void load_vec(const void* base, int64_t off, bool bf16, float* x,
                                         NonFinite* check = nullptr) {
  if (bf16) {
#pragma unroll
    for (int i = 0; i < N / 8; ++i) {
      const uint4 v = reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(base) + off)[i];
      const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        x[8 * i + 2 * q] = si::bits_f32(w[q] << 16);
        x[8 * i + 2 * q + 1] = si::bits_f32(w[q] & 0xffff0000u);
        if (check) check->add(w[q]);
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      const float4 v = reinterpret_cast<const float4*>(static_cast<const float*>(base) + off)[i];
      x[4 * i] = v.x, x[4 * i + 1] = v.y, x[4 * i + 2] = v.z, x[4 * i + 3] = v.w;
#pragma unroll
      for (int q = 0; check && q < 4; ++q) check->add(x[4 * i + q]);
    }
  }
}

// Little-endian bytes of word(s) to dst: one store of n bytes where dst is n-aligned, else n stores.
template <int N>
__device__ __forceinline__ void store_le(uint8_t* dst, const uint32_t* w, bool vec) {
  if (vec) {
    if constexpr (N == 32) {
      reinterpret_cast<uint4*>(dst)[0] = make_uint4(w[0], w[1], w[2], w[3]);
      reinterpret_cast<uint4*>(dst)[1] = make_uint4(w[4], w[5], w[6], w[7]);
    } else if constexpr (N == 16) *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
    else if constexpr (N == 8) *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
    else if constexpr (N == 4) *reinterpret_cast<uint32_t*>(dst) = w[0];
    else *reinterpret_cast<uint16_t*>(dst) = (uint16_t)w[0];
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) dst[i] = (uint8_t)(w[i / 4] >> (8 * (i % 4)));
  }
}

// 368 / 432 for the L lanes (32 or 8) of one token: lane j owns groups j + L k (k < G = 32 / L), in x,
// and rope values [R j, R j + R), R = 64 / L, in r. vec: the record is 16-byte aligned (the offsets
// below are then aligned to their store widths); store: write the record (a lane whose token is a tail
// or a skipped slot computes along, for the shuffles, and stores nothing).
template <int L>
__device__ __forceinline__ void encode_nvfp4(int32_t fmt, const float (&x)[kWarp / L][si::kGroup],
                                             const float (&r)[si::kRopeDim / L], uint8_t* rec, float outer_scale,
                                             bool vec, bool store) {
  constexpr int G = kWarp / L, R = si::kRopeDim / L;
  const int j = threadIdx.x % L;
  float gmax[G], tmax = 0.0f;
#pragma unroll
  for (int k = 0; k < G; ++k) {
    gmax[k] = si::amax(x[k], si::kGroup);
    tmax = fmaxf(tmax, gmax[k]);
  }
  const float s = fmt == si::FMT_NVFP4_368 ? si::nvfp4_token_scale(warp_max(tmax, L)) : outer_scale;
  const si::Divisor d6s = si::divisor(6.0f * s);
  uint8_t c[G];
  uint32_t codes[G][2];
#pragma unroll
  for (int k = 0; k < G; k += 2) {  // two group scales per E4M3 conversion each way (G = 1: the pair is one group)
    const int k1 = k + 1 < G ? k + 1 : k;
    const uint32_t c2 = si::e4m3_encode2(si::quotient(gmax[k], d6s), si::quotient(gmax[k1], d6s));
    float v0, v1;
    si::e4m3_decode2(c2, v0, v1);
    c[k] = (uint8_t)c2, c[k1] = (uint8_t)(c2 >> 8);
    si::nvfp4_encode_group(x[k], v0, s, codes[k]);
    if (k1 != k) si::nvfp4_encode_group(x[k1], v1, s, codes[k1]);
  }
  // [288, 304): 368's two fp32 scales and zero padding, 432's zero padding, by the token's lane 0
  uint32_t head[4] = {0, 0, 0, 0}, rw[R / 2] = {};  // rw: the lane's rope bytes (368: R, 432: 2 R)
  if (fmt == si::FMT_NVFP4_368) {
    const float ra = si::nvfp4_rope_scale(warp_max(si::amax(r, R), L));
    const si::Divisor dr = si::divisor(ra);
    head[0] = si::f32_bits(ra), head[1] = si::f32_bits(s);
#pragma unroll
    for (int i = 0; i < R; i += 2)
      rw[i / 4] |= si::e4m3_encode2(si::quotient_bounded(r[i], dr), si::quotient_bounded(r[i + 1], dr)) << 8 * (i % 4);
  } else {
#pragma unroll
    for (int i = 0; i < R; ++i) rw[i / 2] |= (uint32_t)si::bf16_encode(r[i]) << 16 * (i % 2);
  }
  if (!store) return;
#pragma unroll
  for (int k = 0; k < G; ++k) {
    store_le<8>(rec + (j + L * k) * si::kGroup / 2, codes[k], vec);
    rec[si::kNvfp4ScalesOff + j + L * k] = c[k];
  }
  if (fmt == si::FMT_NVFP4_368) store_le<R>(rec + si::kNvfp4RopeOff + R * j, rw, vec);
  else store_le<2 * R>(rec + si::kNvfp4RopeOff + 2 * R * j, rw, vec);
  if (j == 0) store_le<16>(rec + si::kNvfp4RopeScaleOff, head, vec);
}

// 656: lane l owns latent[16l, 16l+16); tile t = lanes 8t..8t+7.
__device__ void encode_fp8_ds_mla(const float* lat, const float* rope, uint8_t* rec, int32_t scale_format) {
  const int l = threadIdx.x % kWarp;
  const float tmax = warp_max(si::amax(lat + 16 * l, 16), 8);
  const float sc = si::fp8_tile_scale(tmax, scale_format);
  if (l % 8 == 0) si::store_f32(rec + si::kFp8ScalesOff + 4 * (l / 8), sc);
  si::fp8_encode_values(lat + 16 * l, 16, sc, rec + 16 * l);
  si::bf16_encode_values(rope + 2 * l, 2, rec + si::kFp8RopeOff + 4 * l);
}

// 132: lane l owns key[4l, 4l+4).
__device__ void encode_indexer(const float* key, uint8_t* rec) {
  const int l = threadIdx.x % kWarp;
  const float sc = si::indexer_scale(warp_max(si::amax(key + 4 * l, 4), kWarp));
  si::fp8_encode_values(key + 4 * l, 4, sc, rec + 4 * l);
  if (l == 0) si::store_f32(rec + si::kIndexerScaleOff, sc);
}

// One fp8 record (656 / 132) by the warp.
__device__ void encode_fp8(int32_t fmt, const float* lat, const float* rp, uint8_t* rec, int32_t scale_format) {
  if (fmt == si::FMT_FP8_DS_MLA) encode_fp8_ds_mla(lat, rp, rec, scale_format);
  else encode_indexer(lat, rec);
}

// Four NVFP4 tokens per warp (8 lanes each): token 4 w + lane / 8 of warp w. Rows and records 16-byte
// aligned (si_records_encode_cuda checks).
constexpr int kEncodeLanes = 8;
// write_paged_nvfp4_kernel's lanes per token from kWideWriteRows rows on (a prefill chunk's; a decode
// step writes tens): eight tokens per warp.
constexpr int kWideWriteLanes = 4;
constexpr int kWideWriteRows = 1024;

__global__ void encode_kernel(int32_t fmt, const float* __restrict__ latent, const float* __restrict__ rope,
                              int64_t n, const int64_t* __restrict__ slots, uint8_t* __restrict__ cache,
                              int64_t num_slots, int64_t stride, float outer_scale) {
  constexpr int kPerWarp = kWarp / kEncodeLanes;
  const int64_t first = ((int64_t)blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarp) * kPerWarp;
  if (first >= n) return;  // whole warps leave together: the shuffles stay converged
  const int64_t t = first + threadIdx.x % kWarp / kEncodeLanes;
  const int64_t i = t < n ? t : n - 1;  // a tail token repeats the last row and stores nothing
  const int64_t slot = slots ? slots[i] : i;
  // -1: skip; past the cache: skip too (the caller's device check flags it; the host twin refuses it)
  const bool store = t < n && slot >= 0 && slot < num_slots;
  constexpr int G = kWarp / kEncodeLanes, R = si::kRopeDim / kEncodeLanes;
  const int j = threadIdx.x % kEncodeLanes;
  float x[G][si::kGroup], r[R];
#pragma unroll
  for (int k = 0; k < G; ++k)
    load_vec<si::kGroup>(latent, i * si::kLatentDim + (j + kEncodeLanes * k) * si::kGroup, false, x[k]);
  load_vec<R>(rope, i * si::kRopeDim + R * j, false, r);
  encode_nvfp4<kEncodeLanes>(fmt, x, r, cache + (store ? slot : 0) * stride, outer_scale, true, store);
}

__global__ void encode_fp8_kernel(int32_t fmt, const float* __restrict__ latent, const float* __restrict__ rope,
                                  int64_t n, const int64_t* __restrict__ slots, uint8_t* __restrict__ cache,
                                  int64_t num_slots, int64_t stride, int32_t scale_format) {
  const int64_t i = (int64_t)blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarp;
  if (i >= n) return;
  const int64_t slot = slots ? slots[i] : i;
  if (slot < 0 || slot >= num_slots) return;  // as encode_kernel; the whole warp leaves together
  encode_fp8(fmt, latent + i * si::latent_dim(fmt), rope ? rope + i * si::kRopeDim : nullptr, cache + slot * stride,
             scale_format);
}

// The host twin's si_records_write_paged, one warp per token, for any strides and alignment (and the
// fp8 records): the warp stages its row in fp32 in shared memory (checking every value), then encodes
// it straight into the paged slot.
__global__ void write_paged_kernel(int32_t fmt, const void* __restrict__ latent, int64_t lat_stride, int32_t lat_bf16,
                                   const void* __restrict__ rope, int64_t rope_stride, int32_t rope_bf16, int64_t n,
                                   const int64_t* __restrict__ slots, uint8_t* __restrict__ cache, int64_t num_blocks,
                                   int64_t block_size, int64_t s0, int64_t s1, int64_t null_block, float outer_scale,
                                   int32_t scale_format, int32_t* value_flag, int32_t* slot_flag) {
  __shared__ __align__(16) float staged[kWarpsPerBlock][si::kLatentDim + si::kRopeDim];
  const int w = threadIdx.x / kWarp, l = threadIdx.x % kWarp;
  const int64_t i = (int64_t)blockIdx.x * kWarpsPerBlock + w;
  if (i >= n) return;  // per warp: the shuffles and votes below stay converged
  const int ld = si::latent_dim(fmt), rd = si::rope_dim(fmt);
  float* lat = staged[w];
  float* rp = staged[w] + si::kLatentDim;
  bool finite = true;
  for (int j = l; j < ld; j += kWarp) finite &= si::finite_f32(lat[j] = si::load_input(latent, i * lat_stride + j, lat_bf16));
  for (int j = l; j < rd; j += kWarp) finite &= si::finite_f32(rp[j] = si::load_input(rope, i * rope_stride + j, rope_bf16));
  __syncwarp();
  if (!__all_sync(0xffffffffu, finite) && l == 0) atomicOr(value_flag, 1);
  const int64_t slot = slots[i];
  if (si::bad_slot(slot, num_blocks, block_size, null_block)) {
    if (l == 0) atomicOr(slot_flag, 1);
    return;
  }
  if (slot < 0) return;
  uint8_t* rec = cache + (slot / block_size) * s0 + (slot % block_size) * s1;
  if (fmt == si::FMT_NVFP4_368 || fmt == si::FMT_NVFP4_432) {
    float x[1][si::kGroup];
    const float r[2] = {rp[2 * l], rp[2 * l + 1]};
    load_vec<si::kGroup>(lat, l * si::kGroup, false, x[0]);  // the staged row is 16-byte aligned
    encode_nvfp4<kWarp>(fmt, x, r, rec, outer_scale, aligned16(rec), true);
  } else
    encode_fp8(fmt, lat, rd ? rp : nullptr, rec, scale_format);
}

// write_paged_kernel's NVFP4 form over 16-byte aligned rows, row strides, cache and cache strides
// (si_records_write_paged_cuda picks it; vLLM's rows and caches are): 32 / L tokens per warp, L lanes
// each, the model's fp32 or bf16 rows read with 16-byte loads and checked in registers (NonFinite), one
// flag store per warp. L = 8 (four tokens per warp, as encode_kernel) for a decode step's few rows, where
// a warp's latency counts; L = 4 (kWideWriteLanes) for a prefill chunk, where the warps' issue does:
// eight tokens per warp issue the per-token work (slot, flags, the scales' quotients, shuffles) once for
// eight, 7% fewer instructions per token (kernel report, sm_90: 367 against 396).
template <int L>
__global__ void write_paged_nvfp4_kernel(int32_t fmt, const void* __restrict__ latent, int64_t lat_stride,
                                         int32_t lat_bf16, const void* __restrict__ rope, int64_t rope_stride,
                                         int32_t rope_bf16, int64_t n, const int64_t* __restrict__ slots,
                                         uint8_t* __restrict__ cache, int64_t num_blocks, int64_t block_size,
                                         int64_t s0, int64_t s1, int64_t null_block, si::SlotDivisor blocks_of,
                                         float outer_scale, int32_t* value_flag, int32_t* slot_flag) {
  constexpr int G = kWarp / L, R = si::kRopeDim / L;
  const int64_t first = ((int64_t)blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarp) * (kWarp / L);
  if (first >= n) return;  // whole warps leave together: the shuffles and votes stay converged
  const int64_t t = first + threadIdx.x % kWarp / L;
  const int64_t i = t < n ? t : n - 1;  // a tail token repeats the last row and stores nothing
  const int j = threadIdx.x % L;
  float x[G][si::kGroup], r[R];
  NonFinite nonfinite;
#pragma unroll
  for (int k = 0; k < G; ++k)
    load_vec<si::kGroup>(latent, i * lat_stride + (j + L * k) * si::kGroup, lat_bf16, x[k], &nonfinite);
  load_vec<R>(rope, i * rope_stride + R * j, rope_bf16, r, &nonfinite);
  // si::bad_slot without a division: a cache of under 2**31 slots (si_records_write_paged_cuda routes others
  // to write_paged_kernel) puts an in-range slot's block in a product and a shift (blocks_of, records.h)
  const int64_t slot = slots[i];
  const bool in_range = slot >= 0 && slot < num_blocks * block_size;
  const uint32_t blk = in_range ? si::slot_block((uint32_t)slot, blocks_of) : 0u;
  const bool bad = t < n && (slot < -1 || slot >= num_blocks * block_size || (in_range && blk == null_block));
  const bool flag_values = __any_sync(0xffffffffu, nonfinite.any()), flag_slots = __any_sync(0xffffffffu, bad);
  if (threadIdx.x % kWarp == 0) {
    if (flag_values) atomicOr(value_flag, 1);
    if (flag_slots) atomicOr(slot_flag, 1);
  }
  const bool store = t < n && !bad && slot >= 0;
  encode_nvfp4<L>(fmt, x, r, store ? cache + blk * s0 + ((uint32_t)slot - blk * (uint32_t)block_size) * s1 : cache,
                  outer_scale, true, store);
}

__global__ void decode_kernel(int32_t fmt, const uint8_t* __restrict__ cache, int64_t num_slots, int64_t stride,
                              const int64_t* __restrict__ idx, int64_t n, float* __restrict__ latent,
                              float* __restrict__ rope, float outer_scale) {
  const int64_t i = (int64_t)blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarp;
  if (i >= n) return;
  const int l = threadIdx.x % kWarp;
  const int ld = si::latent_dim(fmt), rd = si::rope_dim(fmt);
  const int64_t slot = idx ? idx[i] : i;
  float* lat = latent + i * ld;
  float* rp = rope ? rope + i * rd : nullptr;
  if (slot < 0 || slot >= num_slots) {  // past the cache: zeros, as -1 (never a read outside it)
    for (int j = l; j < ld; j += kWarp) lat[j] = 0.0f;
    for (int j = l; rp && j < rd; j += kWarp) rp[j] = 0.0f;
    return;
  }
  const uint8_t* rec = cache + slot * stride;
  if (fmt == si::FMT_NVFP4_368 || fmt == si::FMT_NVFP4_432) {
    const float s = fmt == si::FMT_NVFP4_368 ? si::load_f32(rec + si::kNvfp4OuterScaleOff) : outer_scale;
    si::nvfp4_decode_group(rec + l * si::kGroup / 2, rec[si::kNvfp4ScalesOff + l], s, lat + l * si::kGroup);
    if (fmt == si::FMT_NVFP4_368)
      si::fp8_decode_values(rec + si::kNvfp4RopeOff + 2 * l, 2, si::load_f32(rec + si::kNvfp4RopeScaleOff), rp + 2 * l);
    else
      si::bf16_decode_values(rec + si::kNvfp4RopeOff + 4 * l, 2, rp + 2 * l);
  } else if (fmt == si::FMT_FP8_DS_MLA) {
    si::fp8_decode_values(rec + 16 * l, 16, si::load_f32(rec + si::kFp8ScalesOff + 4 * (l / 8)), lat + 16 * l);
    si::bf16_decode_values(rec + si::kFp8RopeOff + 4 * l, 2, rp + 2 * l);
  } else {
    si::fp8_decode_values(rec + 4 * l, 4, si::load_f32(rec + si::kIndexerScaleOff), lat + 4 * l);
  }
}

int32_t launch_status() { return cudaGetLastError() == cudaSuccess ? SI_OK : SI_ERR_CUDA; }

}  // namespace

// Same arguments as the host twin (records_host.cpp), all pointers on the device, plus the stream.
// Slot ranges are checked by the Python binding; NVFP4 needs latent, rope and cache 16-byte aligned
// and a stride of whole 16 bytes (SI_ERR_ARG otherwise: the binding aligns the rows).
extern "C" int32_t si_records_encode_cuda(int32_t fmt, const float* latent, const float* rope, int64_t n,
                                          const int64_t* slots, uint8_t* cache, int64_t num_slots,
                                          int64_t stride, float outer_scale, int32_t scale_format,
                                          cudaStream_t stream) {
  if (si::record_bytes(fmt) == 0 || n < 0 || stride < si::record_bytes(fmt)) return SI_ERR_ARG;
  if (n == 0) return SI_OK;
  if (fmt == si::FMT_NVFP4_368 || fmt == si::FMT_NVFP4_432) {
    if (!aligned16(latent) || !aligned16(rope) || !aligned16(cache) || stride % 16) return SI_ERR_ARG;
    const int64_t per_block = kWarpsPerBlock * (kWarp / kEncodeLanes);
    encode_kernel<<<(unsigned)((n + per_block - 1) / per_block), kWarp * kWarpsPerBlock, 0, stream>>>(
        fmt, latent, rope, n, slots, cache, num_slots, stride, outer_scale);
  } else {
    encode_fp8_kernel<<<(unsigned)((n + kWarpsPerBlock - 1) / kWarpsPerBlock), kWarp * kWarpsPerBlock, 0, stream>>>(
        fmt, latent, rope, n, slots, cache, num_slots, stride, scale_format);
  }
  return launch_status();
}

extern "C" int32_t si_records_write_paged_cuda(int32_t fmt, const void* latent, int64_t lat_stride, int32_t lat_bf16,
                                               const void* rope, int64_t rope_stride, int32_t rope_bf16, int64_t n,
                                               const int64_t* slots, uint8_t* cache, int64_t num_blocks,
                                               int64_t block_size, int64_t s0, int64_t s1, int64_t null_block,
                                               float outer_scale, int32_t scale_format, int32_t* value_flag,
                                               int32_t* slot_flag, cudaStream_t stream) {
  if (si::record_bytes(fmt) == 0 || n < 0 || block_size < 1) return SI_ERR_ARG;
  if (n == 0) return SI_OK;
  const bool aligned = aligned16(latent) && aligned16(rope) && aligned16(cache) &&
                       lat_stride * (lat_bf16 ? 2 : 4) % 16 == 0 && rope_stride * (rope_bf16 ? 2 : 4) % 16 == 0 &&
                       s0 % 16 == 0 && s1 % 16 == 0 && num_blocks * block_size <= INT32_MAX &&
                       block_size <= INT32_MAX;  // si::slot_divisor's range (an empty cache of huge blocks)
  if ((fmt == si::FMT_NVFP4_368 || fmt == si::FMT_NVFP4_432) && aligned) {
    const bool wide = n >= kWideWriteRows;
    const int64_t per_block = kWarpsPerBlock * (kWarp / (wide ? kWideWriteLanes : kEncodeLanes));
    (wide ? write_paged_nvfp4_kernel<kWideWriteLanes> : write_paged_nvfp4_kernel<kEncodeLanes>)<<<
        (unsigned)((n + per_block - 1) / per_block), kWarp * kWarpsPerBlock, 0, stream>>>(
        fmt, latent, lat_stride, lat_bf16, rope, rope_stride, rope_bf16, n, slots, cache, num_blocks, block_size, s0,
        s1, null_block, si::slot_divisor(block_size), outer_scale, value_flag, slot_flag);
    return launch_status();
  }
  const int64_t blocks = (n + kWarpsPerBlock - 1) / kWarpsPerBlock;
  write_paged_kernel<<<(unsigned)blocks, kWarp * kWarpsPerBlock, 0, stream>>>(
      fmt, latent, lat_stride, lat_bf16, rope, rope_stride, rope_bf16, n, slots, cache, num_blocks, block_size, s0, s1,
      null_block, outer_scale, scale_format, value_flag, slot_flag);
  return launch_status();
}

extern "C" int32_t si_records_decode_cuda(int32_t fmt, const uint8_t* cache, int64_t num_slots, int64_t stride,
                                          const int64_t* idx,
                                          int64_t n, float* latent, float* rope, float outer_scale,
                                          cudaStream_t stream) {
  if (si::record_bytes(fmt) == 0 || n < 0 || stride < si::record_bytes(fmt)) return SI_ERR_ARG;
  if (n == 0) return SI_OK;
  const int64_t blocks = (n + kWarpsPerBlock - 1) / kWarpsPerBlock;
  decode_kernel<<<(unsigned)blocks, kWarp * kWarpsPerBlock, 0, stream>>>(fmt, cache, num_slots, stride, idx, n,
                                                                        latent, rope, outer_scale);
  return launch_status();
}
