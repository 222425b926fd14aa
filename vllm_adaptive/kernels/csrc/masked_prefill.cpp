// Prefill attention with the per-slot depth mask (rule and layout: masked_common.h): token
// fusion's steps and any step with prefill rows under the KV mask, at vLLM's op speed (a torch
// path over gathered copies ran 3-5x slower than vLLM's CPU op on prefills of 512-8000 tokens).

#include <atomic>

#include "masked_common.h"

namespace {

// Prefill rows (several queries per request), at vLLM's positions or at explicit per-query
// positions (token fusion runs a subset of a prompt's rows, ascending). A query at position p of
// a request with len tokens, n of them this step's (ctx = len - n), sees key j iff j <= p,
// j > p - W (window W > 0), and, where the record decides (j < ctx, or every j under
// mask_step_tokens), depth_record[slot(j)] > layer.
//
// One task per (request, KV head, tile of kPrefillTile query rows): the tile's rows x G query
// vectors pass over each chunk of kChunk slots of a K/V block while it is in L1. Blocks every
// row of the tile sees whole (causally and by the window) are updated for its vectors
// kTileVectors at a time; diagonal blocks the same way with each vector's own causal limit and
// window, from the first vector that reaches the chunk. Tasks are taken most work first (a
// tile's work grows with its position), so the threads finish together. No software prefetch:
// a block is reused by the whole tile, and a burst of prefetches for the next block stalled the
// loop (5% of the kernel's time at 2048 tokens, profiled).

constexpr int64_t kPrefillTile = 64;

// The slots of block b that exist and that the record lets through (the causal limit and the
// window are per row, applied by the caller).
inline void base_visibility(uint8_t* vis, int64_t b, int64_t BS, int64_t len, int64_t ctx,
                            const int16_t* record, int64_t block, int64_t layer,
                            bool mask_step_tokens) {
  const int64_t lo = b * BS;
  const int64_t recorded_end = mask_step_tokens ? len : ctx;
  for (int64_t i = 0; i < BS; ++i) {
    const int64_t pos = lo + i;
    bool ok = pos < len;
    if (ok && record != nullptr && pos < recorded_end) ok = record[block * BS + i] > layer;
    vis[i] = ok;
  }
}

constexpr int64_t kMaxBlockSize = 256;
// Slots per chunk: a block is taken 32 slots at a time (16 when its size is not a multiple of
// 32), so that a chunk's K and V (8 KB each at head size 64) stay in L1 while every vector of
// the tile passes over them; a whole block of 128 slots would be served from L2.
constexpr int64_t kChunk = 32;
#ifdef __AVX512F__
constexpr int kTileVectors = 8;  // 32 zmm: 16 score accumulators + K + broadcasts
constexpr int kPvRegisters = 16;
#else
constexpr int kTileVectors = 4;  // 16 ymm pairs' worth on AVX2
constexpr int kPvRegisters = 8;
#endif

// NV query vectors against one chunk of n = 16 * CH slots (`l`: each vector's softmax sum as 16
// partial lanes, so that no chunk pays a horizontal sum): K^T rows `kt` (row stride ks), V
// rows `vt` ([n][D]). Each K^T row is loaded once for all NV vectors' scores (NV x CH
// accumulators); each V row once per pass of VP vectors whose accumulators stay in registers.
// rows / nvis: the chunk's visible slots, or rows == nullptr when all n are visible (then no
// lane mask and no indirection). CAUSAL: vector v also sees only the block's slots first[v] ..
// last[v]; `slot0` is the chunk's first slot in its block.
template <typename T, int ND, int NV, int CH, bool CAUSAL>
inline void update_chunk(const T* kt, int64_t ks, const T* vt, const uint8_t* vis,
                         const int32_t* rows, int64_t nvis, int32_t slot0, const float* qs,
                         float* acc, float* m, float* l, float* probs,
                         const int32_t* first, const int32_t* last) {
  constexpr int64_t D = 16 * ND, n = 16 * CH;
  static_assert(NV <= 16, "one lane per vector for the softmax corrections");
  constexpr int VP = kPvRegisters / ND > 0 ? kPvRegisters / ND : 1;  // vectors per V pass
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const vec16 hidden = vec16{} + neg_inf;
  vec16 a[NV][CH] = {};
  for (int64_t d = 0; d < D; ++d) {
    vec16 k[CH];
    for (int h = 0; h < CH; ++h) k[h] = load16(kt + d * ks + 16 * h);
    for (int v = 0; v < NV; ++v) {
      const float qd = qs[v * D + d];
      for (int h = 0; h < CH; ++h) a[v][h] += qd * k[h];
    }
  }
  // scores (hidden: -inf), each vector's new maximum, then all corrections in one exp16
  vec16 mold = {}, mnew = {};
  for (int h = 0; h < CH; ++h) {
    i32x16 lanes = i32x16{} - 1;
    if (rows != nullptr) lanes = lane_mask(vis + 16 * h);
    const i32x16 slot =
        i32x16{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15} + (slot0 + 16 * h);
    for (int v = 0; v < NV; ++v) {
      i32x16 ok = lanes;
      if constexpr (CAUSAL) ok &= (slot >= first[v]) & (slot <= last[v]);
      a[v][h] = ok ? a[v][h] : hidden;  // a NaN K in a hidden slot is dropped here
    }
  }
  for (int v = 0; v < NV; ++v) {
    vec16 vmax = a[v][0];
    for (int h = 1; h < CH; ++h) vmax = vmax > a[v][h] ? vmax : a[v][h];
    mold[v % 16] = m[v];
    mnew[v % 16] = std::max(m[v], hmax_tree(vmax)[0]);
  }
  const i32x16 started = mold > hidden;  // vectors that saw a visible key before this chunk
  const vec16 corrv = started ? exp16((started ? mold : mnew) - mnew) : vec16{};
  float corr[NV];
  for (int v = 0; v < NV; ++v) {
    corr[v] = corrv[v % 16];
    const vec16 mn = vec16{} + mnew[v % 16];
    m[v] = mnew[v % 16];
    vec16 vsum = {};
    for (int h = 0; h < CH; ++h) {
      const vec16 x = a[v][h];
      const vec16 pc = x > hidden ? exp16(x - mn) : vec16{};
      vsum += pc;
      std::memcpy(probs + v * n + 16 * h, &pc, sizeof(pc));
    }
    const vec16 lv = load16(l + 16 * v) * corr[v] + vsum;  // lanes summed once, at the end
    std::memcpy(l + 16 * v, &lv, sizeof(lv));
  }
  for (int v0 = 0; v0 < NV; v0 += VP) {  // V: each visible row read once per pass
    constexpr int W = VP < NV ? VP : NV;
    vec16 av[W][ND];
#pragma GCC unroll 16
    for (int v = 0; v < W; ++v)
#pragma GCC unroll 16
      for (int c = 0; c < ND; ++c) av[v][c] = load16(acc + (v0 + v) * D + 16 * c) * corr[v0 + v];
    const float* p = probs + v0 * n;
    const auto row = [&](int64_t i) {
      const T* vr = vt + i * D;
      vec16 vv[ND];
      for (int c = 0; c < ND; ++c) vv[c] = load16(vr + 16 * c);
      for (int v = 0; v < W; ++v) {
        const float pv = p[v * n + i];
        for (int c = 0; c < ND; ++c) av[v][c] += pv * vv[c];
      }
    };
    if (rows == nullptr) {
      for (int64_t i = 0; i < n; ++i) row(i);
    } else {
      for (int64_t k = 0; k < nvis; ++k) row(rows[k]);
    }
#pragma GCC unroll 16
    for (int v = 0; v < W; ++v)
#pragma GCC unroll 16
      for (int c = 0; c < ND; ++c) std::memcpy(acc + (v0 + v) * D + 16 * c, &av[v][c], 64);
  }
}

// Vectors v0 .. v1 of a tile against one block, a chunk at a time (every vector over a chunk
// before the next chunk): groups of kTileVectors, the rest one by one. `last` ascends over the
// vectors (rows ascend), so a causal chunk starts at the first vector that reaches it.
template <typename T, int ND, int CH, bool CAUSAL>
inline void chunks_update(const T* kb, const T* vb, int64_t BS, const uint8_t* vis, int64_t v0,
                        int64_t v1, const float* qs, float* acc, float* m, float* l,
                        float* probs, const int32_t* first, const int32_t* last) {
  constexpr int64_t D = 16 * ND, n = 16 * CH;
  int32_t rows[n];
  T packed[D * n];  // the chunk's K^T rows side by side: strided rows (BS > n) thrash L1's sets
  for (int64_t c0 = 0; c0 < BS; c0 += n) {
    int64_t nvis = 0;
    for (int64_t i = 0; i < n; ++i) {
      rows[nvis] = static_cast<int32_t>(i);
      nvis += vis[c0 + i];
    }
    if (nvis == 0) continue;
    const int32_t* r = nvis == n ? nullptr : rows;
    const T* kt = kb + c0;
    int64_t ks = BS;
    if (BS > n && v1 - v0 > kTileVectors) {
      for (int64_t d = 0; d < D; ++d) std::memcpy(packed + d * n, kb + d * BS + c0, n * sizeof(T));
      kt = packed;
      ks = n;
    }
    const T* vt = vb + c0 * D;
    int64_t v = v0;
    if constexpr (CAUSAL)
      while (v < v1 && last[v] < c0) ++v;
    for (; v + kTileVectors <= v1; v += kTileVectors)
      update_chunk<T, ND, kTileVectors, CH, CAUSAL>(
          kt, ks, vt, vis + c0, r, nvis, static_cast<int32_t>(c0), qs + v * D, acc + v * D,
          m + v, l + 16 * v, probs, CAUSAL ? first + v : nullptr, CAUSAL ? last + v : nullptr);
    for (; v < v1; ++v)
      update_chunk<T, ND, 1, CH, CAUSAL>(kt, ks, vt, vis + c0, r, nvis, static_cast<int32_t>(c0),
                                         qs + v * D, acc + v * D, m + v, l + 16 * v, probs,
                                         CAUSAL ? first + v : nullptr,
                                         CAUSAL ? last + v : nullptr);
  }
}

template <typename T, int ND, bool CAUSAL>
inline void block_update(const T* kb, const T* vb, int64_t BS, const uint8_t* vis, int64_t v0,
                         int64_t v1, const float* qs, float* acc, float* m, float* l,
                         float* probs, const int32_t* first, const int32_t* last) {
  if (BS % kChunk == 0)
    chunks_update<T, ND, kChunk / 16, CAUSAL>(kb, vb, BS, vis, v0, v1, qs, acc, m, l, probs,
                                              first, last);
  else
    chunks_update<T, ND, 1, CAUSAL>(kb, vb, BS, vis, v0, v1, qs, acc, m, l, probs, first, last);
}

template <typename T, int ND>
void masked_prefill_vec(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                        const at::Tensor& value_cache, const int32_t* qsl, const int32_t* lens,
                        const at::Tensor& block_table, const int32_t* qpos,
                        const std::vector<int64_t>& requests, const int16_t* record,
                        int64_t layer, double scale, int64_t window, bool mask_step_tokens) {
  constexpr int64_t D = 16 * ND;
  const int64_t H = query.size(1);
  const int64_t KVH = key_cache.size(1), BS = key_cache.size(2);
  const int64_t G = H / KVH, num_blocks = key_cache.size(0);
  const int64_t ks0 = key_cache.stride(0), ks1 = key_cache.stride(1);
  const int64_t vs0 = value_cache.stride(0), vs1 = value_cache.stride(1);
  const int64_t bts = block_table.stride(0);
  const T* kbase = key_cache.data_ptr<T>();
  const T* vbase = value_cache.data_ptr<T>();
  const float* q = query.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const float fscale = static_cast<float>(scale);
  const float neg_inf = -std::numeric_limits<float>::infinity();

  // tasks, the most work first (a tile's work grows with its last position), taken in turn
  struct Task {
    int64_t r, h, i0, i1, work;
  };
  std::vector<Task> tasks;
  for (const int64_t r : requests) {
    for (int64_t i0 = qsl[r]; i0 < qsl[r + 1]; i0 += kPrefillTile) {
      const int64_t i1 = std::min<int64_t>(qsl[r + 1], i0 + kPrefillTile);
      const int64_t last = qpos ? qpos[i1 - 1] : lens[r] - (qsl[r + 1] - i1) - 1;
      for (int64_t h = 0; h < KVH; ++h) tasks.push_back({r, h, i0, i1, (i1 - i0) * (last + 1)});
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const Task& a, const Task& b) { return a.work > b.work; });
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), tasks.size());
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    const int64_t NV = kPrefillTile * G;
    std::vector<float> qs(NV * D), acc(NV * D), m(NV), l(NV * 16), probs(kTileVectors * kChunk);
    std::vector<uint8_t> base(BS), vis(BS);
    std::vector<int64_t> pos(kPrefillTile);
    std::vector<int32_t> vfirst(NV), vlast(NV);
    for (int64_t t = next++; t < static_cast<int64_t>(tasks.size()); t = next++) {
      const Task& task = tasks[t];
      const int64_t r = task.r, h = task.h, nrow = task.i1 - task.i0;
      const int64_t len = lens[r], ctx = len - (qsl[r + 1] - qsl[r]);
      for (int64_t i = 0; i < nrow; ++i) {
        const int64_t qi = task.i0 + i;
        pos[i] = qpos ? qpos[qi] : ctx + (qi - qsl[r]);
        const float* qh = q + (qi * H + h * G) * D;
        for (int64_t e = 0; e < G * D; ++e) qs[i * G * D + e] = qh[e] * fscale;
      }
      const int64_t nv = nrow * G;
      std::fill(acc.begin(), acc.begin() + nv * D, 0.f);
      std::fill(m.begin(), m.begin() + nv, neg_inf);
      std::fill(l.begin(), l.begin() + nv * 16, 0.f);
      const int64_t p_min = pos[0], p_max = pos[nrow - 1];
      const int64_t first = window > 0 ? std::max<int64_t>(0, p_min - window + 1) : 0;
      const int64_t shared_from = window > 0 ? p_max - window + 1 : 0;
      for (int64_t b = first / BS; b <= p_max / BS; ++b) {
        const int64_t block = table[r * bts + b];
        TORCH_CHECK(block >= 0 && block < num_blocks, "request ", r, ": block id ", block,
                    " outside the cache's ", num_blocks, " blocks");
        base_visibility(base.data(), b, BS, len, ctx, record, block, layer, mask_step_tokens);
        const T* kb = kbase + block * ks0 + h * ks1;  // K^T: [D][BS]
        const T* vb = vbase + block * vs0 + h * vs1;  // V: [BS][D]
        const int64_t lo = b * BS;
        if (lo + BS - 1 <= p_min && lo >= shared_from) {  // every row sees the whole block
          block_update<T, ND, false>(kb, vb, BS, base.data(), 0, nv, qs.data(), acc.data(),
                                     m.data(), l.data(), probs.data(), nullptr, nullptr);
          continue;
        }
        // a diagonal block: each row its causal limit and window, the rows that see any of it
        int64_t i_first = 0;
        while (i_first < nrow && pos[i_first] < lo) ++i_first;
        for (int64_t i = i_first; i < nrow; ++i) {
          const int32_t f = static_cast<int32_t>(
              window > 0 ? std::max<int64_t>(0, pos[i] - window + 1 - lo) : 0);
          const int32_t t = static_cast<int32_t>(std::min<int64_t>(BS - 1, pos[i] - lo));
          for (int64_t g = 0; g < G; ++g) {
            vfirst[i * G + g] = f;
            vlast[i * G + g] = t;
          }
        }
        const int64_t lo_union = window > 0 ? std::max<int64_t>(0, pos[i_first] - window + 1) : 0;
        for (int64_t k = 0; k < BS; ++k)
          vis[k] = base[k] && lo + k <= p_max && lo + k >= lo_union;
        if (i_first == nrow) continue;
        block_update<T, ND, true>(kb, vb, BS, vis.data(), i_first * G, nv, qs.data(), acc.data(),
                                  m.data(), l.data(), probs.data(), vfirst.data(), vlast.data());
      }
      for (int64_t i = 0; i < nrow; ++i) {
        float* oh = o + ((task.i0 + i) * H + h * G) * D;
        for (int64_t g = 0; g < G; ++g) {
          const int64_t v = i * G + g;
          const float sum = hsum_tree(load16(l.data() + 16 * v));
          const float inv = sum > 0.f ? 1.f / sum : 0.f;
          for (int64_t d = 0; d < D; ++d) oh[g * D + d] = acc[v * D + d] * inv;
        }
      }
    }
  });
}

