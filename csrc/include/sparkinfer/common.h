// Shared macros for code compiled both by nvcc (kernels) and g++ (host twins).
// Headers under csrc/include are torch-free: plain pointers and sizes only.
#pragma once

#include <stdint.h>

#if defined(__CUDACC__)
#define SI_HD __host__ __device__ __forceinline__
#else
#define SI_HD inline
#endif

// Status codes returned by every extern "C" entry point in csrc/.
enum si_status : int32_t {
  SI_OK = 0,
  SI_ERR_ARG = 1,      // a size or pointer argument is invalid
  SI_ERR_CUDA = 2,     // a CUDA launch or API call failed
  SI_ERR_RANGE = 3,    // an index or a record count points outside its buffer
  SI_ERR_TIMEOUT = 4,  // a flag wait gave up (a peer never signalled)
};

// ---- The error word ------------------------------------------------------------------------
// One int32 per fabric (or per device for the pack moves), written by kernels, read by the host a
// step later (sparkinfer/comm/flags.py mirrors this layout: keep them in sync):
//
//   bits  0..7   status  si_status (SI_ERR_RANGE, SI_ERR_TIMEOUT)
//   bits  8..15  peer    peer rank + 1 of a timed-out wait, 0 when no peer is involved
//   bits 16..23  check   si_check: what was out of range / what timed out
//   bits 24..30  op      si_op: the kernel that set it
//
// 0 means "no error". The first error wins (compare-and-swap from 0) and the word stays set until
// the host clears it, so the message names the root cause, not a consequence. While it is set,
// every move (pack, unpack, direct), wait and checked signal of that word does nothing: an unpack
// never consumes bytes whose arrival wait failed, a pack never overwrites a region whose release
// wait failed, a wait does not spin again for a peer already known to be missing. The outputs of
// a step with a set word are unspecified (never out of bounds): the step must be failed.
//
// Memory: device memory is the fast choice (each CTA of a move reads it once); copy it to pinned
// host memory once per step for the host's delayed read. Host-mapped (pinned) memory works too, at
// one PCIe read per CTA.
enum si_check : int32_t {
  SI_CHECK_COUNT = 1,   // a record count outside [0, capacity]
  SI_CHECK_RECORD = 2,  // a source record (request, local ordinal, block, layer) out of range
  SI_CHECK_SLOT = 3,    // a destination workspace slot out of range
  SI_CHECK_WAIT = 4,    // a flag wait timed out (peer names whose flag never arrived)
};

enum si_op : int32_t { SI_OP_PACK = 1, SI_OP_UNPACK = 2, SI_OP_DIRECT = 3, SI_OP_WAIT = 4 };

SI_HD int32_t si_error_word(int32_t status, int32_t check, int32_t op, int32_t peer) {
  return (status & 0xff) | ((peer + 1) & 0xff) << 8 | (check & 0xff) << 16 | (op & 0x7f) << 24;
}

#if !defined(__CUDA_ARCH__)
// Host twin of the kernels' first-error-wins store (the host twins may run on several threads).
inline void si_error_set_host(int32_t* err, int32_t word) {
  int32_t zero = 0;
  if (err) __atomic_compare_exchange_n(err, &zero, word, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
}

inline bool si_error_clear_host(const int32_t* err) { return !err || __atomic_load_n(err, __ATOMIC_ACQUIRE) == 0; }
#endif

#if defined(__CUDACC__)
// Device halves of the error word and of the arrival flags. Flags live in a peer's memory, reached
// over PCIe P2P, which carries no native atomics: a flag is a release store at system scope (after
// a system fence, by the kernel that wrote the data) and is read with an acquire load.
__device__ __forceinline__ void si_error_set_device(int32_t* err, int32_t word) { atomicCAS(err, 0, word); }

__device__ __forceinline__ bool si_error_clear_device(const int32_t* err) {
  return *(const volatile int32_t*)err == 0;
}

__device__ __forceinline__ void si_flag_store_release(int64_t* flag, int64_t value) {
  asm volatile("st.release.sys.global.s64 [%0], %1;" ::"l"(flag), "l"(value) : "memory");
}

__device__ __forceinline__ int64_t si_flag_load_acquire(const int64_t* flag) {
  int64_t v;
  asm volatile("ld.acquire.sys.global.s64 %0, [%1];" : "=l"(v) : "l"(flag) : "memory");
  return v;
}
#endif
