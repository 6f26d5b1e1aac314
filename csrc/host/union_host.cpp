// Host twin of the per-request MTP union kernel (csrc/cuda/union.cu): the same
// phases from sparkinfer/union.h run sequentially, one request after another.
#include "sparkinfer/union.h"

using namespace si::uni;

extern "C" {

int64_t si_union_host_workspace_ints(int32_t n) {
  return (n < 0 || n > kMaxEntries) ? -1 : workspace_ints(n);
}

// topk int32 [b, r, k] -> uni int32 [b, r*k], remap int32 [b, r, k], counts int32 [b];
// ws: int32 scratch of at least b * si_union_host_workspace_ints(r*k) entries.
int32_t si_union_host_run(const int32_t* topk, int32_t b, int32_t r, int32_t k, int32_t* uni,
                          int32_t* remap, int32_t* counts, int32_t* ws, int64_t ws_ints) {
  const int32_t st = check_args(topk, b, r, k, uni, remap, counts, ws, ws_ints);
  if (st != SI_OK) return st;
  const int32_t n = r * k;
  const int32_t cap = table_capacity(n);
  for (int32_t q = 0; q < b; ++q) {
    const int32_t* row = topk + (int64_t)q * n;
    int32_t* u = uni + (int64_t)q * n;
    int32_t* m = remap + (int64_t)q * n;
    const Workspace w = workspace_view(ws + (int64_t)q * workspace_ints(n), n);
    for (int32_t i = 0; i < cap; ++i) init_slot(w, i);
    for (int32_t p = 0; p < n; ++p) insert(w, row, p);
    for (int32_t p = 0; p < n; ++p) mark_first(w, p);
    const int32_t count = scan_range(w, 0, n, 0);
    for (int32_t p = 0; p < n; ++p) emit(w, row, u, p);
    for (int32_t p = 0; p < n; ++p) remap_and_pad(w, u, m, count, p);
    counts[q] = count;
  }
  return SI_OK;
}

}  // extern "C"
