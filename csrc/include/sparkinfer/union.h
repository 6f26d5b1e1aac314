// Per-request union of the MTP rows' top-k sets, written once for the CUDA
// kernel (csrc/cuda/union.cu, one block per request) and its host twin
// (csrc/host/union_host.cpp). Contract: sparkinfer/plan/union.py.
//
// For one request with n = R * K entries `topk[p]` (p = r * K + k, -1 = pad):
//   union[u]  distinct tokens in first-occurrence order over p, -1 after count
//   remap[p]  index u with union[u] == topk[p], -1 for a pad
// The result depends only on first positions, never on hashing or thread order.
//
// Algorithm (each phase is a loop over an index; the kernel strides it over
// threads with a barrier between phases, the host runs it sequentially):
//   1 init    clear an open-addressing table of cap = pow2 >= 2n slots
//   2 insert  claim the token's slot (CAS), record min position (atomic min)
//   3 mark    flag[p] = 1 where p is its token's first position
//   4 scan    exclusive prefix sum of flag -> union ordinal (flag[p] = -1 otherwise)
//   5 emit    union[ordinal] = token; the slot's value becomes the ordinal
//   6 remap   remap[p] = ordinal of topk[p]'s slot; union tail padded with -1
//
// Workspace per request, int32 (workspace_ints(n) of them):
//   [0, cap)            slot keys (token, -1 = empty)
//   [cap, 2cap)         slot value (first position, then union ordinal)
//   [2cap, 2cap + n)    slot_of[p]: table slot of topk[p], -1 for a pad
//   [2cap + n, 2cap+2n) flag[p] / ordinal[p]
#pragma once

#include "sparkinfer/common.h"

namespace si {
namespace uni {

constexpr int32_t kEmpty = -1;
constexpr int32_t kNoPos = 0x7fffffff;
// Keeps 2 * cap + 2 * n inside int32 indexing.
constexpr int32_t kMaxEntries = 1 << 27;

SI_HD int32_t table_capacity(int32_t n) {
  int32_t cap = 2;
  while (cap < 2 * n) cap <<= 1;
  return cap;
}

SI_HD int64_t workspace_ints(int32_t n) {
  return 2 * (int64_t)table_capacity(n) + 2 * (int64_t)n;
}

struct Workspace {
  int32_t* keys;
  int32_t* value;
  int32_t* slot_of;
  int32_t* flag;
  uint32_t mask;   // cap - 1
  uint32_t shift;  // 32 - log2(cap)
};

SI_HD Workspace workspace_view(int32_t* base, int32_t n) {
  const int32_t cap = table_capacity(n);
  uint32_t bits = 0;
  while ((1 << bits) < cap) ++bits;
  return Workspace{base, base + cap, base + 2 * cap, base + 2 * cap + n, (uint32_t)(cap - 1),
                   32u - bits};
}

// The host twin runs one thread, so plain read-modify-write is exact there.
SI_HD int32_t cas_i32(int32_t* p, int32_t expected, int32_t desired) {
#if defined(__CUDA_ARCH__)
  return atomicCAS(p, expected, desired);
#else
  const int32_t old = *p;
  if (old == expected) *p = desired;
  return old;
#endif
}

SI_HD void min_i32(int32_t* p, int32_t v) {
#if defined(__CUDA_ARCH__)
  atomicMin(p, v);
#else
  if (v < *p) *p = v;
#endif
}

// Fibonacci hashing: the top bits of token * 2^32/phi spread runs and strides of ids.
SI_HD uint32_t hash_slot(int32_t token, uint32_t shift) {
  return ((uint32_t)token * 0x9E3779B1u) >> shift;
}

// Phase 1, i in [0, cap).
SI_HD void init_slot(const Workspace& w, int32_t i) {
  w.keys[i] = kEmpty;
  w.value[i] = kNoPos;
}

// Phase 2, p in [0, n). The table has > n slots, so probing always ends.
SI_HD void insert(const Workspace& w, const int32_t* topk, int32_t p) {
  const int32_t t = topk[p];
  if (t < 0) {
    w.slot_of[p] = -1;
    return;
  }
  uint32_t h = hash_slot(t, w.shift);
  for (;;) {
    const int32_t prev = cas_i32(&w.keys[h], kEmpty, t);
    if (prev == kEmpty || prev == t) break;
    h = (h + 1) & w.mask;
  }
  min_i32(&w.value[h], p);
  w.slot_of[p] = (int32_t)h;
}

// Phase 3, p in [0, n).
SI_HD void mark_first(const Workspace& w, int32_t p) {
  const int32_t s = w.slot_of[p];
  w.flag[p] = (s >= 0 && w.value[s] == p) ? 1 : 0;
}

// Phase 4 over positions [lo, hi) given the number of first occurrences before lo;
// returns the running count after hi.
SI_HD int32_t scan_range(const Workspace& w, int32_t lo, int32_t hi, int32_t offset) {
  for (int32_t p = lo; p < hi; ++p) w.flag[p] = w.flag[p] ? offset++ : -1;
  return offset;
}

SI_HD int32_t count_range(const Workspace& w, int32_t lo, int32_t hi) {
  int32_t c = 0;
  for (int32_t p = lo; p < hi; ++p) c += w.flag[p];
  return c;
}

// Phase 5, p in [0, n).
SI_HD void emit(const Workspace& w, const int32_t* topk, int32_t* uni, int32_t p) {
  const int32_t o = w.flag[p];
  if (o >= 0) {
    uni[o] = topk[p];
    w.value[w.slot_of[p]] = o;
  }
}

// Phase 6, p in [0, n).
SI_HD void remap_and_pad(const Workspace& w, int32_t* uni, int32_t* remap, int32_t count,
                         int32_t p) {
  const int32_t s = w.slot_of[p];
  remap[p] = s < 0 ? -1 : w.value[s];
  if (p >= count) uni[p] = -1;
}

// Shared argument check of both entry points.
SI_HD int32_t check_args(const void* topk, int32_t b, int32_t r, int32_t k, const void* uni,
                         const void* remap, const void* counts, const void* ws,
                         int64_t ws_ints) {
  if (b < 0 || r < 0 || k < 0) return SI_ERR_ARG;
  if (r != 0 && k > kMaxEntries / r) return SI_ERR_ARG;
  if (b == 0) return SI_OK;
  if (!counts || !ws) return SI_ERR_ARG;
  if (r * k > 0 && (!topk || !uni || !remap)) return SI_ERR_ARG;  // empty tensors may be null
  if (ws_ints < (int64_t)b * workspace_ints(r * k)) return SI_ERR_ARG;
  return SI_OK;
}

}  // namespace uni
}  // namespace si
