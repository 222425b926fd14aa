// Linear layers over int8 weights (a float32 scale per output column and group of K) with
// float32 activations, for the few rows of a decode or verification step: weight-only int8,
// so the product carries the weight's rounding alone, at half the bytes of float16.
//
// A decode step's linears stream their weights from memory (fp16_linear.cpp): at one row the
// time is the bytes. The layout and the loop are fp16_linear's: a block of 32 output columns
// stored as K consecutive 32-byte rows ([N/32][K][32] int8), read once for up to 8 rows
// (AVX512; 2 on AVX2), a software prefetch 4 KiB ahead, the packed codes on 2 MiB pages. Each
// 16 codes become float32 with one sign extension and one conversion; with one scale per
// column the accumulators are scaled once at the end, with groups of K once per group (AVX512;
// per code on AVX2, whose 16 registers hold no second set of sums). bf16 rows run a vdpbf16ps
// loop over the same layout where the CPU has AVX512-BF16, and from a few rows on AMX tiles
// where it has AMX-BF16 (amx_tiles.h).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <tuple>

#include "amx_tiles.h"
#include "blocked_weight.h"
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

using blocked_weight::kCols;           // one 32-byte row per k
constexpr int64_t kPrefetch = 4096;  // bytes ahead

#if defined(__AVX512F__)
constexpr int kRows = 8;
#else
constexpr int kRows = 2;
#endif

#if defined(__AVX2__) && defined(__FMA__)
constexpr bool kSupported = true;
#else
constexpr bool kSupported = false;
#endif

// y[r, 0:cols] = sum_k x[r, k] * codes[k, :] * scales[k / group, :] for one block
#if defined(__AVX512F__)
// A chunk's sums into the block's output: times the group's scales (sg), or as they are with
// one scale per column (applied by store_block).
template <int R, bool Grouped>
inline void add_chunk(const __m512 (&acc)[R][2], float (&out)[R][kCols], const float* sg) {
  for (int r = 0; r < R; ++r) {
    const __m512 o0 = _mm512_load_ps(out[r]), o1 = _mm512_load_ps(out[r] + 16);
    if constexpr (Grouped) {
      _mm512_store_ps(out[r], _mm512_fmadd_ps(acc[r][0], _mm512_loadu_ps(sg), o0));
      _mm512_store_ps(out[r] + 16, _mm512_fmadd_ps(acc[r][1], _mm512_loadu_ps(sg + 16), o1));
    } else {
      _mm512_store_ps(out[r], _mm512_add_ps(acc[r][0], o0));
      _mm512_store_ps(out[r] + 16, _mm512_add_ps(acc[r][1], o1));
    }
  }
}

// The block's first `cols` columns of each row to y, times the per-column scales (s) where
// there is one scale per column.
template <int R, bool Grouped>
inline void store_block(const float (&out)[R][kCols], const float* s, float* y, int64_t ldy,
                        int64_t cols) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 s0 = Grouped ? one : _mm512_loadu_ps(s), s1 = Grouped ? one : _mm512_loadu_ps(s + 16);
  const __mmask16 m0 = cols >= 16 ? 0xFFFF : (__mmask16)((1u << cols) - 1);
  const __mmask16 m1 = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : (__mmask16)((1u << (cols - 16)) - 1);
  for (int r = 0; r < R; ++r) {
    _mm512_mask_storeu_ps(y + r * ldy, m0, _mm512_mul_ps(_mm512_load_ps(out[r]), s0));
    _mm512_mask_storeu_ps(y + r * ldy + 16, m1, _mm512_mul_ps(_mm512_load_ps(out[r] + 16), s1));
  }
}

inline __m512 codes16(const int8_t* w) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
}

