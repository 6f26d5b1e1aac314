// SM kernels of the selected-record exchange: pack (cache -> one contiguous
// region per destination), unpack (region -> dense workspace) and direct (own
// records cache -> workspace). Per-record logic and layouts live in
// sparkinfer/pack.h, shared with the host twins in csrc/host/pack_host.cpp.
//
// The record count is read from device memory (`count`, e.g. an entry of the
// count plane) and the grid is sized by the capacity `cap`, so one launch
// configuration serves every step and the kernels can sit in a CUDA graph.
// A count above `cap` or an out-of-range index sets *err (SI_ERR_RANGE) and
// skips the record: never a wild read or write, never a silent truncation.
#include <cuda_runtime.h>

#include "sparkinfer/pack.h"

namespace {

constexpr int kLanes = 32;     // threads per record (one warp)
constexpr int kRecords = 4;    // records per block

__device__ int64_t clamp_count(const int32_t* count, int64_t cap, int32_t* err) {
  bool bad;
  const int64_t n = si_pack_count(count, cap, &bad);
  if (bad && threadIdx.x == 0 && threadIdx.y == 0 && blockIdx.x == 0 && blockIdx.y == 0) atomicExch(err, SI_ERR_RANGE);
  return n;
}

__global__ void pack_kernel(si_pack_cache c, const int32_t* layers, const int32_t* req, const int32_t* local,
                            const int32_t* count, int64_t cap, int64_t width, uint8_t* packed, int32_t* err) {
  const int64_t n = clamp_count(count, cap, err);
  const int64_t i = (int64_t)blockIdx.x * kRecords + threadIdx.y;
  const int32_t j = blockIdx.y;
  if (i >= n) return;
  const uint8_t* src = si_pack_cache_src(c, layers, j, req[i], local[i], width);
  if (!src) { if (threadIdx.x == 0) atomicExch(err, SI_ERR_RANGE); return; }
  si_pack_copy_part(packed + (j * n + i) * width, src, width, threadIdx.x, kLanes);
}

__global__ void unpack_kernel(const uint8_t* packed, const int32_t* count, int64_t cap, int64_t width,
                              const int32_t* slot, si_pack_ws w, int32_t* err) {
  const int64_t n = clamp_count(count, cap, err);
  const int64_t i = (int64_t)blockIdx.x * kRecords + threadIdx.y;
  const int32_t j = blockIdx.y;
  if (i >= n) return;
  uint8_t* dst = si_pack_ws_dst(w, j, slot[i], width);
  if (!dst) { if (threadIdx.x == 0) atomicExch(err, SI_ERR_RANGE); return; }
  si_pack_copy_part(dst, packed + (j * n + i) * width, width, threadIdx.x, kLanes);
}

__global__ void direct_kernel(si_pack_cache c, const int32_t* layers, const int32_t* req, const int32_t* local,
                              const int32_t* slot, const int32_t* count, int64_t cap, int64_t width,
                              si_pack_ws w, int32_t* err) {
  const int64_t n = clamp_count(count, cap, err);
  const int64_t i = (int64_t)blockIdx.x * kRecords + threadIdx.y;
  const int32_t j = blockIdx.y;
  if (i >= n) return;
  const uint8_t* src = si_pack_cache_src(c, layers, j, req[i], local[i], width);
  uint8_t* dst = si_pack_ws_dst(w, j, slot[i], width);
  if (!src || !dst) { if (threadIdx.x == 0) atomicExch(err, SI_ERR_RANGE); return; }
  si_pack_copy_part(dst, src, width, threadIdx.x, kLanes);
}

dim3 grid_for(int64_t cap, int32_t n_layers) {
  return dim3((unsigned)((cap + kRecords - 1) / kRecords), (unsigned)n_layers);
}

int32_t launched() { return cudaGetLastError() == cudaSuccess ? SI_OK : SI_ERR_CUDA; }

}  // namespace

extern "C" {

int32_t si_pack_pack_cuda(const uint64_t* layer_base, int64_t n_blocks, int64_t block_stride,
                          int32_t cache_layers, const int32_t* bt, int64_t bt_stride, int32_t bt_rows,
                          int32_t bt_cols, int32_t block_size, const int32_t* layers, int32_t n_layers,
                          const int32_t* req, const int32_t* local, const int32_t* count, int64_t cap,
                          int64_t width, uint8_t* packed, int32_t* err, void* stream) {
  if (cap < 0 || width <= 0 || n_layers < 0 || block_size <= 0) return SI_ERR_ARG;
  if (cap == 0 || n_layers == 0) return SI_OK;
  const si_pack_cache c{layer_base, n_blocks, block_stride, cache_layers, bt, bt_stride, bt_rows, bt_cols,
                        block_size};
  pack_kernel<<<grid_for(cap, n_layers), dim3(kLanes, kRecords), 0, (cudaStream_t)stream>>>(
      c, layers, req, local, count, cap, width, packed, err);
  return launched();
}

int32_t si_pack_unpack_cuda(const uint8_t* packed, int32_t n_layers, const int32_t* count, int64_t cap,
                            int64_t width, const int32_t* slot, uint8_t* ws, int64_t ws_layer_stride,
                            int64_t ws_rows, int32_t* err, void* stream) {
  if (cap < 0 || width <= 0 || n_layers < 0) return SI_ERR_ARG;
  if (cap == 0 || n_layers == 0) return SI_OK;
  const si_pack_ws w{ws, ws_layer_stride, ws_rows};
  unpack_kernel<<<grid_for(cap, n_layers), dim3(kLanes, kRecords), 0, (cudaStream_t)stream>>>(
      packed, count, cap, width, slot, w, err);
  return launched();
}

int32_t si_pack_direct_cuda(const uint64_t* layer_base, int64_t n_blocks, int64_t block_stride,
                            int32_t cache_layers, const int32_t* bt, int64_t bt_stride, int32_t bt_rows,
                            int32_t bt_cols, int32_t block_size, const int32_t* layers, int32_t n_layers,
                            const int32_t* req, const int32_t* local, const int32_t* slot, const int32_t* count,
                            int64_t cap, int64_t width, uint8_t* ws, int64_t ws_layer_stride, int64_t ws_rows,
                            int32_t* err, void* stream) {
  if (cap < 0 || width <= 0 || n_layers < 0 || block_size <= 0) return SI_ERR_ARG;
  if (cap == 0 || n_layers == 0) return SI_OK;
  const si_pack_cache c{layer_base, n_blocks, block_stride, cache_layers, bt, bt_stride, bt_rows, bt_cols,
                        block_size};
  const si_pack_ws w{ws, ws_layer_stride, ws_rows};
  direct_kernel<<<grid_for(cap, n_layers), dim3(kLanes, kRecords), 0, (cudaStream_t)stream>>>(
      c, layers, req, local, slot, count, cap, width, w, err);
  return launched();
}

}  // extern "C"
