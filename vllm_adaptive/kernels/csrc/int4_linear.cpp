// Linear layers over 4-bit weights in groups of K (a float32 scale and offset per output column
// and group: w = c * scale + offset, c in [-8, 7]) with float32 activations.
//
// The default model's checkpoint comes from a Q4_1 GGUF: its weights already lie on a 4-bit
// asymmetric grid of 32-input groups, which this format holds with no further loss, in 0.75
// bytes a weight (codes 0.5, scale and offset 0.25) where float16 takes 2. At a few rows a step
// is a stream of the weights (fp16_linear.cpp); the layout and loop are the same: a block of 32
// output columns is K consecutive 16-byte rows ([N/32][K][16], byte j holding column j in its
// low nibble and column j + 16 in its high one, as u = c + 8), read once for up to 8 rows
// (AVX512; 2 on AVX2) with a prefetch 4 KiB ahead, on 2 MiB pages. The block is L1-sized, so
// prefill rows re-read it from cache: unlike torch's int4 kernels in float32 (6-55x slower than
// in bf16) or dequantizing the weight each call, this is also the fastest 4-bit path at a
// prompt's rows (measured to 512; docs/float32-kernels.md).
//
// Per code the AVX512 loop does only what the rows need: the nibbles widened, the high ones
// shifted, each 16 turned to float32 by a table lookup (vpermps reads the low 4 bits of each
// index) and multiplied into the rows' sums of x * u; the group's scale and offset are applied
// once per group (y += scale * sum(x u) + offset' * sum(x), offset' = offset - 8 scale). At one
// row that reads the weights at the memory's rate (1.37x the per-code scale-and-offset loop).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

#include "amx_tiles.h"
#include "blocked_weight.h"
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

using blocked_weight::kCols;
constexpr int64_t kBytes = 16;       // bytes per k of a block: two codes a byte
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

