// Record gather/scatter for the selected-record exchange, written once for the
// CUDA kernels (csrc/cuda/pack.cu) and their host twins (csrc/host/pack_host.cpp).
//
// Shapes (all byte offsets; records are opaque `width`-byte rows, any width >= 1):
//   cache      L_cache layers of uint8 [n_blocks][block_size][width]: layer l at address
//              layer_base[l], block k at + k * block_stride bytes, rows of a block contiguous
//              (vLLM allocates one tensor per layer, and its per-layer views can interleave
//               layers block by block, so neither a layer nor a block stride is assumed).
//              A rank's paged shard: local ordinal o of request r is row o % block_size of
//              block block_table[r][o / block_size].
//   block_table int32 [B][bt_stride] (bt_cols valid columns per request)
//   layers     int32 [n_layers]  which cache layers travel, in slab order
//   req, local int32 [n]         request index and local ordinal of record i on this rank
//   slot       int32 [n]         destination workspace row of record i (b * U + u)
//   packed     uint8 [n_layers][n][width]  one contiguous region per destination
//   workspace  uint8 [n_layers][ws_rows][width], layer j at ws + j * ws_layer_stride
//
// Three moves share one per-record copy (si_pack_move_one):
//   pack   cache[layers[j]][row(req[i], local[i])] -> packed[j][i]
//   unpack packed[j][i]                            -> workspace[j][slot[i]]
//   direct cache[layers[j]][row(req[i], local[i])] -> workspace[j][slot[i]]   (own records)
// The record count n is read from memory (`count`, an entry of the count plane) and clamped to
// `cap`. Work item t < n_layers * n is record (j, i) = (t / n, t % n): the kernels stride a fixed
// grid over t (si_pack_grid CTAs, sized by the SM count, not by cap), the host twins loop over it.
// Every index is bounds-checked; a bad one leaves the record untouched and is reported in the
// error word (layout in common.h) instead of reading or writing out of bounds.
//
// Arrival signal (pack and direct, optional): after every record of the launch has landed, store *seq
// into the int64 `flag` (a peer's arrival flag) with release semantics at system scope. The
// kernel's CTAs each fence system-wide after their stores and count themselves on a device-local
// counter (`done`, zero before the launch, left zero after it); the last one fences again and
// release-stores the flag, so the flag can never be seen before the data. The flag is written
// only when the error word is still clear: a peer never sees an arrival for a failed pack.
#pragma once

#include "sparkinfer/common.h"

// Launch shape of the move kernels (the host twins walk the same work items in order).
constexpr int32_t SI_PACK_LANES = 32;        // threads per record (one warp)
constexpr int32_t SI_PACK_WARPS = 4;         // records in flight per CTA
constexpr int32_t SI_PACK_CTAS_PER_SM = 8;   // 32 resident warps per SM: fits sm_90 and sm_120

struct si_pack_cache {
  const uint64_t* layer_base;  // [n_layers] address of each layer's block 0 (device memory for kernels)
  int64_t n_blocks;      // blocks per layer
  int64_t block_stride;  // bytes between blocks
  int32_t n_layers;      // layers held (bound for layers[])
  const int32_t* block_table;
  int64_t bt_stride;     // int32 elements between requests
  int32_t bt_rows;       // requests
  int32_t bt_cols;       // valid block columns per request
  int32_t block_size;
};

struct si_pack_ws {
  uint8_t* base;
  int64_t layer_stride;  // bytes between layers
  int64_t rows;          // B * U
};

// Byte offset of (req, local) inside a layer, or -1 when any index is out of range.
SI_HD int64_t si_pack_cache_offset(const si_pack_cache& c, int32_t req, int32_t local, int64_t width) {
  if (req < 0 || req >= c.bt_rows || local < 0) return -1;
  const int32_t col = local / c.block_size;
  if (col >= c.bt_cols) return -1;
  const int64_t block = c.block_table[(int64_t)req * c.bt_stride + col];
  if (block < 0 || block >= c.n_blocks) return -1;
  return block * c.block_stride + (int64_t)(local % c.block_size) * width;
}

// Source address of record i of slab layer j, or nullptr when out of range.
SI_HD const uint8_t* si_pack_cache_src(const si_pack_cache& c, const int32_t* layers, int32_t j,
                                       int32_t req, int32_t local, int64_t width) {
  const int32_t layer = layers[j];
  if (layer < 0 || layer >= c.n_layers) return nullptr;
  const int64_t off = si_pack_cache_offset(c, req, local, width);
  if (off < 0) return nullptr;
  return (const uint8_t*)c.layer_base[layer] + off;
}

SI_HD uint8_t* si_pack_ws_dst(const si_pack_ws& w, int32_t j, int32_t slot, int64_t width) {
  if (slot < 0 || slot >= w.rows) return nullptr;
  return w.base + (int64_t)j * w.layer_stride + (int64_t)slot * width;
}

// Records one launch moves: *count (read from memory, e.g. an entry of the
// count plane, so the launch needs no host-side size) clamped to [0, cap]. A
// count outside that range is a planner bug or a missed overflow: the caller
// reports it (SI_ERR_RANGE) and moves the first `cap` records, never more.
SI_HD int64_t si_pack_count(const int32_t* count, int64_t cap, bool* bad) {
  const int64_t n = *count;
  *bad = n < 0 || n > cap;
  return n < 0 ? 0 : (n > cap ? cap : n);
}