template <int R, bool Grouped>
void block(const float* x, int64_t ldx, int64_t K, int64_t group, const int8_t* w,
           const float* s, int64_t lds, float* y, int64_t ldy, int64_t cols) {
  // The codes are summed against x alone over a chunk of K (a group, or 32 inputs with one
  // scale per column) and each chunk's sums added into the output (times the group's scale):
  // one multiply per row and 16 columns per group instead of one per 16 codes, which bounds
  // the loop at 8 rows, and chunks whose sums start afresh, so that at one row the FMAs of
  // consecutive chunks overlap instead of waiting on one chain across K.
  const int64_t chunk = Grouped ? group : 32;
  alignas(64) float out[R][kCols] = {};  // in memory: 8 rows' sums fill the 32 registers
  for (int64_t k0 = 0; k0 < K; k0 += chunk) {
    __m512 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const int64_t k1 = std::min(K, k0 + chunk);
    for (int64_t k = k0; k < k1; ++k, w += kCols) {
      _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetch), _MM_HINT_T0);
      const __m512 w0 = codes16(w), w1 = codes16(w + 16);
      for (int r = 0; r < R; ++r) {
        const __m512 xr = _mm512_set1_ps(x[r * ldx + k]);
        acc[r][0] = _mm512_fmadd_ps(xr, w0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(xr, w1, acc[r][1]);
      }
    }
    add_chunk<R, Grouped>(acc, out, s + (k0 / group) * lds);
  }
  store_block<R, Grouped>(out, s, y, ldy, cols);
}
#elif defined(__AVX2__) && defined(__FMA__)
template <int R, bool Grouped>
void block(const float* x, int64_t ldx, int64_t K, int64_t group, const int8_t* w,
           const float* s, int64_t lds, float* y, int64_t ldy, int64_t cols) {
  __m256 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t k0 = 0; k0 < K; k0 += group) {
    const float* sg = s + (k0 / group) * lds;
    for (int64_t k = k0; k < k0 + group; ++k, w += kCols) {
      _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetch), _MM_HINT_T0);
      __m256 wj[4];
      for (int j = 0; j < 4; ++j) {
        wj[j] = _mm256_cvtepi32_ps(
            _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + 8 * j))));
        if constexpr (Grouped) wj[j] = _mm256_mul_ps(wj[j], _mm256_loadu_ps(sg + 8 * j));
      }
      for (int r = 0; r < R; ++r) {
        const __m256 xr = _mm256_set1_ps(x[r * ldx + k]);
        for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_fmadd_ps(xr, wj[j], acc[r][j]);
      }
    }
  }
  alignas(32) float tmp[kCols];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 4; ++j)
      _mm256_store_ps(tmp + 8 * j,
                      Grouped ? acc[r][j] : _mm256_mul_ps(acc[r][j], _mm256_loadu_ps(s + 8 * j)));
    std::copy(tmp, tmp + cols, y + r * ldy);
  }
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
constexpr bool kBf16Dot = true;
// bf16 rows on CPUs with AVX512-BF16: two k at a time, the codes of column j at k and k + 1 as
// one bf16 pair per 32-bit lane (int8 values are exact in bf16), multiplied with the rows'
// (x_k, x_k+1) pairs by vdpbf16ps: 32 products an instruction where the float32 loop's FMA does
// 16, which is what bounds that loop from about 4 rows on. The pairs are made from the blocked
// layout as it is: bytes of k and k + 1 interleaved, widened to int32, converted to float32 and
// packed to bf16 two registers at a time. Products of bf16 values are exact in float32 and the
// sums float32, as in the float32 loop over bf16 rows cast up; scales as there.
inline __m512 pairs8(__m128i a, __m128i b, bool high) {
  // columns 0-7 (or 8-15) of a 16-column half: a_j b_j pairs as 16 float32
  const __m128i ab = high ? _mm_unpackhi_epi8(a, b) : _mm_unpacklo_epi8(a, b);
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(ab));
}

inline __m512bh pairs16(const int8_t* w, int half) {
  // column pairs (k, k + 1) of columns 16 * half .. 16 * half + 15 as 16 bf16 pairs
  const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16 * half));
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + kCols + 16 * half));
  return _mm512_cvtne2ps_pbh(pairs8(a, b, true), pairs8(a, b, false));
}

