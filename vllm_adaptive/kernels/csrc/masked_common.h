// Shared parts of the masked attention kernels over vLLM's CPU paged KV cache with the per-slot
// depth mask (masked_decode.cpp: one query per request; masked_prefill.cpp: prefill rows).
//
// The mask rule of docs/masked-attention.md: at layer `layer` a cached key is visible iff
// depth_record[slot] > layer; a step's own keys are visible causally unless mask_step_tokens,
// where the record decides for them too. Invisible slots are never read as V and their scores
// never enter the softmax, so NaN / inf left in them cannot leak; rows with no visible key are
// zeros.
//
// Layout (vLLM CPU_ATTN, ISAs vec / vec16): per (block, kv head) K is stored transposed,
// [head_size][block_size], and V as [block_size][head_size]; `key_cache` / `value_cache` are
// the two chunks of the layer cache (strides of dims 0 and 1 taken from the tensors). Why not
// vLLM's op: it has no per-slot mask (docs/masked-attention.md has the measurements).

#pragma once

#include <ATen/ATen.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "vec_exp.h"

namespace {


template <typename T>
inline float as_float(T x) {
  return static_cast<float>(x);
}

typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));

inline i32x16 lane_mask(const uint8_t* vis) {  // all ones where vis[i] != 0
  u8x16 v;
  std::memcpy(&v, vis, sizeof(v));
  return __builtin_convertvector(v, i32x16) != 0;
}

// Horizontal max / sum of 16 lanes as a tree (4 shuffles), not 15 dependent scalar steps.
inline vec16 hmax_tree(vec16 v) {
  vec16 t = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v = v > t ? v : t;
  t = __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v = v > t ? v : t;
  t = __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v = v > t ? v : t;
  t = __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return v > t ? v : t;  // every lane holds the max
}
inline float hsum_tree(vec16 v) {
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return v[0];
}

template <typename T>
inline vec16 load16(const T* p);
template <>
inline vec16 load16<float>(const float* p) {
  vec16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
template <>
inline vec16 load16<at::BFloat16>(const at::BFloat16* p) {
  u16x16 h;
  std::memcpy(&h, p, sizeof(h));
  const u32x16 w = __builtin_convertvector(h, u32x16) << 16;  // bf16 is float's top half
  vec16 v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
}

// The checks both ops make on the arguments they share (a bad call is an error that names the
// argument, never a read outside a tensor): query and out, the paged cache, the block table
// (at least `requests` rows) and the record; returns the record's data (nullptr: no record).
inline const int16_t* check_shared_args(const at::Tensor& out, const at::Tensor& query,
                                        const char* query_rows, const at::Tensor& key_cache,
                                        const at::Tensor& value_cache,
                                        const at::Tensor& block_table, int64_t requests,
                                        const std::optional<at::Tensor>& depth_record) {
  TORCH_CHECK(query.dim() == 3 && query.scalar_type() == at::kFloat && query.is_contiguous(),
              "query must be contiguous float32 [", query_rows, ", heads, head_size]");
  TORCH_CHECK(out.sizes() == query.sizes() && out.scalar_type() == at::kFloat &&
                  out.is_contiguous(),
              "out must be contiguous float32 shaped like query");
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes() &&
                  value_cache.scalar_type() == key_cache.scalar_type(),
              "key_cache / value_cache must be [blocks, kv_heads, block_size, head_size] alike");
  const int64_t BS = key_cache.size(2), D = key_cache.size(3);
  TORCH_CHECK(D == query.size(2), "head_size differs between query and cache");
  TORCH_CHECK(query.size(1) % key_cache.size(1) == 0, "heads must be a multiple of kv heads");
  for (const at::Tensor* c : {&key_cache, &value_cache})
    TORCH_CHECK(c->stride(3) == 1 && c->stride(2) == D,
                "each (block, kv head) of the cache must be block_size x head_size contiguous");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 2 &&
                  block_table.stride(1) == 1 && block_table.size(0) >= requests,
              "block_table must be int32 [requests, max_blocks] with contiguous rows");
  if (!depth_record.has_value()) return nullptr;
  TORCH_CHECK(depth_record->scalar_type() == at::kShort && depth_record->is_contiguous() &&
                  depth_record->numel() >= key_cache.size(0) * BS,
              "depth_record must be contiguous int16 with a value per cache slot");
  return depth_record->data_ptr<int16_t>();
}

// Which slots of block `b` (cache block `block`) the query sees, as the flag per slot `vis`
// and the list of visible slots `rows`; returns how many. One rule for every path (header).
inline int64_t block_visibility(uint8_t* vis, int32_t* rows, int64_t b, int64_t BS, int64_t len,
                                int64_t first, const int16_t* record, int64_t block,
                                int64_t layer, bool mask_step_tokens) {
  const int64_t lo = b * BS;
  // slots [lo, recorded_end) are decided by the record alone; the step's own key (len - 1) by
  // the record only when mask_step_tokens
  const int64_t recorded_end = mask_step_tokens ? len : len - 1;
  if (lo >= first && lo + BS <= recorded_end) {  // an interior block: a loop that vectorizes
    if (record == nullptr) {
      std::memset(vis, 1, BS);
    } else {
      const int16_t* rec = record + block * BS;
      for (int64_t i = 0; i < BS; ++i) vis[i] = rec[i] > layer;
    }
  } else {
    for (int64_t i = 0; i < BS; ++i) {
      const int64_t pos = lo + i;
      bool ok = pos < len && pos >= first;
      if (ok && record != nullptr && pos < recorded_end) ok = record[block * BS + i] > layer;
      vis[i] = ok;
    }
  }
  int64_t n = 0;
  for (int64_t i = 0; i < BS; ++i) {
    rows[n] = static_cast<int32_t>(i);
    n += vis[i];
  }
  return n;
}