// Copy bytes [begin, width) of one record with a stride of `step` units, the
// widest unit that divides the width and both addresses (16, 4 or 1 bytes), so
// 368/432/656-byte records move as 16-byte vectors and odd widths still work.
SI_HD int si_pack_unit(const void* dst, const void* src, int64_t width) {
  const uintptr_t a = (uintptr_t)dst | (uintptr_t)src | (uintptr_t)width;
  return (a % 16 == 0) ? 16 : (a % 4 == 0) ? 4 : 1;
}

SI_HD void si_pack_copy_part(uint8_t* dst, const uint8_t* src, int64_t width, int64_t lane, int64_t lanes) {
  const int unit = si_pack_unit(dst, src, width);
  const int64_t n = width / unit;
  if (unit == 16) {
    struct alignas(16) v16 { uint32_t w[4]; };
    for (int64_t k = lane; k < n; k += lanes) ((v16*)dst)[k] = ((const v16*)src)[k];
  } else if (unit == 4) {
    for (int64_t k = lane; k < n; k += lanes) ((uint32_t*)dst)[k] = ((const uint32_t*)src)[k];
  } else {
    for (int64_t k = lane; k < n; k += lanes) dst[k] = src[k];
  }
}

// ---- one record of a move, and the work split ---------------------------------------------------

struct si_pack_move {
  int32_t op;               // SI_OP_PACK / SI_OP_UNPACK / SI_OP_DIRECT
  si_pack_cache c;          // source cache (pack, direct)
  const int32_t* layers;    // [n_layers] (pack, direct)
  const int32_t* req;       // [cap] (pack, direct)
  const int32_t* local;     // [cap] (pack, direct)
  const int32_t* slot;      // [cap] (unpack, direct)
  const uint8_t* packed_in; // [n_layers][n][width] (unpack)
  uint8_t* packed_out;      // [n_layers][n][width] (pack)
  si_pack_ws w;             // destination workspace (unpack, direct)
  int32_t n_layers;
  int64_t width;
};

// Bytes [lane units, step lanes) of record (j, i) of a launch moving n records per layer.
// Returns 0, or the si_check of the index that was out of range (nothing written then).
SI_HD int32_t si_pack_move_one(const si_pack_move& m, int32_t j, int64_t i, int64_t n, int64_t lane,
                               int64_t lanes) {
  const int64_t packed_off = ((int64_t)j * n + i) * m.width;
  const uint8_t* src = m.op == SI_OP_UNPACK
                           ? m.packed_in + packed_off
                           : si_pack_cache_src(m.c, m.layers, j, m.req[i], m.local[i], m.width);
  if (!src) return SI_CHECK_RECORD;
  uint8_t* dst = m.op == SI_OP_PACK ? m.packed_out + packed_off : si_pack_ws_dst(m.w, j, m.slot[i], m.width);
  if (!dst) return SI_CHECK_SLOT;
  si_pack_copy_part(dst, src, m.width, lane, lanes);
  return 0;
}

// CTAs of a move launch: one per `per_cta` work items of the capacity (cap * n_layers), at most
// `per_sm` per SM. The kernels stride over the items of the count read on the device, so a launch
// costs the same for 10 records or 10^5, and one configuration serves every step (CUDA graphs).
SI_HD int64_t si_pack_grid(int64_t cap, int32_t n_layers, int32_t per_cta, int32_t sms, int32_t per_sm) {
  const int64_t need = (cap * n_layers + per_cta - 1) / per_cta;
  const int64_t most = (int64_t)(sms > 0 ? sms : 1) * per_sm;
  return need < most ? need : most;
}

// The moves as the extern "C" entry points receive them (same argument order in both builds).
#define SI_PACK_CACHE_PARAMS                                                                              \
  const uint64_t *layer_base, int64_t n_blocks, int64_t block_stride, int32_t cache_layers, const int32_t *bt, \
      int64_t bt_stride, int32_t bt_rows, int32_t bt_cols, int32_t block_size
#define SI_PACK_CACHE_ARGS \
  si_pack_cache { layer_base, n_blocks, block_stride, cache_layers, bt, bt_stride, bt_rows, bt_cols, block_size }

SI_HD si_pack_move si_pack_move_pack(const si_pack_cache& c, const int32_t* layers, int32_t n_layers,
                                     const int32_t* req, const int32_t* local, int64_t width, uint8_t* packed) {
  si_pack_move m{};
  m.op = SI_OP_PACK, m.c = c, m.layers = layers, m.req = req, m.local = local, m.packed_out = packed;
  m.n_layers = n_layers, m.width = width;
  return m;
}

SI_HD si_pack_move si_pack_move_unpack(const uint8_t* packed, int32_t n_layers, int64_t width, const int32_t* slot,
                                       const si_pack_ws& w) {
  si_pack_move m{};
  m.op = SI_OP_UNPACK, m.packed_in = packed, m.slot = slot, m.w = w, m.n_layers = n_layers, m.width = width;
  return m;
}

SI_HD si_pack_move si_pack_move_direct(const si_pack_cache& c, const int32_t* layers, int32_t n_layers,
                                       const int32_t* req, const int32_t* local, const int32_t* slot, int64_t width,
                                       const si_pack_ws& w) {
  si_pack_move m = si_pack_move_pack(c, layers, n_layers, req, local, width, nullptr);
  m.op = SI_OP_DIRECT, m.slot = slot, m.w = w;
  return m;
}

// Argument check shared by the entry points: SI_OK or SI_ERR_ARG.
SI_HD int32_t si_pack_check_args(const si_pack_move& m, int64_t cap, const int32_t* count) {
  const bool cache_ok = m.op == SI_OP_UNPACK || m.c.block_size > 0;
  return (cap < 0 || m.width <= 0 || m.n_layers < 0 || !count || !cache_ok) ? SI_ERR_ARG : SI_OK;
}