template <int R, bool Grouped>
void block_bf16(const uint16_t* x, int64_t ldx, int64_t K, int64_t group, const int8_t* w,
                const float* s, int64_t lds, float* y, int64_t ldy, int64_t cols) {
  const int64_t chunk = Grouped ? group : 32;  // even (checked by the caller), as is K
  alignas(64) float out[R][kCols] = {};
  for (int64_t k0 = 0; k0 < K; k0 += chunk) {
    __m512 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const int64_t k1 = std::min(K, k0 + chunk);
    for (int64_t k = k0; k < k1; k += 2, w += 2 * kCols) {
      _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetch), _MM_HINT_T0);
      const __m512bh w0 = pairs16(w, 0), w1 = pairs16(w, 1);
      for (int r = 0; r < R; ++r) {
        uint32_t pair;
        std::memcpy(&pair, x + r * ldx + k, sizeof pair);
        const __m512bh xr = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xr, w0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xr, w1);
      }
    }
    add_chunk<R, Grouped>(acc, out, s + (k0 / group) * lds);
  }
  store_block<R, Grouped>(out, s, y, ldy, cols);
}

template <int R>
void rows_of_block_bf16(const uint16_t* x, int64_t ldx, int64_t K, int64_t group,
                        const int8_t* w, const float* s, int64_t lds, float* y, int64_t ldy,
                        int64_t cols, int64_t rows) {
  if constexpr (R > 1) {
    if (rows < R)
      return rows_of_block_bf16<R - 1>(x, ldx, K, group, w, s, lds, y, ldy, cols, rows);
  }
  if (group == K)
    block_bf16<R, false>(x, ldx, K, group, w, s, lds, y, ldy, cols);
  else
    block_bf16<R, true>(x, ldx, K, group, w, s, lds, y, ldy, cols);
}
#else
constexpr bool kBf16Dot = false;
#endif

#if defined(ADAPTIVE_AMX_TILES)
// bf16 rows [M, K] -> float32 [M, out_features] on AMX tiles (amx_tiles::take checked)
at::Tensor int8_linear_amx(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                           int64_t out_features) {
  const int64_t M = x.size(0), K = x.size(1), blocks = packed.size(0);
  at::Tensor y = at::empty({M, out_features}, x.options().dtype(at::kFloat));
  const int64_t group = K / scales.size(0), lds = blocks * kCols;
  const bool grouped = group != K;
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int8_t* wp = packed.data_ptr<int8_t>();
  amx_tiles::for_each_block(x, blocks, out_features, [&](const uint16_t* xs, int64_t b,
                                                         int64_t cols, int64_t r, int64_t rows) {
    const int8_t* w = wp + b * K * kCols;
    const float* s = sp + b * kCols;
    alignas(64) float out[amx_tiles::kRows][kCols];
    auto pairs = [&](int64_t k, uint16_t* b0, uint16_t* b1) {
      const int8_t* wk = w + k * kCols;
      for (int p = 0; p < 16; ++p, wk += 2 * kCols) {
        _mm_prefetch(reinterpret_cast<const char*>(wk + kPrefetch), _MM_HINT_T0);
        _mm512_store_si512(b0 + 32 * p, (__m512i)pairs16(wk, 0));
        _mm512_store_si512(b1 + 32 * p, (__m512i)pairs16(wk, 1));
      }
    };
    // each group's sums times its scales, or (one scale per column: one group) the sums scaled
    auto epilogue = [&](int64_t g, const float (&c)[amx_tiles::kRows][kCols]) {
      const float* sg = s + g * lds;
      const __m512 s0 = _mm512_loadu_ps(sg), s1 = _mm512_loadu_ps(sg + 16);
      for (int64_t i = 0; i < rows; ++i) {
        const __m512 o0 = grouped && g > 0 ? _mm512_load_ps(out[i]) : _mm512_setzero_ps();
        const __m512 o1 = grouped && g > 0 ? _mm512_load_ps(out[i] + 16) : _mm512_setzero_ps();
        _mm512_store_ps(out[i], _mm512_fmadd_ps(_mm512_load_ps(c[i]), s0, o0));
        _mm512_store_ps(out[i] + 16, _mm512_fmadd_ps(_mm512_load_ps(c[i] + 16), s1, o1));
      }
    };
    amx_tiles::block_rows(xs, rows, K, group, pairs, epilogue);
    amx_tiles::store_rows(out, rows, cols, yp + r * out_features + b * kCols, out_features);
  });
  return y;
}
#else
at::Tensor int8_linear_amx(const at::Tensor& x, const at::Tensor&, const at::Tensor&, int64_t) {
  TORCH_CHECK(false, "int8_linear: this build has no AMX-BF16");
  return x;
}
#endif

