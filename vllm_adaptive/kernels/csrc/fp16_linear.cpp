// Linear layers over float16 weights with float32 activations, for the few rows of a decode or
// verification step.
//
// At one to eight rows a decode step's linear is a stream of its weights: FBGEMM's fp16 GEMM
// reaches 9.3 GB/s on one Ice Lake core at one row with the weights out of cache and slows
// down as rows are added (1.2x at 4 rows, 1.3x at 8), because its blocking does not keep enough
// loads in flight while it multiplies. Here a block of 32 output columns is stored as K
// consecutive 64-byte lines (layout [N/32][K][32]), read front to back once for up to 8 rows
// (AVX512; 2 on AVX2, whose 16 registers hold fewer accumulators: the block is re-read from L2
// for the next rows), with a software prefetch 4 KiB ahead, in memory the kernel allocates on
// 2 MiB pages (fewer TLB misses on a 270 MB stream).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <optional>

#include "blocked_weight.h"
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

using blocked_weight::kCols;           // one 64-byte line per k
constexpr int64_t kPrefetch = 2048;  // elements ahead (4 KiB, 64 lines)

#if defined(__AVX512F__)
constexpr int kRows = 8;  // 16 accumulators of 16 lanes
#else
constexpr int kRows = 2;  // 8 accumulators of 8 lanes
#endif

#if defined(__F16C__) && defined(__FMA__)
constexpr bool kSupported = true;
#else
constexpr bool kSupported = false;
#endif

#if defined(__AVX512F__)
template <int R>
void block(const float* x, int64_t ldx, int64_t K, const uint16_t* w, float* y, int64_t ldy,
           int64_t cols) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k, w += kCols) {
    _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetch), _MM_HINT_T0);
    const __m512 w0 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
    const __m512 w1 =
        _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16)));
    for (int r = 0; r < R; ++r) {
      const __m512 xr = _mm512_set1_ps(x[r * ldx + k]);
      acc[r][0] = _mm512_fmadd_ps(xr, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xr, w1, acc[r][1]);
    }
  }
  const __mmask16 m0 = cols >= 16 ? 0xFFFF : (__mmask16)((1u << cols) - 1);
  const __mmask16 m1 = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : (__mmask16)((1u << (cols - 16)) - 1);
  for (int r = 0; r < R; ++r) {
    _mm512_mask_storeu_ps(y + r * ldy, m0, acc[r][0]);
    _mm512_mask_storeu_ps(y + r * ldy + 16, m1, acc[r][1]);
  }
}
#elif defined(__F16C__) && defined(__FMA__)
template <int R>
void block(const float* x, int64_t ldx, int64_t K, const uint16_t* w, float* y, int64_t ldy,
           int64_t cols) {
  __m256 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k, w += kCols) {
    _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetch), _MM_HINT_T0);
    __m256 wj[4];
    for (int j = 0; j < 4; ++j)
      wj[j] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 8 * j)));
    for (int r = 0; r < R; ++r) {
      const __m256 xr = _mm256_set1_ps(x[r * ldx + k]);
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_fmadd_ps(xr, wj[j], acc[r][j]);
    }
  }
  alignas(32) float tmp[kCols];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 4; ++j) _mm256_store_ps(tmp + 8 * j, acc[r][j]);
    std::copy(tmp, tmp + cols, y + r * ldy);
  }
}
#endif

template <int R>
void rows_of_block(const float* x, int64_t ldx, int64_t K, const uint16_t* w, float* y,
                   int64_t ldy, int64_t cols, int64_t rows) {
#if defined(__F16C__) && defined(__FMA__)
  if constexpr (R > 1) {
    if (rows < R) return rows_of_block<R - 1>(x, ldx, K, w, y, ldy, cols, rows);
  }
  block<R>(x, ldx, K, w, y, ldy, cols);
#endif
}