void masked_prefill(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                    const at::Tensor& value_cache, const at::Tensor& query_start_loc,
                    const at::Tensor& seq_lens, const at::Tensor& block_table,
                    const std::optional<at::Tensor>& query_positions,
                    const std::optional<at::Tensor>& requests,
                    const std::optional<at::Tensor>& depth_record, int64_t layer, double scale,
                    int64_t sliding_window, bool mask_step_tokens) {
  const int64_t R = seq_lens.numel();
  const int16_t* record = check_shared_args(out, query, "tokens", key_cache, value_cache,
                                            block_table, R, depth_record);
  const int64_t BS = key_cache.size(2), D = key_cache.size(3);
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(),
              "seq_lens must be contiguous int32 [requests]");
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && query_start_loc.is_contiguous() &&
                  query_start_loc.numel() == R + 1,
              "query_start_loc must be contiguous int32 [requests + 1]");
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* qpos = nullptr;
  if (query_positions.has_value()) {
    TORCH_CHECK(query_positions->scalar_type() == at::kInt && query_positions->is_contiguous() &&
                    query_positions->numel() == query.size(0),
                "query_positions must be contiguous int32 [tokens]");
    TORCH_CHECK(mask_step_tokens && depth_record.has_value(),
                "query_positions needs depth_record and mask_step_tokens");
    qpos = query_positions->data_ptr<int32_t>();
  }
  std::vector<int64_t> todo;
  if (requests.has_value()) {
    TORCH_CHECK(requests->scalar_type() == at::kInt && requests->is_contiguous(),
                "requests must be contiguous int32");
    const int32_t* ids = requests->data_ptr<int32_t>();
    for (int64_t k = 0; k < requests->numel(); ++k) {
      TORCH_CHECK(ids[k] >= 0 && ids[k] < R, "request id ", ids[k], " outside 0..", R - 1);
      todo.push_back(ids[k]);
    }
  } else {
    for (int64_t r = 0; r < R; ++r) todo.push_back(r);
  }
  const int64_t max_blocks = block_table.size(1);
  for (const int64_t r : todo) {
    const int64_t n = qsl[r + 1] - qsl[r];
    TORCH_CHECK(n >= 0 && qsl[r] >= 0 && qsl[r + 1] <= query.size(0),
                "request ", r, ": query_start_loc outside the query's rows");
    TORCH_CHECK(n <= lens[r] && (lens[r] + BS - 1) / BS <= max_blocks, "request ", r,
                ": seq_len ", lens[r], " with ", n, " queries does not fit its block_table row");
    if (qpos != nullptr) {
      for (int64_t i = qsl[r]; i < qsl[r + 1]; ++i)
        TORCH_CHECK(qpos[i] >= 0 && qpos[i] < lens[r] && (i == qsl[r] || qpos[i] > qpos[i - 1]),
                    "request ", r, ": query_positions must ascend within 0..seq_len - 1");
    }
  }
  TORCH_CHECK(BS % 16 == 0 && BS <= kMaxBlockSize,
              "the native prefill kernel needs a block size that is a multiple of 16, at most ",
              kMaxBlockSize);
