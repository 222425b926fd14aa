// What the plugin's linears over blocked weights share (fp16_linear.cpp, int8_linear.cpp,
// int4_linear.cpp): blocks of 32 output columns, each stored as K consecutive rows so that a
// step reads the weight front to back once, and the packed weight on 2 MiB pages.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>

namespace blocked_weight {

constexpr int64_t kCols = 32;  // output columns per block
constexpr size_t kPage = size_t(2) << 20;

// An uninitialised tensor on 2 MiB pages, freed with the tensor: a weight streamed every step
// on 4 KiB pages touches one page (and a TLB miss) every 4 KiB.
inline at::Tensor on_huge_pages(at::IntArrayRef sizes, at::ScalarType dtype, const char* who) {
  int64_t numel = 1;
  for (const int64_t s : sizes) numel *= s;
  const size_t bytes = size_t(numel) * at::elementSize(dtype);
  const size_t alloc = std::max(kPage, (bytes + kPage - 1) / kPage * kPage);
  void* mem = std::aligned_alloc(kPage, alloc);
  TORCH_CHECK(mem != nullptr, who, ": could not allocate ", alloc, " bytes");
  madvise(mem, alloc, MADV_HUGEPAGE);  // a hint: without transparent huge pages it does nothing
  return at::from_blob(
      mem, sizes, [](void* p) { std::free(p); }, at::TensorOptions().dtype(dtype));
}

inline void check_out_features(const char* who, int64_t out_features, int64_t blocks) {
  TORCH_CHECK(out_features > (blocks - 1) * kCols && out_features <= blocks * kCols, who,
              ": out_features ", out_features, " does not match ", blocks, " blocks of ", kCols);
}

// Every tile of an [M, out_features] product over blocked weights: fn(b, cols, r, rows) for
// column block b (its `cols` valid columns) and rows r .. r + rows (at most `tile`), the blocks
// spread over threads so that each thread streams its own part of the weight once.
template <typename Fn>
inline void for_each_tile(int64_t blocks, int64_t M, int64_t tile, int64_t out_features,
                          const Fn& fn) {
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t cols = std::min(kCols, out_features - b * kCols);
      for (int64_t r = 0; r < M; r += tile) fn(b, cols, r, std::min(tile, M - r));
    }
  });
}

// A geared op's row-table entry (`native_rows[min(M, len - 1)]`) for x's M rows while every row
// of the step runs the op's gear (`uniform[0] != 0`) and x is 2-D float32 or bf16; -1 otherwise,
// where the plugin's Python op serves the call.
inline int routed_row_code(const at::Tensor& x, const at::Tensor& native_rows,
                           const at::Tensor& uniform) {
  const auto dtype = x.scalar_type();
  if (uniform.data_ptr<uint8_t>()[0] == 0 || x.dim() != 2 ||
      (dtype != at::kFloat && dtype != at::kBFloat16))
    return -1;
  const int64_t last = native_rows.numel() - 1;
  return native_rows.data_ptr<uint8_t>()[std::min(x.size(0), last)];
}

// The plugin's Python op (``vllm_adaptive::geared_linear``), which groups a step's rows by gear:
// where a geared op's C++ fast path does not serve the call.
inline at::Tensor python_geared_linear(const at::Tensor& x, int64_t index, int64_t out_features) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("vllm_adaptive::geared_linear", "")
                             .typed<at::Tensor(const at::Tensor&, int64_t, int64_t)>();
  return op.call(x, index, out_features);
}

}  // namespace blocked_weight