// y[r, 0:cols] = sum_k x[r, k] * (u[k, :] * scale[k / group, :] + offset'[k / group, :]) for one
// block, u = c + 8 the stored nibble and offset' = offset - 8 * scale (folded at packing)
#if defined(__AVX512F__)
// Per group the raw codes u (0..15) are summed against x alone (A = sum_k x_k u_k, two
// accumulator sets when the row count leaves registers for them), and the group's scale and
// offset applied once: y += A * scale + X_g * offset', X_g = sum of the group's x (xsum).
// A nibble becomes float32 by a table lookup (vpermps reads the low 4 bits of each index).
template <int R>
void block(const float* x, int64_t ldx, const float* xsum, int64_t G, int64_t K, int64_t group,
           const uint8_t* w, const float* s, const float* o, int64_t lds, float* y, int64_t ldy,
           int64_t cols) {
  constexpr int U = R <= 4 ? 2 : 1;
  const __m512 lut = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  alignas(64) float out[R][kCols] = {};
  for (int64_t g = 0; g < G; ++g) {
    __m512 acc[U][R][2];
    for (int u = 0; u < U; ++u)
      for (int r = 0; r < R; ++r) acc[u][r][0] = acc[u][r][1] = _mm512_setzero_ps();
    const int64_t k0 = g * group;
    int64_t k = k0;
    for (; k + U <= k0 + group; k += U) {
      _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetch), _MM_HINT_T0);
      for (int u = 0; u < U; ++u, w += kBytes) {
        const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
        const __m512 w0 = _mm512_permutexvar_ps(q, lut);
        const __m512 w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), lut);
        for (int r = 0; r < R; ++r) {
          const __m512 xr = _mm512_set1_ps(x[r * ldx + k + u]);
          acc[u][r][0] = _mm512_fmadd_ps(xr, w0, acc[u][r][0]);
          acc[u][r][1] = _mm512_fmadd_ps(xr, w1, acc[u][r][1]);
        }
      }
    }
    for (; k < k0 + group; ++k, w += kBytes) {  // an odd group's last k
      const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
      const __m512 w0 = _mm512_permutexvar_ps(q, lut);
      const __m512 w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), lut);
      for (int r = 0; r < R; ++r) {
        const __m512 xr = _mm512_set1_ps(x[r * ldx + k]);
        acc[0][r][0] = _mm512_fmadd_ps(xr, w0, acc[0][r][0]);
        acc[0][r][1] = _mm512_fmadd_ps(xr, w1, acc[0][r][1]);
      }
    }
    const __m512 s0 = _mm512_loadu_ps(s + g * lds), s1 = _mm512_loadu_ps(s + g * lds + 16);
    const __m512 o0 = _mm512_loadu_ps(o + g * lds), o1 = _mm512_loadu_ps(o + g * lds + 16);
    for (int r = 0; r < R; ++r) {
      __m512 a0 = acc[0][r][0], a1 = acc[0][r][1];
      if constexpr (U == 2) {
        a0 = _mm512_add_ps(a0, acc[1][r][0]);
        a1 = _mm512_add_ps(a1, acc[1][r][1]);
      }
      const __m512 xs = _mm512_set1_ps(xsum[r * G + g]);
      _mm512_store_ps(out[r], _mm512_fmadd_ps(a0, s0, _mm512_fmadd_ps(xs, o0, _mm512_load_ps(out[r]))));
      _mm512_store_ps(out[r] + 16,
                      _mm512_fmadd_ps(a1, s1, _mm512_fmadd_ps(xs, o1, _mm512_load_ps(out[r] + 16))));
    }
  }
  const __mmask16 m0 = cols >= 16 ? 0xFFFF : (__mmask16)((1u << cols) - 1);
  const __mmask16 m1 = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : (__mmask16)((1u << (cols - 16)) - 1);
  for (int r = 0; r < R; ++r) {
    _mm512_mask_storeu_ps(y + r * ldy, m0, _mm512_load_ps(out[r]));
    _mm512_mask_storeu_ps(y + r * ldy + 16, m1, _mm512_load_ps(out[r] + 16));
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
template <int R>
void block(const float* x, int64_t ldx, const float*, int64_t, int64_t K, int64_t group,
           const uint8_t* w, const float* s, const float* o, int64_t lds, float* y, int64_t ldy,
           int64_t cols) {
  __m256 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_setzero_ps();
  const __m256i nibble = _mm256_set1_epi32(0xF);
  for (int64_t k0 = 0; k0 < K; k0 += group) {
    const int64_t at = (k0 / group) * lds;
    for (int64_t k = k0; k < k0 + group; ++k, w += kBytes) {
      _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetch), _MM_HINT_T0);
      const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w)));
      const __m256i b =
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + 8)));
      // columns 0-7, 8-15 (low nibbles), 16-23, 24-31 (high nibbles)
      const __m256i u[4] = {_mm256_and_si256(a, nibble), _mm256_and_si256(b, nibble),
                            _mm256_srli_epi32(a, 4), _mm256_srli_epi32(b, 4)};
      __m256 wj[4];
      for (int j = 0; j < 4; ++j)
        wj[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(u[j]), _mm256_loadu_ps(s + at + 8 * j),
                                _mm256_loadu_ps(o + at + 8 * j));
      for (int r = 0; r < R; ++r) {
        const __m256 xr = _mm256_set1_ps(x[r * ldx + k]);
        for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_fmadd_ps(xr, wj[j], acc[r][j]);
      }
    }
  }
  alignas(32) float tmp[kCols];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 4; ++j) _mm256_store_ps(tmp + 8 * j, acc[r][j]);
    std::copy(tmp, tmp + cols, y + r * ldy);
  }
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
constexpr bool kBf16Dot = true;
// bf16 rows on CPUs with AVX512-BF16: two k at a time, the raw codes u of columns j at k and
// k + 1 as one bf16 pair per 32-bit lane (a table lookup of 0..15, exact in bf16), multiplied
// with the rows' (x_k, x_k+1) pairs by vdpbf16ps: 32 products an instruction against 16 for the
// float32 FMA loop, which is what bounds that loop from about 4 rows on (the 4-bit weights
// stream in a third of bf16's time). Products of bf16 values are exact in float32 and sums are
// float32, as in the float32 loop over bf16 rows cast up; the group's scale and offset as there.
inline __m512i bf16_of_nibbles() {
  alignas(64) uint16_t words[32];
  for (int i = 0; i < 32; ++i) {
    const float f = static_cast<float>(i & 15);
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof bits);
    words[i] = static_cast<uint16_t>(bits >> 16);  // exact: small integers
  }
  return _mm512_load_si512(words);
}