// Every cache line of a block: its slots are contiguous, but a request's blocks are scattered,
// so the hardware prefetcher would start again at each one. (Measured on the Ice Lake Xeon:
// 10-20% off at 8k tokens; at 512 tokens, where a hot loop finds the cache in L2, it costs
// up to 15%.)
template <typename T>
inline void prefetch_block(const T* p, int64_t elements) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < elements * static_cast<int64_t>(sizeof(T)); off += 64)
    __builtin_prefetch(c + off, 0, 3);
}

// One block for GT query heads: their scores against the block's K^T (each K vector loaded once
// for the GT heads), the online-softmax update, and the visible V rows (each loaded once).
// `qs` / `acc` / `m` / `l`: the GT heads' scaled queries, accumulators and softmax state.
template <typename T, int ND, int GT>
inline void update_group(const T* kb, const T* vb, int64_t BS, const uint8_t* vis,
                         const int32_t* rows, int64_t nvis, const float* qs, float* acc, float* m,
                         float* l, float* s, float* probs) {
  constexpr int64_t D = 16 * ND;
  // independent accumulators, so that FMA latency is hidden: P partial sums per head over the
  // head dimension in the score loop (D is a multiple of 16), U sets of V accumulators
  constexpr int P = GT >= 4 ? 2 : (GT >= 2 ? 4 : 8);
  constexpr int U = GT >= 3 ? 2 : 4;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const vec16 hidden = vec16{} + neg_inf;
  vec16 vmax[GT];
  for (int g = 0; g < GT; ++g) vmax[g] = hidden;
  for (int64_t c = 0; c < BS; c += 16) {
    vec16 a[GT][P] = {};
    for (int64_t d = 0; d < D; d += P) {
      for (int p = 0; p < P; ++p) {
        const vec16 k = load16(kb + (d + p) * BS + c);
        for (int g = 0; g < GT; ++g) a[g][p] += qs[g * D + d + p] * k;
      }
    }
    const i32x16 lanes = lane_mask(vis + c);
    for (int g = 0; g < GT; ++g) {
      vec16 sum = a[g][0];
      for (int p = 1; p < P; ++p) sum += a[g][p];
      const vec16 sc = lanes ? sum : hidden;  // a NaN K in a hidden slot is dropped here
      vmax[g] = vmax[g] > sc ? vmax[g] : sc;
      std::memcpy(s + g * BS + c, &sc, sizeof(sc));
    }
  }
  float corr[GT];
  for (int g = 0; g < GT; ++g) {
    float mb = neg_inf;
    for (int i = 0; i < 16; ++i) mb = std::max(mb, vmax[g][i]);
    const float mnew = std::max(m[g], mb);
    corr[g] = m[g] == neg_inf ? 0.f : exp_nonpositive(m[g] - mnew);
    vec16 vsum = {};
    for (int64_t c = 0; c < BS; c += 16) {
      const vec16 e = exp16(load16(s + g * BS + c) - mnew);
      const vec16 pc = lane_mask(vis + c) ? e : vec16{};
      vsum += pc;
      std::memcpy(probs + g * BS + c, &pc, sizeof(pc));
    }
    float sum = 0.f;
    for (int i = 0; i < 16; ++i) sum += vsum[i];
    l[g] = l[g] * corr[g] + sum;
    m[g] = mnew;
  }
  // V: each visible row read once (hidden rows never), 16 lanes of the head at a time
  for (int c = 0; c < ND; ++c) {
    vec16 av[U][GT] = {};
    for (int g = 0; g < GT; ++g) av[0][g] = load16(acc + g * D + 16 * c) * corr[g];
    int64_t k = 0;
    for (; k + U <= nvis; k += U) {
      for (int u = 0; u < U; ++u) {
        const int32_t i = rows[k + u];
        const vec16 v = load16(vb + i * D + 16 * c);
        for (int g = 0; g < GT; ++g) av[u][g] += probs[g * BS + i] * v;
      }
    }
    for (; k < nvis; ++k) {
      const int32_t i = rows[k];
      const vec16 v = load16(vb + i * D + 16 * c);
      for (int g = 0; g < GT; ++g) av[0][g] += probs[g * BS + i] * v;
    }
    for (int g = 0; g < GT; ++g) {
      for (int u = 1; u < U; ++u) av[0][g] += av[u][g];
      std::memcpy(acc + g * D + 16 * c, &av[0][g], sizeof(vec16));
    }
  }
}

}  // namespace
