// How fast one core streams memory here: plain 64-byte loads, then the same stream with the
// int8 kernel's one-row work per line (four 16-code sign-extend + convert + FMA), cold (256 MiB)
// and hot (1 MiB, cache-resident), with and without a software prefetch ahead.
//   gcc -O2 -mavx512f -mavx512bw -o /tmp/stream_probe docs/experiments/stream_probe.c && /tmp/stream_probe
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static double loads(const char* a, size_t n, int pf) {
  double best = 1e9;
  for (int it = 0; it < 5; it++) {
    __m512i s0 = _mm512_setzero_si512(), s1 = s0, s2 = s0, s3 = s0;
    double t0 = now();
    for (size_t i = 0; i < n; i += 256) {
      if (pf) _mm_prefetch(a + i + pf, _MM_HINT_T0);
      s0 = _mm512_add_epi32(s0, _mm512_load_si512(a + i));
      s1 = _mm512_add_epi32(s1, _mm512_load_si512(a + i + 64));
      s2 = _mm512_add_epi32(s2, _mm512_load_si512(a + i + 128));
      s3 = _mm512_add_epi32(s3, _mm512_load_si512(a + i + 192));
    }
    double t = now() - t0;
    if (t < best) best = t;
    volatile int x = _mm512_reduce_add_epi32(
        _mm512_add_epi32(_mm512_add_epi32(s0, s1), _mm512_add_epi32(s2, s3)));
    (void)x;
  }
  return n / best / 1e9;
}

static double codes(const char* a, size_t n, size_t len, int pf) {
  const __m512 x = _mm512_set1_ps(1.0001f);
  double best = 1e9;
  for (int it = 0; it < 5; it++) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                     _mm512_setzero_ps()};
    double t0 = now();
    for (size_t rep = 0; rep < n / len; rep++)
      for (size_t i = 0; i < len; i += 64) {
        if (pf) _mm_prefetch(a + i + pf, _MM_HINT_T0);
        for (int j = 0; j < 4; j++) {
          const __m512 w = _mm512_cvtepi32_ps(
              _mm512_cvtepi8_epi32(_mm_load_si128((const __m128i*)(a + i + 16 * j))));
          acc[j] = _mm512_fmadd_ps(x, w, acc[j]);
        }
      }
    double t = now() - t0;
    if (t < best) best = t;
    volatile float s = _mm512_reduce_add_ps(
        _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
    (void)s;
  }
  return n / best / 1e9;
}

int main(void) {
  const size_t n = (size_t)256 << 20;
  char* a = aligned_alloc(4096, n);
  memset(a, 1, n);
  printf("loads, cold: %.1f GB/s; with a prefetch 4 KiB ahead: %.1f GB/s\n", loads(a, n, 0),
         loads(a, n, 4096));
  printf("loads + one-row int8 work, cold: %.1f GB/s; prefetch 4 KiB ahead: %.1f GB/s; "
         "hot (1 MiB): %.1f GB/s\n",
         codes(a, n, n, 0), codes(a, n, n, 4096), codes(a, n, 1 << 20, 4096));
  return 0;
}
