// Device-side arrival / release flags of the CUDA fabric (sparkinfer/comm/cuda_fabric.py).
// Same protocol as the host fabric's csrc/host/comm_flags.cpp: monotonic int64
// sequence numbers per (source, destination) pair, written with release
// semantics after the data and read with acquire semantics before it.
//
// The expected sequence number is read from device memory (`seq`), not baked
// into the launch, so a captured CUDA graph signals and waits correctly on
// every replay: the fabric bumps *seq with si_comm_seq_bump_cuda at the start
// of each exchange. A wait that spins longer than `timeout_cycles` gives up,
// stores SI_ERR_RANGE|flag index into *err (host-mapped memory the host polls)
// and returns, so a missing peer turns into a host error instead of a hung GPU.
#include <cuda_runtime.h>

#include "sparkinfer/common.h"

namespace {

__global__ void bump_kernel(int64_t* seq, int64_t step) { *seq += step; }

__global__ void signal_kernel(int64_t* flag, const int64_t* seq) {
  __threadfence_system();  // the copy's bytes before the flag, across the PCIe fabric
  atomicExch((unsigned long long*)flag, (unsigned long long)*seq);
}

__global__ void wait_kernel(const int64_t* flags, int32_t n, int64_t stride, const int64_t* seq, int64_t lag,
                            int32_t peer, long long timeout_cycles, int32_t* err) {
  const int32_t k = threadIdx.x;
  if (k >= n) return;
  const int64_t target = *seq - lag;
  const volatile int64_t* f = flags + (int64_t)k * stride;
  const long long t0 = clock64();
  while (*f < target) {
    if (clock64() - t0 > timeout_cycles) {
      atomicExch(err, (int32_t)(SI_ERR_RANGE | ((peer + k + 1) << 8)));  // which peer was missing
      return;
    }
    __nanosleep(1000);
  }
  __threadfence_system();
}

}  // namespace

extern "C" {

// *seq += step on `stream` (the slot's next sequence number: slots recur every `depth` exchanges).
int32_t si_comm_seq_bump_cuda(int64_t* seq, int64_t step, void* stream) {
  bump_kernel<<<1, 1, 0, (cudaStream_t)stream>>>(seq, step);
  return cudaGetLastError() == cudaSuccess ? SI_OK : SI_ERR_CUDA;
}

// *flag = *seq (after a system-wide fence), on `stream`, after the work before it.
int32_t si_comm_signal_cuda(int64_t* flag, const int64_t* seq, void* stream) {
  signal_kernel<<<1, 1, 0, (cudaStream_t)stream>>>(flag, seq);
  return cudaGetLastError() == cudaSuccess ? SI_OK : SI_ERR_CUDA;
}

// Block `stream` until flags[k * stride] >= *seq - lag for k < n (n <= 1024); on timeout
// *err = SI_ERR_RANGE | (peer + k + 1) << 8 for the flag k that never arrived.
int32_t si_comm_wait_cuda(const int64_t* flags, int32_t n, int64_t stride, const int64_t* seq, int64_t lag,
                          int32_t peer, long long timeout_cycles, int32_t* err, void* stream) {
  if (n <= 0) return SI_OK;
  if (n > 1024) return SI_ERR_ARG;
  wait_kernel<<<1, n, 0, (cudaStream_t)stream>>>(flags, n, stride, seq, lag, peer, timeout_cycles, err);
  return cudaGetLastError() == cudaSuccess ? SI_OK : SI_ERR_CUDA;
}

}  // extern "C"
