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
// Three moves share one per-record copy:
//   pack   cache[layers[j]][row(req[i], local[i])] -> packed[j][i]
//   unpack packed[j][i]                            -> workspace[j][slot[i]]
//   direct cache[layers[j]][row(req[i], local[i])] -> workspace[j][slot[i]]   (own records)
// Every index is bounds-checked; a bad one leaves the record untouched and is
// reported (SI_ERR_RANGE) instead of reading or writing out of bounds.
#pragma once

#include "sparkinfer/common.h"

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
