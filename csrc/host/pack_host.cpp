// Host twins of the pack / unpack / direct kernels in csrc/cuda/pack.cu: the
// same per-record logic from sparkinfer/pack.h, one loop instead of a grid.
// Layouts are documented in pack.h. Like the kernels, each call reads the
// record count from memory (`count`, clamped to `cap` by si_pack_count) and
// returns SI_ERR_RANGE when the count or any index was out of range (the
// offending records are skipped, never written).
#include "sparkinfer/pack.h"

namespace {

si_pack_cache make_cache(const uint64_t* layer_base, int64_t n_blocks, int64_t block_stride, int32_t n_layers,
                         const int32_t* bt, int64_t bt_stride, int32_t bt_rows, int32_t bt_cols,
                         int32_t block_size) {
  return si_pack_cache{layer_base, n_blocks, block_stride, n_layers, bt, bt_stride, bt_rows, bt_cols, block_size};
}

bool bad_args(int64_t cap, int64_t width, int32_t n_layers) { return cap < 0 || width <= 0 || n_layers < 0; }

// Records to move (the kernels' clamp) and the call's initial status: SI_ERR_RANGE if *count was out of range.
int64_t counted(const int32_t* count, int64_t cap, int32_t* status) {
  bool bad;
  const int64_t n = si_pack_count(count, cap, &bad);
  *status = bad ? SI_ERR_RANGE : SI_OK;
  return n;
}

}  // namespace

extern "C" {

int32_t si_pack_pack_host(const uint64_t* layer_base, int64_t n_blocks, int64_t block_stride,
                          int32_t cache_layers, const int32_t* bt, int64_t bt_stride, int32_t bt_rows,
                          int32_t bt_cols, int32_t block_size, const int32_t* layers, int32_t n_layers,
                          const int32_t* req, const int32_t* local, const int32_t* count, int64_t cap,
                          int64_t width, uint8_t* packed) {
  if (bad_args(cap, width, n_layers) || block_size <= 0) return SI_ERR_ARG;
  const si_pack_cache c = make_cache(layer_base, n_blocks, block_stride, cache_layers, bt, bt_stride,
                                     bt_rows, bt_cols, block_size);
  int32_t status;
  const int64_t n = counted(count, cap, &status);
  for (int32_t j = 0; j < n_layers; ++j) {
    for (int64_t i = 0; i < n; ++i) {
      const uint8_t* src = si_pack_cache_src(c, layers, j, req[i], local[i], width);
      if (!src) { status = SI_ERR_RANGE; continue; }
      si_pack_copy_part(packed + (j * n + i) * width, src, width, 0, 1);
    }
  }
  return status;
}

int32_t si_pack_unpack_host(const uint8_t* packed, int32_t n_layers, const int32_t* count, int64_t cap,
                            int64_t width, const int32_t* slot, uint8_t* ws, int64_t ws_layer_stride,
                            int64_t ws_rows) {
  if (bad_args(cap, width, n_layers)) return SI_ERR_ARG;
  const si_pack_ws w{ws, ws_layer_stride, ws_rows};
  int32_t status;
  const int64_t n = counted(count, cap, &status);
  for (int32_t j = 0; j < n_layers; ++j) {
    for (int64_t i = 0; i < n; ++i) {
      uint8_t* dst = si_pack_ws_dst(w, j, slot[i], width);
      if (!dst) { status = SI_ERR_RANGE; continue; }
      si_pack_copy_part(dst, packed + (j * n + i) * width, width, 0, 1);
    }
  }
  return status;
}

int32_t si_pack_direct_host(const uint64_t* layer_base, int64_t n_blocks, int64_t block_stride,
                            int32_t cache_layers, const int32_t* bt, int64_t bt_stride, int32_t bt_rows,
                            int32_t bt_cols, int32_t block_size, const int32_t* layers, int32_t n_layers,
                            const int32_t* req, const int32_t* local, const int32_t* slot, const int32_t* count,
                            int64_t cap, int64_t width, uint8_t* ws, int64_t ws_layer_stride, int64_t ws_rows) {
  if (bad_args(cap, width, n_layers) || block_size <= 0) return SI_ERR_ARG;
  const si_pack_cache c = make_cache(layer_base, n_blocks, block_stride, cache_layers, bt, bt_stride,
                                     bt_rows, bt_cols, block_size);
  const si_pack_ws w{ws, ws_layer_stride, ws_rows};
  int32_t status;
  const int64_t n = counted(count, cap, &status);
  for (int32_t j = 0; j < n_layers; ++j) {
    for (int64_t i = 0; i < n; ++i) {
      const uint8_t* src = si_pack_cache_src(c, layers, j, req[i], local[i], width);
      uint8_t* dst = si_pack_ws_dst(w, j, slot[i], width);
      if (!src || !dst) { status = SI_ERR_RANGE; continue; }
      si_pack_copy_part(dst, src, width, 0, 1);
    }
  }
  return status;
}

}  // extern "C"
