// Device-side arrival / release flags of the CUDA fabric (sparkinfer/comm/cuda_fabric.py).
// Same protocol as the host fabric's csrc/host/comm_flags.cpp: monotonic int64
// sequence numbers per (source, destination) pair, written with release
// semantics after the data and read with acquire semantics before it. Flags sit
// in a peer's memory over PCIe P2P, which has no native atomics, so a signal is
// a system fence followed by a release store at system scope (common.h), never
// an atomic read-modify-write. A pack straight into a peer's region signals
// from the pack kernel itself (si_pack_pack_cuda's `flag`); the kernels here
// signal after copy-engine copies (stream order puts the copy first) and acks.
//
// The expected sequence number is read from device memory (`seq`), not baked
// into the launch, so a captured CUDA graph signals and waits correctly on
// every replay: the fabric bumps *seq with si_comm_seq_bump_cuda at the start
// of each exchange. A wait that spins longer than `timeout_cycles` gives up and
// sets the error word *err (layout in common.h: SI_ERR_TIMEOUT, SI_CHECK_WAIT,
// the missing peer), so a missing peer turns into a host error instead of a hung
// GPU; the moves that follow on the stream then skip (they read the same word).
// Host twins: si_comm_wait_twin / si_comm_signal_twin in csrc/host/comm_flags.cpp.
#include <cuda_runtime.h>

#include "sparkinfer/common.h"

namespace {

__global__ void bump_kernel(int64_t* seq, int64_t step) { *seq += step; }

__global__ void signal_kernel(int64_t* flag, const int64_t* seq, const int32_t* err) {
  __threadfence_system();  // the work before this kernel, visible system-wide before the flag
  if (err == nullptr || si_error_clear_device(err)) si_flag_store_release(flag, *seq);
}

__global__ void wait_kernel(const int64_t* flags, int32_t n, int64_t stride, const int64_t* seq, int64_t lag,
                            int32_t peer, long long timeout_cycles, int32_t* err) {
  const int32_t k = threadIdx.x;
  if (k >= n || !si_error_clear_device(err)) return;  // a peer already failed this step: do not spin again
  const int64_t target = *seq - lag;
  const int64_t* f = flags + (int64_t)k * stride;
  const long long t0 = clock64();
  while (si_flag_load_acquire(f) < target) {
    if (clock64() - t0 > timeout_cycles) {
      si_error_set_device(err, si_error_word(SI_ERR_TIMEOUT, SI_CHECK_WAIT, SI_OP_WAIT, peer + k));
      return;
    }
    __nanosleep(1000);
  }
}

int32_t launched() { return cudaGetLastError() == cudaSuccess ? SI_OK : SI_ERR_CUDA; }

}  // namespace

extern "C" {

// *seq += step on `stream` (the slot's next sequence number: slots recur every `depth` exchanges).
int32_t si_comm_seq_bump_cuda(int64_t* seq, int64_t step, void* stream) {
  bump_kernel<<<1, 1, 0, (cudaStream_t)stream>>>(seq, step);
  return launched();
}

// *flag = *seq (a system fence, then a release store), on `stream`, after the work before it.
int32_t si_comm_signal_cuda(int64_t* flag, const int64_t* seq, void* stream) {
  signal_kernel<<<1, 1, 0, (cudaStream_t)stream>>>(flag, seq, nullptr);
  return launched();
}

// si_comm_signal_cuda, skipped when the error word *err is set (the data before it is not valid).
int32_t si_comm_signal_checked_cuda(int64_t* flag, const int64_t* seq, const int32_t* err, void* stream) {
  if (!err) return SI_ERR_ARG;
  signal_kernel<<<1, 1, 0, (cudaStream_t)stream>>>(flag, seq, err);
  return launched();
}

// Block `stream` until flags[k * stride] >= *seq - lag for k < n (n <= 1024); returns at once when
// *err is already set; on timeout sets *err (first error wins) naming peer + k, the flag k that
// never arrived.
int32_t si_comm_wait_cuda(const int64_t* flags, int32_t n, int64_t stride, const int64_t* seq, int64_t lag,
                          int32_t peer, long long timeout_cycles, int32_t* err, void* stream) {
  if (n <= 0) return SI_OK;
  if (n > 1024 || !err) return SI_ERR_ARG;
  wait_kernel<<<1, n, 0, (cudaStream_t)stream>>>(flags, n, stride, seq, lag, peer, timeout_cycles, err);
  return launched();
}

}  // extern "C"
