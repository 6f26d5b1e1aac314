// CUDA kernel of the per-request MTP union: one block per request, the phases
// of sparkinfer/union.h strided over the block's threads with a barrier
// between them. The table lives in a global scratch (workspace) because a
// 4 x 2048 request needs 16K slots, more than a block's shared memory.
#include <cub/block/block_scan.cuh>
#include <cuda_runtime.h>

#include "sparkinfer/union.h"

using namespace si::uni;

namespace {

constexpr int kThreads = 512;

__global__ void __launch_bounds__(kThreads)
union_kernel(const int32_t* __restrict__ topk, int32_t n, int32_t* __restrict__ uni,
             int32_t* __restrict__ remap, int32_t* __restrict__ counts, int32_t* ws) {
  using Scan = cub::BlockScan<int32_t, kThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  const int32_t q = blockIdx.x;
  const int32_t tid = threadIdx.x;
  const int32_t* row = topk + (int64_t)q * n;
  int32_t* u = uni + (int64_t)q * n;
  int32_t* m = remap + (int64_t)q * n;
  const Workspace w = workspace_view(ws + (int64_t)q * workspace_ints(n), n);
  const int32_t cap = table_capacity(n);

  for (int32_t i = tid; i < cap; i += kThreads) init_slot(w, i);
  __syncthreads();
  for (int32_t p = tid; p < n; p += kThreads) insert(w, row, p);
  __syncthreads();
  for (int32_t p = tid; p < n; p += kThreads) mark_first(w, p);
  __syncthreads();
  // Scan: each thread owns one contiguous chunk, so ordinals follow position order.
  const int32_t chunk = (n + kThreads - 1) / kThreads;
  const int32_t lo = min(n, tid * chunk);
  const int32_t hi = min(n, lo + chunk);
  int32_t offset, total;
  Scan(scan_tmp).ExclusiveSum(count_range(w, lo, hi), offset, total);
  scan_range(w, lo, hi, offset);
  __syncthreads();
  for (int32_t p = tid; p < n; p += kThreads) emit(w, row, u, p);
  __syncthreads();
  for (int32_t p = tid; p < n; p += kThreads) remap_and_pad(w, u, m, total, p);
  if (tid == 0) counts[q] = total;
}

}  // namespace

extern "C" {

// Device pointers; same layout and workspace as si_union_host_run. Asynchronous on `stream`.
int32_t si_union_cuda_run(const int32_t* topk, int32_t b, int32_t r, int32_t k, int32_t* uni,
                          int32_t* remap, int32_t* counts, int32_t* ws, int64_t ws_ints,
                          void* stream) {
  const int32_t st = check_args(topk, b, r, k, uni, remap, counts, ws, ws_ints);
  if (st != SI_OK || b == 0) return st;
  union_kernel<<<b, kThreads, 0, (cudaStream_t)stream>>>(topk, r * k, uni, remap, counts, ws);
  return cudaGetLastError() == cudaSuccess ? SI_OK : SI_ERR_CUDA;
}

}  // extern "C"