// Sets the fewest bf16 rows the library's low-bit kernels run on AMX tiles (amx_tiles.h) when
// `rows` >= 0 and returns the setting before; -1 where this build or process has no tiles.
int64_t amx_rows(int64_t rows) { return amx_tiles::set_min_rows(rows); }

template <int R>
void rows_of_block(const float* x, int64_t ldx, int64_t K, int64_t group, const int8_t* w,
                   const float* s, int64_t lds, float* y, int64_t ldy, int64_t cols,
                   int64_t rows) {
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (R > 1) {
    if (rows < R) return rows_of_block<R - 1>(x, ldx, K, group, w, s, lds, y, ldy, cols, rows);
  }
  if (group == K)
    block<R, false>(x, ldx, K, group, w, s, lds, y, ldy, cols);
  else
    block<R, true>(x, ldx, K, group, w, s, lds, y, ldy, cols);
#endif
}

// codes [N, K] int8 and scales [N] (one per output column) or [G, N] (G groups of K / G
// inputs) -> (codes as [N/32][K][32] on 2 MiB pages, scales as [G, N/32 * 32], zero-padded)
std::tuple<at::Tensor, at::Tensor> int8_pack(const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK(kSupported, "int8_pack: this build has no AVX2 / FMA (built without them)");
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar,
              "int8_pack: the codes must be a 2-D int8 tensor, got ", codes.scalar_type(),
              " with ", codes.dim(), " dims");
  const at::Tensor c = codes.contiguous();
  const int64_t N = c.size(0), K = c.size(1);
  const at::Tensor s2 = scales.dim() == 1 ? scales.reshape({1, -1}) : scales;
  TORCH_CHECK(s2.dim() == 2 && s2.scalar_type() == at::kFloat && s2.size(1) == N,
              "int8_pack: scales must be float32 [N] or [G, N] with N = ", N, ", got ",
              scales.sizes());
  const int64_t G = s2.size(0);
  TORCH_CHECK(G >= 1 && K % G == 0, "int8_pack: ", G, " scale groups do not divide K = ", K);
  const int64_t blocks = (N + kCols - 1) / kCols;
  at::Tensor packed = blocked_weight::on_huge_pages({blocks, K, kCols}, at::kChar, "int8_pack");
  int8_t* dst = packed.data_ptr<int8_t>();
  const int8_t* src = c.data_ptr<int8_t>();
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      int8_t* out = dst + b * K * kCols;
      for (int64_t j = 0; j < kCols; ++j) {
        const int64_t n = b * kCols + j;
        const int8_t* row = src + n * K;
        for (int64_t k = 0; k < K; ++k) out[k * kCols + j] = n < N ? row[k] : 0;
      }
    }
  });
  at::Tensor padded = at::zeros({G, blocks * kCols}, s2.options());
  padded.narrow(1, 0, N).copy_(s2);
  return {packed, padded};
}

// bf16 rows [M, K] (checked by int8_linear) -> float32 [M, out_features] on the vdpbf16ps loop
at::Tensor int8_linear_bf16(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                            int64_t out_features) {
  const int64_t M = x.size(0), K = x.size(1), blocks = packed.size(0);
  at::Tensor y = at::empty({M, out_features}, x.options().dtype(at::kFloat));
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if (M == 0) return y;
  const int64_t group = K / scales.size(0), lds = blocks * kCols;
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int8_t* wp = packed.data_ptr<int8_t>();
  blocked_weight::for_each_tile(blocks, M, kRows, out_features, [&](int64_t b, int64_t cols,
                                                                   int64_t r, int64_t rows) {
    rows_of_block_bf16<kRows>(xp + r * K, K, K, group, wp + b * K * kCols, sp + b * kCols, lds,
                              yp + r * out_features + b * kCols, out_features, cols, rows);
  });
#endif
  return y;
}