template <int R>
void block_bf16(const uint16_t* x, int64_t ldx, const float* xsum, int64_t G, int64_t group,
                const uint8_t* w, const float* s, const float* o, int64_t lds, float* y,
                int64_t ldy, int64_t cols) {
  static const __m512i lut = bf16_of_nibbles();
  const __m512i nibble = _mm512_set1_epi16(0xF);
  alignas(64) float out[R][kCols] = {};
  for (int64_t g = 0; g < G; ++g) {
    __m512 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const int64_t k0 = g * group;
    for (int64_t k = k0; k < k0 + group; k += 2, w += 2 * kBytes) {
      _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetch), _MM_HINT_T0);
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + kBytes));
      // bytes a_0 b_0 a_1 b_1 ... a_15 b_15: column j's codes at k and k + 1 side by side
      const __m512i q =
          _mm512_cvtepu8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(a, b), _mm_unpacklo_epi8(a, b)));
      const __m512bh w0 = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(q, nibble), lut);
      const __m512bh w1 = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(q, 4), lut);
      for (int r = 0; r < R; ++r) {
        uint32_t pair;
        std::memcpy(&pair, x + r * ldx + k, sizeof pair);
        const __m512bh xr = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xr, w0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xr, w1);
      }
    }
    const __m512 s0 = _mm512_loadu_ps(s + g * lds), s1 = _mm512_loadu_ps(s + g * lds + 16);
    const __m512 o0 = _mm512_loadu_ps(o + g * lds), o1 = _mm512_loadu_ps(o + g * lds + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 xs = _mm512_set1_ps(xsum[r * G + g]);
      _mm512_store_ps(out[r], _mm512_fmadd_ps(acc[r][0], s0,
                                              _mm512_fmadd_ps(xs, o0, _mm512_load_ps(out[r]))));
      _mm512_store_ps(out[r] + 16, _mm512_fmadd_ps(acc[r][1], s1,
                                                   _mm512_fmadd_ps(xs, o1, _mm512_load_ps(out[r] + 16))));
    }
  }
  const __mmask16 m0 = cols >= 16 ? 0xFFFF : (__mmask16)((1u << cols) - 1);
  const __mmask16 m1 = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : (__mmask16)((1u << (cols - 16)) - 1);
  for (int r = 0; r < R; ++r) {
    _mm512_mask_storeu_ps(y + r * ldy, m0, _mm512_load_ps(out[r]));
    _mm512_mask_storeu_ps(y + r * ldy + 16, m1, _mm512_load_ps(out[r] + 16));
  }
}

template <int R>
void rows_of_block_bf16(const uint16_t* x, int64_t ldx, const float* xsum, int64_t G,
                        int64_t group, const uint8_t* w, const float* s, const float* o,
                        int64_t lds, float* y, int64_t ldy, int64_t cols, int64_t rows) {
  if constexpr (R > 1) {
    if (rows < R)
      return rows_of_block_bf16<R - 1>(x, ldx, xsum, G, group, w, s, o, lds, y, ldy, cols, rows);
  }
  block_bf16<R>(x, ldx, xsum, G, group, w, s, o, lds, y, ldy, cols);
}
#else
constexpr bool kBf16Dot = false;
#endif

