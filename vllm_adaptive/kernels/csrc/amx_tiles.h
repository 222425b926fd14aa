// bf16 rows times low-bit weights on AMX tiles (int8_linear.cpp, int4_linear.cpp): the codes of a
// block of 32 columns made bf16 (k, k + 1) pairs per 32 k, once for up to 32 rows, and the
// products summed in float32 by the tile unit. The vdpbf16ps loops those kernels run elsewhere
// are bound by their multiplies from about 4 rows on; the tiles take that away, leaving the read
// and conversion of the codes. Exact products and float32 sums, as in those loops.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "blocked_weight.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define ADAPTIVE_AMX_TILES 1
#endif

namespace amx_tiles {

using blocked_weight::kCols;
constexpr int64_t kTileRows = 16;  // rows of an A tile (16 x 32 bf16)
constexpr int64_t kRows = 32;      // rows per read of the weight: two A tiles

// Fewest bf16 rows the kernels run on tiles (below them their vdpbf16ps loops); 0: never. A
// whole decode step's linears of the default model, weights cold, one thread, on an AMX Xeon
// (2026-12-07, docs/experiments/amx_step.py, docs/data/amx-step.json), at 2 / 3 / 8 / 32 rows:
// int8 g32 on tiles 18.8 / 19.5 / 21.8 / 32.2 ms against its loop's 18.4 / 22.3 / 35.8 / 125.8,
// 4-bit g32 15.5 / 16.2 / 18.9 / 46.5 against 17.4 / 22.3 / 32.1 / 118.3. One setting for both.
inline std::atomic<int64_t>& min_rows() {
  static std::atomic<int64_t> rows{3};
  return rows;
}

#if defined(ADAPTIVE_AMX_TILES)
constexpr bool kBuild = true;

// Linux hands a process the tile registers only once it asks (arch_prctl with
// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); where it refuses the loops run.
inline bool permitted() {
  static const bool ok = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// All eight tiles 16 x 64 B: 0 / 1 = rows 0-15 / 16-31 of x over 32 k (bf16), 2 / 3 = the codes
// of columns 0-15 / 16-31 over the same 32 k as 16 (k, k + 1) pairs (bf16), 4 + 2 i + j = the
// float32 sums of x tile i times codes tile j. The configuration is the thread's, and oneDNN
// loads its own: set on entry to each parallel chunk, released on leaving it.
inline void configure() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

// Rows 0 .. rows (at most 32, of a zero-padded x with row stride K) times one block: per 32 k,
// pairs(k, b0, b1) writes the codes of columns 0-15 and 16-31 as 16 rows of 16 bf16 pairs each;
// per group of `group` k (a multiple of 32), epilogue(g, c) takes the group's float32 sums c.
template <bool Two, typename Pairs, typename Epilogue>
inline void block(const uint16_t* x, int64_t K, int64_t group, const Pairs& pairs,
                  const Epilogue& epilogue) {
  alignas(64) uint16_t b[2][16 * 32];
  alignas(64) float c[kRows][kCols];
  for (int64_t k0 = 0, g = 0; k0 < K; k0 += group, ++g) {
    _tile_zero(4);
    _tile_zero(5);
    if constexpr (Two) {
      _tile_zero(6);
      _tile_zero(7);
    }
    for (int64_t k = k0; k < k0 + group; k += 32) {
      pairs(k, b[0], b[1]);
      _tile_loadd(2, b[0], 64);
      _tile_loadd(3, b[1], 64);
      _tile_loadd(0, x + k, K * 2);
      _tile_dpbf16ps(4, 0, 2);
      _tile_dpbf16ps(5, 0, 3);
      if constexpr (Two) {
        _tile_loadd(1, x + kTileRows * K + k, K * 2);
        _tile_dpbf16ps(6, 1, 2);
        _tile_dpbf16ps(7, 1, 3);
      }
    }
    _tile_stored(4, c[0], kCols * 4);
    _tile_stored(5, c[0] + 16, kCols * 4);
    if constexpr (Two) {
      _tile_stored(6, c[kTileRows], kCols * 4);
      _tile_stored(7, c[kTileRows] + 16, kCols * 4);
    }
    epilogue(g, c);
  }
}

// block() for `rows` of x: with the second row tile where there are more than 16.
template <typename Pairs, typename Epilogue>
inline void block_rows(const uint16_t* x, int64_t rows, int64_t K, int64_t group,
                       const Pairs& pairs, const Epilogue& epilogue) {
  if (rows > kTileRows)
    block<true>(x, K, group, pairs, epilogue);
  else
    block<false>(x, K, group, pairs, epilogue);
}

// fn(xs, b, cols, r, rows) for every column block b (its `cols` valid columns) and every
// 32 rows r .. r + rows of x, xs pointing at row r of x zero-padded to whole tiles; the blocks
// spread over threads, each with its tiles configured.
template <typename Fn>
inline void for_each_block(const at::Tensor& x, int64_t blocks, int64_t out_features,
                           const Fn& fn) {
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t padded = (M + kTileRows - 1) / kTileRows * kTileRows;
  at::Tensor xp = x;
  if (padded != M) {  // a tile loads 16 rows: the missing ones are zeros
    xp = at::zeros({padded, K}, x.options());
    xp.narrow(0, 0, M).copy_(x);
  }
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(xp.data_ptr<at::BFloat16>());
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    configure();
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t cols = std::min(kCols, out_features - b * kCols);
      for (int64_t r = 0; r < M; r += kRows) {
        const int64_t rows = std::min(kRows, M - r);
        fn(xs + r * K, b, cols, r, rows);
      }
    }
    _tile_release();
  });
}
#else
constexpr bool kBuild = false;
inline bool permitted() { return false; }
#endif

// Whether M bf16 rows over K inputs in groups of `group` run on tiles.
inline bool take(int64_t M, int64_t K, int64_t group) {
  const int64_t least = min_rows().load(std::memory_order_relaxed);
  return kBuild && least > 0 && M >= least && K % 32 == 0 && group % 32 == 0 && permitted();
}

// Sets the fewest rows when `rows` >= 0 and returns the setting before; -1 where this build or
// this process cannot use the tiles.
inline int64_t set_min_rows(int64_t rows) {
  if (!kBuild || !permitted()) return -1;
  return rows >= 0 ? min_rows().exchange(rows) : min_rows().load();
}

// The rows' float32 sums of one block, masked to its `cols` valid columns, into y.
inline void store_rows(const float (&out)[kRows][kCols], int64_t rows, int64_t cols, float* y,
                       int64_t ldy) {
  for (int64_t r = 0; r < rows; ++r) std::copy(out[r], out[r] + cols, y + r * ldy);
}

}  // namespace amx_tiles
