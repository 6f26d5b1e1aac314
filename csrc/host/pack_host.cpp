// Host twins of the pack / unpack / direct kernels in csrc/cuda/pack.cu: the
// same per-record logic from sparkinfer/pack.h, one loop over the kernels' work
// items instead of a grid. Like the kernels, each call reads the record count
// from memory (`count`, clamped to `cap` by si_pack_count), skips everything
// when the error word `err` is already set, records an out-of-range count or
// index in it (first error wins, layout in common.h) and, for a pack or a
// direct move with a `flag` (into a peer's region), release-stores *seq there
// after the records when no error is set.
// `err` may be null (the eager host path): then only the returned status
// (SI_ERR_RANGE when the count or any index was out of range; the offending
// records are skipped, never written) reports errors, and the flag is stored
// when the call saw none.
#include "sparkinfer/pack.h"

namespace {

int32_t run(const si_pack_move& m, const int32_t* count, int64_t cap, int32_t* err, int64_t* flag,
            const int64_t* seq) {
  if (si_pack_check_args(m, cap, count) || (flag && !seq)) return SI_ERR_ARG;
  if (!si_error_clear_host(err)) return SI_OK;  // an earlier wait or move failed: the step is void
  int32_t status = SI_OK;
  bool bad;
  const int64_t n = si_pack_count(count, cap, &bad);
  if (bad) {
    status = SI_ERR_RANGE;
    si_error_set_host(err, si_error_word(SI_ERR_RANGE, SI_CHECK_COUNT, m.op, -1));
  }
  for (int64_t t = 0; t < n * m.n_layers; ++t) {
    const int32_t j = (int32_t)(t / n);
    const int32_t check = si_pack_move_one(m, j, t - j * n, n, 0, 1);
    if (check) {
      status = SI_ERR_RANGE;
      si_error_set_host(err, si_error_word(SI_ERR_RANGE, check, m.op, -1));
    }
  }
  if (flag && status == SI_OK && si_error_clear_host(err)) __atomic_store_n(flag, *seq, __ATOMIC_RELEASE);
  return status;
}

}  // namespace

extern "C" {

// CTAs the CUDA build launches for `cap` records x `n_layers` layers on a device with `sms` SMs.
int64_t si_pack_grid_host(int64_t cap, int32_t n_layers, int32_t sms) {
  return si_pack_grid(cap, n_layers, SI_PACK_WARPS, sms, SI_PACK_CTAS_PER_SM);
}

int32_t si_pack_pack_host(SI_PACK_CACHE_PARAMS, const int32_t* layers, int32_t n_layers, const int32_t* req,
                          const int32_t* local, const int32_t* count, int64_t cap, int64_t width, uint8_t* packed,
                          int32_t* err, int64_t* flag, const int64_t* seq) {
  return run(si_pack_move_pack(SI_PACK_CACHE_ARGS, layers, n_layers, req, local, width, packed), count, cap, err,
             flag, seq);
}

int32_t si_pack_unpack_host(const uint8_t* packed, int32_t n_layers, const int32_t* count, int64_t cap,
                            int64_t width, const int32_t* slot, uint8_t* ws, int64_t ws_layer_stride,
                            int64_t ws_rows, int32_t* err) {
  return run(si_pack_move_unpack(packed, n_layers, width, slot, si_pack_ws{ws, ws_layer_stride, ws_rows}), count,
             cap, err, nullptr, nullptr);
}

int32_t si_pack_direct_host(SI_PACK_CACHE_PARAMS, const int32_t* layers, int32_t n_layers, const int32_t* req,
                            const int32_t* local, const int32_t* slot, const int32_t* count, int64_t cap,
                            int64_t width, uint8_t* ws, int64_t ws_layer_stride, int64_t ws_rows, int32_t* err,
                            int64_t* flag, const int64_t* seq) {
  return run(si_pack_move_direct(SI_PACK_CACHE_ARGS, layers, n_layers, req, local, slot, width,
                                 si_pack_ws{ws, ws_layer_stride, ws_rows}),
             count, cap, err, flag, seq);
}

}  // extern "C"