#if defined(ADAPTIVE_AMX_TILES)
// bf16 rows [M, K] -> float32 [M, out_features] on AMX tiles (amx_tiles::take checked): the raw
// codes u as bf16 pairs (the vdpbf16ps loop's table lookup), each group's sums of x u times its
// scale plus the rows' sums of x times its folded offset, as there.
at::Tensor int4_linear_amx(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                           const at::Tensor& offsets, int64_t out_features) {
  const int64_t M = x.size(0), K = x.size(1), blocks = packed.size(0);
  at::Tensor y = at::empty({M, out_features}, x.options().dtype(at::kFloat));
  const int64_t G = scales.size(0), group = K / G, lds = blocks * kCols;
  const at::Tensor xsum = at::sum(x.view({M, G, group}), {2}, false, at::kFloat).contiguous();
  const float* xsp = xsum.data_ptr<float>();
  const float* sp = scales.data_ptr<float>();
  const float* op = offsets.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  static const __m512i lut = bf16_of_nibbles();
  amx_tiles::for_each_block(x, blocks, out_features, [&](const uint16_t* xs, int64_t b,
                                                         int64_t cols, int64_t r, int64_t rows) {
    const uint8_t* w = wp + b * K * kBytes;
    const float* s = sp + b * kCols;
    const float* o = op + b * kCols;
    const float* xsr = xsp + r * G;
    const __m512i nibble = _mm512_set1_epi16(0xF);
    alignas(64) float out[amx_tiles::kRows][kCols];
    auto pairs = [&](int64_t k, uint16_t* b0, uint16_t* b1) {
      const uint8_t* wk = w + k * kBytes;
      for (int p = 0; p < 16; ++p, wk += 2 * kBytes) {
        _mm_prefetch(reinterpret_cast<const char*>(wk + kPrefetch), _MM_HINT_T0);
        const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wk));
        const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wk + kBytes));
        const __m512i q = _mm512_cvtepu8_epi16(
            _mm256_set_m128i(_mm_unpackhi_epi8(a, c), _mm_unpacklo_epi8(a, c)));
        _mm512_store_si512(b0 + 32 * p, _mm512_permutexvar_epi16(_mm512_and_si512(q, nibble), lut));
        _mm512_store_si512(b1 + 32 * p, _mm512_permutexvar_epi16(_mm512_srli_epi16(q, 4), lut));
      }
    };
    auto epilogue = [&](int64_t g, const float (&c)[amx_tiles::kRows][kCols]) {
      const __m512 s0 = _mm512_loadu_ps(s + g * lds), s1 = _mm512_loadu_ps(s + g * lds + 16);
      const __m512 o0 = _mm512_loadu_ps(o + g * lds), o1 = _mm512_loadu_ps(o + g * lds + 16);
      for (int64_t i = 0; i < rows; ++i) {
        const __m512 xg = _mm512_set1_ps(xsr[i * G + g]);
        const __m512 a0 = g > 0 ? _mm512_load_ps(out[i]) : _mm512_setzero_ps();
        const __m512 a1 = g > 0 ? _mm512_load_ps(out[i] + 16) : _mm512_setzero_ps();
        _mm512_store_ps(out[i], _mm512_fmadd_ps(_mm512_load_ps(c[i]), s0, _mm512_fmadd_ps(xg, o0, a0)));
        _mm512_store_ps(out[i] + 16,
                        _mm512_fmadd_ps(_mm512_load_ps(c[i] + 16), s1, _mm512_fmadd_ps(xg, o1, a1)));
      }
    };
    amx_tiles::block_rows(xs, rows, K, group, pairs, epilogue);
    amx_tiles::store_rows(out, rows, cols, yp + r * out_features + b * kCols, out_features);
  });
  return y;
}
#else
at::Tensor int4_linear_amx(const at::Tensor& x, const at::Tensor&, const at::Tensor&,
                           const at::Tensor&, int64_t) {
  TORCH_CHECK(false, "int4_linear: this build has no AMX-BF16");
  return x;
}
#endif

template <int R>
void rows_of_block(const float* x, int64_t ldx, const float* xsum, int64_t G, int64_t K,
                   int64_t group, const uint8_t* w, const float* s, const float* o, int64_t lds,
                   float* y, int64_t ldy, int64_t cols, int64_t rows) {
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (R > 1) {
    if (rows < R)
      return rows_of_block<R - 1>(x, ldx, xsum, G, K, group, w, s, o, lds, y, ldy, cols, rows);
  }
  block<R>(x, ldx, xsum, G, K, group, w, s, o, lds, y, ldy, cols);
#endif
}