#define ADAPTIVE_PREFILL_CALL(T, ND)                                                           \
  return masked_prefill_vec<T, ND>(out, query, key_cache, value_cache, qsl, lens, block_table,  \
                                   qpos, todo, record, layer, scale, sliding_window,            \
                                   mask_step_tokens);
#define ADAPTIVE_PREFILL_HEADS(T)                                                              \
  switch (D) {                                                                                 \
    case 64: ADAPTIVE_PREFILL_CALL(T, 4)                                                       \
    case 128: ADAPTIVE_PREFILL_CALL(T, 8)                                                      \
    case 256: ADAPTIVE_PREFILL_CALL(T, 16)                                                     \
    default: TORCH_CHECK(false, "the native prefill kernel has no head size ", D);              \
  }
  switch (key_cache.scalar_type()) {
    case at::kFloat: ADAPTIVE_PREFILL_HEADS(float)
    case at::kBFloat16: ADAPTIVE_PREFILL_HEADS(at::BFloat16)
    default:
      TORCH_CHECK(false, "the native prefill kernel takes float32 or bfloat16 caches, got ",
                  key_cache.scalar_type());
  }
#undef ADAPTIVE_PREFILL_HEADS
#undef ADAPTIVE_PREFILL_CALL
}

}  // namespace

TORCH_LIBRARY_IMPL(vllm_adaptive_native, CPU, m) { m.impl("masked_prefill", &masked_prefill); }
