// Arrival / release / abort flags of the host fabric (sparkinfer/comm/host_fabric.py).
// Flags are int64 words in shared memory written by other processes, so every
// access is an atomic with release (store) / acquire (load) ordering: a reader
// that sees sequence number k also sees the slab bytes written before it.
// The wait loop runs here, outside the Python GIL (ctypes drops it), so a
// rank's copy thread keeps running while its main thread waits.
#include <time.h>

#include "sparkinfer/common.h"

extern "C" {

void si_comm_flag_store(int64_t* flag, int64_t value) { __atomic_store_n(flag, value, __ATOMIC_RELEASE); }

int64_t si_comm_flag_load(const int64_t* flag) { return __atomic_load_n(flag, __ATOMIC_ACQUIRE); }

// Wait until flags[idx[k] * stride] >= target for every k < n, or any
// abort[a * stride] != 0 (a < n_abort; checked first), or timeout_ns elapses.
// Returns 0 when all arrived, 1 on timeout, 2 on a peer abort; `pending` gets a
// bitmask of the k that had not arrived (bit k for idx[k]).
int32_t si_comm_flag_wait(const int64_t* flags, const int32_t* idx, int32_t n, int64_t stride,
                          int64_t target, const int64_t* abort, int32_t n_abort, int64_t timeout_ns,
                          int64_t* pending) {
  timespec t0;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  int64_t sleep_ns = 0;
  for (;;) {
    int64_t mask = 0;
    for (int32_t k = 0; k < n; ++k)
      if (__atomic_load_n(flags + (int64_t)idx[k] * stride, __ATOMIC_ACQUIRE) < target) mask |= int64_t(1) << k;
    *pending = mask;
    // A peer's abort wins even when our data is complete: the exchange is broken for everyone.
    for (int32_t a = 0; a < n_abort; ++a)
      if (__atomic_load_n(abort + (int64_t)a * stride, __ATOMIC_ACQUIRE) != 0) return 2;
    if (mask == 0) return 0;
    timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    const int64_t waited = (t.tv_sec - t0.tv_sec) * 1000000000LL + (t.tv_nsec - t0.tv_nsec);
    if (waited >= timeout_ns) return 1;
    // Back off from spinning to sleeping: 2 shared cores must not be burnt by
    // four processes polling, but a fast peer should cost only microseconds.
    sleep_ns = sleep_ns < 1000 ? sleep_ns + 100 : (sleep_ns < 200000 ? sleep_ns * 2 : 200000);
    timespec s{0, (long)sleep_ns};
    nanosleep(&s, nullptr);
  }
}

}  // extern "C"

// ---- Host twins of the CUDA fabric's flag kernels (csrc/cuda/comm_flags.cu) --------------------
// Same semantics, for the tests: a release store of *seq unless the error word is set; a wait that
// returns at once when the word is set, and on timeout sets it (first error wins, common.h layout)
// to SI_ERR_TIMEOUT / SI_CHECK_WAIT / SI_OP_WAIT naming peer + k. timeout_ns instead of cycles.
extern "C" {

int32_t si_comm_signal_twin(int64_t* flag, const int64_t* seq, const int32_t* err) {
  if (si_error_clear_host(err)) __atomic_store_n(flag, *seq, __ATOMIC_RELEASE);
  return SI_OK;
}

int32_t si_comm_wait_twin(const int64_t* flags, int32_t n, int64_t stride, const int64_t* seq, int64_t lag,
                          int32_t peer, int64_t timeout_ns, int32_t* err) {
  if (n <= 0) return SI_OK;
  if (n > 1024 || !err) return SI_ERR_ARG;
  if (!si_error_clear_host(err)) return SI_OK;
  const int64_t target = *seq - lag;
  timespec t0;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (int32_t k = 0; k < n; ++k) {
    while (__atomic_load_n(flags + (int64_t)k * stride, __ATOMIC_ACQUIRE) < target) {
      timespec t;
      clock_gettime(CLOCK_MONOTONIC, &t);
      if ((t.tv_sec - t0.tv_sec) * 1000000000LL + (t.tv_nsec - t0.tv_nsec) > timeout_ns) {
        si_error_set_host(err, si_error_word(SI_ERR_TIMEOUT, SI_CHECK_WAIT, SI_OP_WAIT, peer + k));
        return SI_OK;
      }
      timespec s{0, 1000};
      nanosleep(&s, nullptr);
    }
  }
  return SI_OK;
}

}  // extern "C"