// codes [N, K] int8 in [-8, 7], scales [N, G] and offsets [N, G] (absent: 0) for G groups of
// K / G inputs -> (the codes as [N/32][K][16] on 2 MiB pages, scales [G, N/32 * 32] and folded
// offsets [G, N/32 * 32], float32, zero-padded)
std::tuple<at::Tensor, at::Tensor, at::Tensor> int4_pack(const at::Tensor& codes,
                                                         const at::Tensor& scales,
                                                         const std::optional<at::Tensor>& offsets) {
  TORCH_CHECK(kSupported, "int4_pack: this build has no AVX2 / FMA (built without them)");
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar,
              "int4_pack: the codes must be a 2-D int8 tensor, got ", codes.scalar_type(),
              " with ", codes.dim(), " dims");
  const at::Tensor c = codes.contiguous();
  const int64_t N = c.size(0), K = c.size(1);
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == N && scales.size(1) >= 1 &&
                  K % scales.size(1) == 0,
              "int4_pack: scales must be [N, G] with N = ", N, " and G dividing K = ", K,
              ", got ", scales.sizes());
  TORCH_CHECK(!offsets.has_value() || offsets->sizes() == scales.sizes(),
              "int4_pack: offsets must have the scales' shape ", scales.sizes());
  TORCH_CHECK(c.numel() == 0 || (c.min().item<int8_t>() >= -8 && c.max().item<int8_t>() <= 7),
              "int4_pack: codes must lie in [-8, 7]");
  const int64_t G = scales.size(1);
  const int64_t blocks = (N + kCols - 1) / kCols;
  at::Tensor packed = blocked_weight::on_huge_pages({blocks, K, kBytes}, at::kByte, "int4_pack");
  uint8_t* dst = packed.data_ptr<uint8_t>();
  const int8_t* src = c.data_ptr<int8_t>();
  auto nib = [&](int64_t n, int64_t k) -> uint8_t {
    return n < N ? static_cast<uint8_t>(src[n * K + k] + 8) : 8;  // padding: c = 0
  };
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      uint8_t* out = dst + b * K * kBytes;
      for (int64_t k = 0; k < K; ++k)
        for (int64_t j = 0; j < kBytes; ++j)
          out[k * kBytes + j] = nib(b * kCols + j, k) | (nib(b * kCols + j + 16, k) << 4);
    }
  });
  const at::Tensor s32 = scales.to(at::kFloat);
  const at::Tensor o32 = offsets.has_value() ? offsets->to(at::kFloat) : at::zeros_like(s32);
  at::Tensor sp = at::zeros({G, blocks * kCols}, s32.options());
  at::Tensor op = at::zeros({G, blocks * kCols}, s32.options());
  sp.narrow(1, 0, N).copy_(s32.t());
  op.narrow(1, 0, N).copy_((o32 - 8.0 * s32).t());
  return {packed, sp, op};
}

// bf16 rows [M, K] (checked by int4_linear) -> float32 [M, out_features] on the vdpbf16ps loop
at::Tensor int4_linear_bf16(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                            const at::Tensor& offsets, int64_t out_features) {
  const int64_t M = x.size(0), K = x.size(1), blocks = packed.size(0);
  at::Tensor y = at::empty({M, out_features}, x.options().dtype(at::kFloat));
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if (M == 0) return y;
  const int64_t G = scales.size(0), group = K / G, lds = blocks * kCols;
  // the groups' sums of x (for the offsets), summed in float32
  const at::Tensor xsum = at::sum(x.view({M, G, group}), {2}, false, at::kFloat).contiguous();
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const float* xs = xsum.data_ptr<float>();
  const float* sp = scales.data_ptr<float>();
  const float* op = offsets.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  blocked_weight::for_each_tile(blocks, M, kRows, out_features, [&](int64_t b, int64_t cols,
                                                                   int64_t r, int64_t rows) {
    rows_of_block_bf16<kRows>(xp + r * K, K, xs + r * G, G, group, wp + b * K * kBytes,
                              sp + b * kCols, op + b * kCols, lds,
                              yp + r * out_features + b * kCols, out_features, cols, rows);
  });
#endif
  return y;
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       const at::Tensor& offsets, int64_t out_features) {
  TORCH_CHECK(kSupported, "int4_linear: this build has no AVX2 / FMA (built without them)");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "int4_linear: x must be a contiguous 2-D float32 or bfloat16 tensor");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte &&
                  packed.size(2) == kBytes && packed.is_contiguous(),
              "int4_linear: packed must come from int4_pack");
  const int64_t M = x.size(0), K = x.size(1), blocks = packed.size(0);
  TORCH_CHECK(packed.size(1) == K, "int4_linear: x has ", K, " features, the weight ",
              packed.size(1));
  blocked_weight::check_out_features("int4_linear", out_features, blocks);
  TORCH_CHECK(scales.dim() == 2 && scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.size(1) == blocks * kCols && scales.size(0) >= 1 &&
                  K % scales.size(0) == 0 && offsets.sizes() == scales.sizes() &&
                  offsets.scalar_type() == at::kFloat && offsets.is_contiguous(),
              "int4_linear: scales and offsets must come from int4_pack with the codes");
  const int64_t G = scales.size(0), group = K / G, lds = blocks * kCols;
  if (x.scalar_type() == at::kBFloat16) {
    if (amx_tiles::take(M, K, group))
      return int4_linear_amx(x, packed, scales, offsets, out_features);
    if (kBf16Dot && group % 2 == 0) return int4_linear_bf16(x, packed, scales, offsets, out_features);
    return int4_linear(x.to(at::kFloat), packed, scales, offsets, out_features);
  }
  at::Tensor y = at::empty({M, out_features}, x.options());
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* sp = scales.data_ptr<float>();
  const float* op = offsets.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  std::vector<float> xsum(M * G);  // each row's sum over each group (the offsets' factor)
  for (int64_t r = 0; r < M; ++r)
    for (int64_t g = 0; g < G; ++g) {
      float acc = 0;
      for (int64_t k = g * group; k < (g + 1) * group; ++k) acc += xp[r * K + k];
      xsum[r * G + g] = acc;
    }
  blocked_weight::for_each_tile(blocks, M, kRows, out_features, [&](int64_t b, int64_t cols,
                                                                   int64_t r, int64_t rows) {
    rows_of_block<kRows>(xp + r * K, K, xsum.data() + r * G, G, K, group, wp + b * K * kBytes,
                         sp + b * kCols, op + b * kCols, lds, yp + r * out_features + b * kCols,
                         out_features, cols, rows);
  });
  return y;
}