at::Tensor fp16_pack(const at::Tensor& weight) {
  TORCH_CHECK(kSupported, "fp16_pack: this build has no F16C / FMA (built without them)");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kHalf,
              "fp16_pack: the weight must be a 2-D float16 tensor, got ", weight.scalar_type(),
              " with ", weight.dim(), " dims");
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t blocks = (N + kCols - 1) / kCols;
  at::Tensor packed = blocked_weight::on_huge_pages({blocks, K, kCols}, at::kShort, "fp16_pack");
  auto* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<int16_t>());
  const auto* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::Half>());
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      uint16_t* out = dst + b * K * kCols;
      for (int64_t j = 0; j < kCols; ++j) {
        const int64_t n = b * kCols + j;
        const uint16_t* row = src + n * K;
        for (int64_t k = 0; k < K; ++k) out[k * kCols + j] = n < N ? row[k] : 0;
      }
    }
  });
  return packed;
}

at::Tensor fp16_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features) {
  TORCH_CHECK(kSupported, "fp16_linear: this build has no F16C / FMA (built without them)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "fp16_linear: x must be a contiguous 2-D float32 tensor");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kShort &&
                  packed.size(2) == kCols && packed.is_contiguous(),
              "fp16_linear: packed must come from fp16_pack");
  const int64_t M = x.size(0), K = x.size(1), blocks = packed.size(0);
  TORCH_CHECK(packed.size(1) == K, "fp16_linear: x has ", K, " features, the weight ",
              packed.size(1));
  blocked_weight::check_out_features("fp16_linear", out_features, blocks);
  at::Tensor y = at::empty({M, out_features}, x.options());
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<int16_t>());
  // blocks in order (one stream of the weight); rows in groups the registers hold
  blocked_weight::for_each_tile(blocks, M, kRows, out_features, [&](int64_t b, int64_t cols,
                                                                   int64_t r, int64_t rows) {
    rows_of_block<kRows>(xp + r * K, K, K, wp + b * K * kCols, yp + r * out_features + b * kCols,
                         out_features, cols, rows);
  });
  return y;
}

// The fp16 gear's linear as a compiled graph calls it: the step's kernel chosen here, without a
// Python frame, while every row of the step runs the fp16 gear (`uniform[0] != 0`, set by the
// precision controller); otherwise the plugin's Python op, which groups the rows by gear.
// `native_rows[min(M, len - 1)] != 0` picks the native kernel for M rows, else FBGEMM's
// (`fbgemm`: its packed weight; absent where dispatch never picks it): the measured dispatch
// table, flattened by the Python side.
at::Tensor geared_fp16_linear(const at::Tensor& x, const at::Tensor& packed,
                              const std::optional<at::Tensor>& fbgemm,
                              const at::Tensor& native_rows, const at::Tensor& uniform,
                              int64_t index, int64_t out_features) {
  if (uniform.data_ptr<uint8_t>()[0] != 0 && x.dim() == 2 && x.scalar_type() == at::kFloat) {
    const at::Tensor xc = x.is_contiguous() ? x : x.contiguous();
    const int64_t last = native_rows.numel() - 1;
    if (native_rows.data_ptr<uint8_t>()[std::min(xc.size(0), last)] != 0)
      return fp16_linear(xc, packed, out_features);
    if (fbgemm.has_value()) {
      static const auto fbgemm_op =
          c10::Dispatcher::singleton()
              .findSchemaOrThrow("_quantized::wrapped_fbgemm_linear_fp16_weight", "")
              .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                int64_t)>();
      return fbgemm_op.call(xc, *fbgemm, at::Tensor(), out_features);  // no bias
    }
  }
  return blocked_weight::python_geared_linear(x, index, out_features);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_adaptive_native, m) {
  m.def("fp16_pack(Tensor weight) -> Tensor");
  m.def("fp16_linear(Tensor x, Tensor packed, int out_features) -> Tensor");
  m.def(
      "geared_fp16_linear(Tensor x, Tensor packed, Tensor? fbgemm, Tensor native_rows, "
      "Tensor uniform, int index, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_adaptive_native, CPU, m) {
  m.impl("fp16_pack", &fp16_pack);
  m.impl("fp16_linear", &fp16_linear);
  m.impl("geared_fp16_linear", &geared_fp16_linear);
}
