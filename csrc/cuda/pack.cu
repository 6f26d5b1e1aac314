// SM kernels of the selected-record exchange: pack (cache -> one contiguous
// region per destination), unpack (region -> dense workspace) and direct (own
// records cache -> workspace). Per-record logic, layouts and the arrival signal
// are described in sparkinfer/pack.h, shared with the host twins in
// csrc/host/pack_host.cpp; the error word's layout is in sparkinfer/common.h.
//
// The record count is read from device memory (`count`, e.g. an entry of the
// count plane) and the grid is fixed: si_pack_grid CTAs (a few per SM, capped by
// the capacity `cap`) stride over the count's records, so one launch
// configuration serves every step, the kernels can sit in a CUDA graph, and an
// almost empty step does not pay for 10^5 idle CTAs. A count above `cap` or an
// out-of-range index sets the error word and skips the record: never a wild
// read or write, never a silent truncation.
#include <cuda_runtime.h>

#include <atomic>

#include "sparkinfer/pack.h"

namespace {

constexpr int kMaxDevices = 64;
std::atomic<int> g_sms[kMaxDevices];  // SM count per device, queried once

int sm_count() {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 1;
  if (dev >= 0 && dev < kMaxDevices) {
    const int known = g_sms[dev].load(std::memory_order_relaxed);
    if (known > 0) return known;
  }
  int n = 1;
  if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n < 1) n = 1;
  if (dev >= 0 && dev < kMaxDevices) g_sms[dev].store(n, std::memory_order_relaxed);
  return n;
}

__global__ void __launch_bounds__(SI_PACK_LANES * SI_PACK_WARPS)
move_kernel(si_pack_move m, const int32_t* count, int64_t cap, int32_t* err, int64_t* flag, const int64_t* seq,
            unsigned* done) {
  __shared__ int64_t n_shared;
  __shared__ int run_shared;
  const bool lead = threadIdx.x == 0 && threadIdx.y == 0;
  if (lead) {
    run_shared = si_error_clear_device(err);  // a set word: an earlier wait or move failed, skip
    bool bad;
    n_shared = si_pack_count(count, cap, &bad);
    if (run_shared && bad && blockIdx.x == 0) si_error_set_device(err, si_error_word(SI_ERR_RANGE, SI_CHECK_COUNT, m.op, -1));
  }
  __syncthreads();
  if (run_shared) {
    const int64_t n = n_shared, items = n * m.n_layers, stride = (int64_t)gridDim.x * SI_PACK_WARPS;
    for (int64_t t = (int64_t)blockIdx.x * SI_PACK_WARPS + threadIdx.y; t < items; t += stride) {
      const int32_t j = (int32_t)(t / n);
      const int32_t check = si_pack_move_one(m, j, t - j * n, n, threadIdx.x, SI_PACK_LANES);
      if (check && threadIdx.x == 0) si_error_set_device(err, si_error_word(SI_ERR_RANGE, check, m.op, -1));
    }
  }
  if (flag == nullptr) return;
  __threadfence_system();  // this thread's stores (to a peer, over P2P) before its CTA counts itself
  __syncthreads();
  if (lead && atomicAdd(done, 1u) == gridDim.x - 1) {
    __threadfence_system();  // every CTA's stores, as observed through the counter, before the flag
    *done = 0;               // the next launch (a graph replay) counts from zero again
    if (si_error_clear_device(err)) si_flag_store_release(flag, *seq);
  }
}

int32_t launch(const si_pack_move& m, const int32_t* count, int64_t cap, int32_t* err, int64_t* flag,
               const int64_t* seq, unsigned* done, void* stream) {
  if (cap == 0 || m.n_layers == 0) {
    if (flag == nullptr) return SI_OK;
    cap = 1;  // nothing to move, but the arrival still has to be signalled (by one empty CTA)
  }
  const int64_t grid = si_pack_grid(cap, m.n_layers > 0 ? m.n_layers : 1, SI_PACK_WARPS, sm_count(),
                                    SI_PACK_CTAS_PER_SM);
  move_kernel<<<(unsigned)grid, dim3(SI_PACK_LANES, SI_PACK_WARPS), 0, (cudaStream_t)stream>>>(
      m, count, cap, err, flag, seq, done);
  return cudaGetLastError() == cudaSuccess ? SI_OK : SI_ERR_CUDA;
}

}  // namespace

extern "C" {

// CTAs one move launch of `cap` records x `n_layers` layers uses on the current device.
int64_t si_pack_grid_cuda(int64_t cap, int32_t n_layers) {
  return si_pack_grid(cap, n_layers, SI_PACK_WARPS, sm_count(), SI_PACK_CTAS_PER_SM);
}

// `flag`, `seq`, `done` null: no arrival signal. Otherwise (a pack straight into a peer's region)
// *flag = *seq, release-stored after every record landed; `done` is a zeroed device uint32 per flag.
int32_t si_pack_pack_cuda(SI_PACK_CACHE_PARAMS, const int32_t* layers, int32_t n_layers, const int32_t* req,
                          const int32_t* local, const int32_t* count, int64_t cap, int64_t width, uint8_t* packed,
                          int32_t* err, int64_t* flag, const int64_t* seq, unsigned* done, void* stream) {
  const si_pack_move m = si_pack_move_pack(SI_PACK_CACHE_ARGS, layers, n_layers, req, local, width, packed);
  if (si_pack_check_args(m, cap, count) || !err || (flag && (!seq || !done))) return SI_ERR_ARG;
  return launch(m, count, cap, err, flag, seq, done, stream);
}

int32_t si_pack_unpack_cuda(const uint8_t* packed, int32_t n_layers, const int32_t* count, int64_t cap,
                            int64_t width, const int32_t* slot, uint8_t* ws, int64_t ws_layer_stride,
                            int64_t ws_rows, int32_t* err, void* stream) {
  const si_pack_move m = si_pack_move_unpack(packed, n_layers, width, slot, si_pack_ws{ws, ws_layer_stride, ws_rows});
  if (si_pack_check_args(m, cap, count) || !err) return SI_ERR_ARG;
  return launch(m, count, cap, err, nullptr, nullptr, nullptr, stream);
}

// `flag`, `seq`, `done` as for a pack: a direct move straight into a peer's region (a device-sized
// exchange, rows at their workspace slots) publishes it the same way.
int32_t si_pack_direct_cuda(SI_PACK_CACHE_PARAMS, const int32_t* layers, int32_t n_layers, const int32_t* req,
                            const int32_t* local, const int32_t* slot, const int32_t* count, int64_t cap,
                            int64_t width, uint8_t* ws, int64_t ws_layer_stride, int64_t ws_rows, int32_t* err,
                            int64_t* flag, const int64_t* seq, unsigned* done, void* stream) {
  const si_pack_move m = si_pack_move_direct(SI_PACK_CACHE_ARGS, layers, n_layers, req, local, slot, width,
                                             si_pack_ws{ws, ws_layer_stride, ws_rows});
  if (si_pack_check_args(m, cap, count) || !err || (flag && (!seq || !done))) return SI_ERR_ARG;
  return launch(m, count, cap, err, flag, seq, done, stream);
}

}  // extern "C"