// The int4 gear's linear as a compiled graph calls it: the step's kernel chosen here, without a
// Python frame, while every row of the step runs the int4 gear (`uniform[0] != 0`, set by the
// precision controller); otherwise the plugin's Python op, which groups the rows by gear.
// `native_rows[min(M, len - 1)]` picks for M rows: 1 int4_linear (bf16 rows on its vdpbf16ps
// loop where the CPU has one, else cast to float32), 0 torch's int4pack kernel (`int4pack`, its scale-and-zeros and group; absent where
// dispatch never picks it), 2 the Python op (rows that run the layer's own weight): the measured
// dispatch table, flattened by the Python side.
at::Tensor geared_int4_linear(const at::Tensor& x, const at::Tensor& packed,
                              const at::Tensor& scales, const at::Tensor& offsets,
                              const std::optional<at::Tensor>& int4pack,
                              const std::optional<at::Tensor>& int4pack_scale_zeros,
                              int64_t int4pack_group, const at::Tensor& native_rows,
                              const at::Tensor& uniform, int64_t index, int64_t out_features) {
  const int code = blocked_weight::routed_row_code(x, native_rows, uniform);
  if (code == 1)  // float32 out: a no-op cast for float32 rows
    return int4_linear(x.contiguous(), packed, scales, offsets, out_features).to(x.scalar_type());
  if (code == 0 && int4pack.has_value() && int4pack_scale_zeros.has_value())
    return at::_weight_int4pack_mm_for_cpu(x.contiguous(), *int4pack, int4pack_group,
                                           *int4pack_scale_zeros);
  return blocked_weight::python_geared_linear(x, index, out_features);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_adaptive_native, m) {
  m.def("int4_pack(Tensor codes, Tensor scales, Tensor? offsets) -> (Tensor, Tensor, Tensor)");
  m.def(
      "int4_linear(Tensor x, Tensor packed, Tensor scales, Tensor offsets, int out_features) -> "
      "Tensor");
  m.def(
      "geared_int4_linear(Tensor x, Tensor packed, Tensor scales, Tensor offsets, "
      "Tensor? int4pack, Tensor? int4pack_scale_zeros, int int4pack_group, Tensor native_rows, "
      "Tensor uniform, int index, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_adaptive_native, CPU, m) {
  m.impl("int4_pack", &int4_pack);
  m.impl("int4_linear", &int4_linear);
  m.impl("geared_int4_linear", &geared_int4_linear);
}
