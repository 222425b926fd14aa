// exp over float vectors from arithmetic and bit operations only (no libm call, so loops over it
// vectorize): the softmax of the masked attention kernels and the entropy of a step's logits.
#pragma once

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

// Vectors of 16 floats in GCC's vector extension: one zmm on AVX512, two ymm on AVX2.
typedef float vec16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

// exp for x <= 0 from arithmetic and bit operations only, so that loops over it vectorize
// (Cephes' expf polynomial after range reduction; relative error ~2e-7; x below -87 gives
// ~1e-38, never used for a hidden slot, whose weight is set to 0 separately).
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}



// exp_nonpositive on 16 lanes (the same polynomial). On AVX512 the range reduction rounds with
// one instruction and the power of two is applied by vscalefps: about half the instructions of
// the portable form (the softmax's exps were a quarter of the prefill kernel's time, profiled).
inline vec16 exp16(vec16 x) {
#ifdef __AVX512F__
  const __m512 xc = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_fmadd_ps(r, _mm512_set1_ps(1.9875691500e-4f), _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
#else
  const vec16 lo = vec16{} - 87.0f;
  x = x < lo ? lo : x;
  const vec16 t = x * 1.44269504088896341f + 0.5f;
  vec16 n = __builtin_convertvector(__builtin_convertvector(t, i32x16), vec16);
  n = n + __builtin_convertvector(n > t, vec16);  // truncation rounded a negative t up: -1
  const vec16 r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vec16 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const i32x16 bits = (__builtin_convertvector(n, i32x16) + 127) << 23;
  vec16 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
#endif
}

}  // namespace