// x [M, K] float32, or bfloat16 (float32 out: on the vdpbf16ps loop where the CPU has one and
// the chunks of K are even, else cast to float32)
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       int64_t out_features) {
  TORCH_CHECK(kSupported, "int8_linear: this build has no AVX2 / FMA (built without them)");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "int8_linear: x must be a contiguous 2-D float32 or bfloat16 tensor");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kChar &&
                  packed.size(2) == kCols && packed.is_contiguous(),
              "int8_linear: packed must come from int8_pack");
  const int64_t M = x.size(0), K = x.size(1), blocks = packed.size(0);
  TORCH_CHECK(packed.size(1) == K, "int8_linear: x has ", K, " features, the weight ",
              packed.size(1));
  blocked_weight::check_out_features("int8_linear", out_features, blocks);
  TORCH_CHECK(scales.dim() == 2 && scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.size(1) == blocks * kCols && scales.size(0) >= 1 &&
                  K % scales.size(0) == 0,
              "int8_linear: scales must come from int8_pack with the codes");
  const int64_t group = K / scales.size(0), lds = blocks * kCols;
  if (x.scalar_type() == at::kBFloat16) {
    // chunks of K are the groups, or 32 inputs (the last one K's remainder) with per-column scales
    const bool even = group == K ? K % 2 == 0 : group % 2 == 0;
    if (amx_tiles::take(M, K, group)) return int8_linear_amx(x, packed, scales, out_features);
    // one row: the float32 loop's fewer conversions per code measure 1-7% faster
    if (kBf16Dot && even && M > 1) return int8_linear_bf16(x, packed, scales, out_features);
    return int8_linear(x.to(at::kFloat), packed, scales, out_features);
  }
  at::Tensor y = at::empty({M, out_features}, x.options());
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int8_t* wp = packed.data_ptr<int8_t>();
  blocked_weight::for_each_tile(blocks, M, kRows, out_features, [&](int64_t b, int64_t cols,
                                                                   int64_t r, int64_t rows) {
    rows_of_block<kRows>(xp + r * K, K, K, group, wp + b * K * kCols, sp + b * kCols, lds,
                         yp + r * out_features + b * kCols, out_features, cols, rows);
  });
  return y;
}

// The int8 gear's linear as a compiled graph calls it (int4_linear.cpp's geared op, for int8
// codes): while every row of the step runs the int8 gear (`uniform[0] != 0`),
// `native_rows[min(M, len - 1)]` == 1 runs int8_linear here (bf16 rows on its vdpbf16ps loop
// where the CPU has one); otherwise, and for rows that run the layer's own weight (2), the
// plugin's Python op.
at::Tensor geared_int8_linear(const at::Tensor& x, const at::Tensor& packed,
                              const at::Tensor& scales, const at::Tensor& native_rows,
                              const at::Tensor& uniform, int64_t index, int64_t out_features) {
  if (blocked_weight::routed_row_code(x, native_rows, uniform) == 1)  // float32 out
    return int8_linear(x.scalar_type() == at::kBFloat16 ? x.contiguous() : x.to(at::kFloat).contiguous(),
                       packed, scales, out_features)
        .to(x.scalar_type());
  return blocked_weight::python_geared_linear(x, index, out_features);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_adaptive_native, m) {
  m.def("int8_pack(Tensor codes, Tensor scales) -> (Tensor, Tensor)");
  m.def("int8_linear(Tensor x, Tensor packed, Tensor scales, int out_features) -> Tensor");
  m.def("amx_rows(int rows) -> int", &amx_rows);  // no tensors: one kernel for every backend
  m.def(
      "geared_int8_linear(Tensor x, Tensor packed, Tensor scales, Tensor native_rows, "
      "Tensor uniform, int index, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_adaptive_native, CPU, m) {
  m.impl("int8_pack", &int8_pack);
  m.impl("int8_linear", &int8_linear);
  m.impl("geared_int8_linear", &geared_int8_linear);
}
