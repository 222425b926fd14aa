// Decode attention with the per-slot depth mask (rule and layout: masked_common.h): one query
// token per request, at seq_len - 1; the step's own key (j = seq_len - 1) is visible unless
// mask_step_tokens. A sliding window W > 0 keeps keys seq_len - W .. seq_len - 1.
//
// Work is split over (request, kv head); each task reads its K/V blocks once for the G query
// heads that share them (online softmax, fp32 accumulation). This file also declares the
// library's ops (masked_prefill.cpp implements the other one).

#include "masked_common.h"

namespace {

// The fast path: block size a multiple of 16, head size 16 * ND. One task per (request, KV head)
// walks its blocks once; each block is updated for the G query heads in groups of GT (the
// block stays in L1 between groups); the next block is prefetched while this one is computed.
template <typename T, int ND, int GT>
void masked_decode_vec(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                       const at::Tensor& value_cache, const at::Tensor& seq_lens,
                       const at::Tensor& block_table, const int16_t* record, int64_t layer,
                       double scale, int64_t window, bool mask_step_tokens) {
  constexpr int64_t D = 16 * ND;
  const int64_t R = query.size(0), H = query.size(1);
  const int64_t KVH = key_cache.size(1), BS = key_cache.size(2);
  const int64_t G = H / KVH, num_blocks = key_cache.size(0);
  const int64_t ks0 = key_cache.stride(0), ks1 = key_cache.stride(1);
  const int64_t vs0 = value_cache.stride(0), vs1 = value_cache.stride(1);
  const int64_t bts = block_table.stride(0);
  const T* kbase = key_cache.data_ptr<T>();
  const T* vbase = value_cache.data_ptr<T>();
  const float* q = query.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const float fscale = static_cast<float>(scale);
  const float neg_inf = -std::numeric_limits<float>::infinity();

  at::parallel_for(0, R * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qs(G * D), acc(G * D), m(G), l(G), s(GT * BS), probs(GT * BS);
    std::vector<uint8_t> vis(BS);
    std::vector<int32_t> rows(BS);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / KVH, h = task % KVH;
      const int64_t len = lens[r];
      const float* qh = q + (r * H + h * G) * D;
      for (int64_t i = 0; i < G * D; ++i) qs[i] = qh[i] * fscale;  // scale folded into q
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), neg_inf);
      std::fill(l.begin(), l.end(), 0.f);
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t nblk = (len + BS - 1) / BS;
      for (int64_t b = first / BS; b < nblk; ++b) {
        const int64_t block = table[r * bts + b];
        TORCH_CHECK(block >= 0 && block < num_blocks, "request ", r, ": block id ", block,
                    " outside the cache's ", num_blocks, " blocks");
        if (b + 1 < nblk) {
          const int64_t next = table[r * bts + b + 1];
          if (next >= 0 && next < num_blocks) {
            prefetch_block(kbase + next * ks0 + h * ks1, D * BS);
            prefetch_block(vbase + next * vs0 + h * vs1, D * BS);
          }
        }
        const int64_t nvis = block_visibility(vis.data(), rows.data(), b, BS, len, first,
                                              record, block, layer, mask_step_tokens);
        if (nvis == 0) continue;
        const T* kb = kbase + block * ks0 + h * ks1;  // K^T: [D][BS]
        const T* vb = vbase + block * vs0 + h * vs1;  // V: [BS][D]
        for (int64_t g0 = 0; g0 < G; g0 += GT) {  // the block stays in L1 across the groups
          update_group<T, ND, GT>(kb, vb, BS, vis.data(), rows.data(), nvis, qs.data() + g0 * D,
                                  acc.data() + g0 * D, m.data() + g0, l.data() + g0, s.data(),
                                  probs.data());
        }
      }
      float* oh = o + (r * H + h * G) * D;
      for (int64_t g = 0; g < G; ++g) {
        const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
        for (int64_t d = 0; d < D; ++d) oh[g * D + d] = acc[g * D + d] * inv;
      }
    }
  });
}

// Any other shape: the same computation in plain loops.
template <typename T>
void masked_decode_impl(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                        const at::Tensor& value_cache, const at::Tensor& seq_lens,
                        const at::Tensor& block_table, const int16_t* record, int64_t layer,
                        double scale, int64_t window, bool mask_step_tokens) {
  const int64_t R = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t KVH = key_cache.size(1), BS = key_cache.size(2);
  const int64_t G = H / KVH, num_blocks = key_cache.size(0);
  const int64_t ks0 = key_cache.stride(0), ks1 = key_cache.stride(1);
  const int64_t vs0 = value_cache.stride(0), vs1 = value_cache.stride(1);
  const int64_t bts = block_table.stride(0);
  const T* kbase = key_cache.data_ptr<T>();
  const T* vbase = value_cache.data_ptr<T>();
  const float* q = query.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const float fscale = static_cast<float>(scale);
  const float neg_inf = -std::numeric_limits<float>::infinity();

  at::parallel_for(0, R * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qs(G * D), acc(G * D), m(G), l(G), s(BS), p(BS), probs(G * BS);
    std::vector<uint8_t> vis(BS);
    std::vector<int32_t> rows(BS);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / KVH, h = task % KVH;
      const int64_t len = lens[r];
      const float* qh = q + (r * H + h * G) * D;
      for (int64_t i = 0; i < G * D; ++i) qs[i] = qh[i] * fscale;  // scale folded into q
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), neg_inf);
      std::fill(l.begin(), l.end(), 0.f);
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t nblk = (len + BS - 1) / BS;
      for (int64_t b = first / BS; b < nblk; ++b) {
        const int64_t block = table[r * bts + b];
        TORCH_CHECK(block >= 0 && block < num_blocks, "request ", r, ": block id ", block,
                    " outside the cache's ", num_blocks, " blocks");
        const int64_t nvis = block_visibility(vis.data(), rows.data(), b, BS, len, first,
                                              record, block, layer, mask_step_tokens);
        if (nvis == 0) continue;
        const T* kb = kbase + block * ks0 + h * ks1;  // K^T: [D][BS]
        const T* vb = vbase + block * vs0 + h * vs1;  // V: [BS][D]
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qs.data() + g * D;
          for (int64_t i = 0; i < BS; ++i) s[i] = 0.f;
          for (int64_t d = 0; d < D; ++d) {
            const float qd = qg[d];
            const T* kd = kb + d * BS;
            for (int64_t i = 0; i < BS; ++i) s[i] += qd * as_float(kd[i]);
          }
          float mb = neg_inf;
          for (int64_t i = 0; i < BS; ++i) {
            s[i] = vis[i] ? s[i] : neg_inf;  // a NaN K in a hidden slot is dropped here
            mb = std::max(mb, s[i]);
          }
          const float mnew = std::max(m[g], mb);
          const float corr = m[g] == neg_inf ? 0.f : exp_nonpositive(m[g] - mnew);
          float sum = 0.f;
          for (int64_t i = 0; i < BS; ++i) {
            const float e = exp_nonpositive(s[i] - mnew);
            p[i] = vis[i] ? e : 0.f;
            sum += p[i];
          }
          l[g] = l[g] * corr + sum;
          m[g] = mnew;
          float* ag = acc.data() + g * D;
          if (corr != 1.f)
            for (int64_t d = 0; d < D; ++d) ag[d] *= corr;
          float* pg = probs.data() + g * BS;
          for (int64_t i = 0; i < BS; ++i) pg[i] = p[i];
        }
        for (int64_t k = 0; k < nvis; ++k) {  // hidden V rows are never read
          const int64_t i = rows[k];
          const T* vr = vb + i * D;
          for (int64_t g = 0; g < G; ++g) {
            const float pi = probs[g * BS + i];
            float* ag = acc.data() + g * D;
            for (int64_t d = 0; d < D; ++d) ag[d] += pi * as_float(vr[d]);
          }
        }
      }
      float* oh = o + (r * H + h * G) * D;
      for (int64_t g = 0; g < G; ++g) {
        const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
        for (int64_t d = 0; d < D; ++d) oh[g * D + d] = acc[g * D + d] * inv;
      }
    }
  });
}

// The vector path for head size 16 * ND: the query heads of a KV head in groups of GT, the
// largest of 4, 3, 2, 1 that divides G, each group one task (few instances: each one adds
// about half a second to the build at engine start).
template <typename T, int ND>
void dispatch_group(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                    const at::Tensor& value_cache, const at::Tensor& seq_lens,
                    const at::Tensor& block_table, const int16_t* record, int64_t layer,
                    double scale, int64_t window, bool mask_step_tokens) {
  const int64_t G = query.size(1) / key_cache.size(1);
  switch (G % 4 == 0 ? 4 : G % 3 == 0 ? 3 : G % 2 == 0 ? 2 : 1) {
#define ADAPTIVE_GROUP_CASE(n)                                                                 \
  case n:                                                                                      \
    return masked_decode_vec<T, ND, n>(out, query, key_cache, value_cache, seq_lens,           \
                                       block_table, record, layer, scale, window,              \
                                       mask_step_tokens);
    ADAPTIVE_GROUP_CASE(1)
    ADAPTIVE_GROUP_CASE(2)
    ADAPTIVE_GROUP_CASE(3)
    ADAPTIVE_GROUP_CASE(4)
#undef ADAPTIVE_GROUP_CASE
  }
}

template <typename T>
void dispatch_shape(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                    const at::Tensor& value_cache, const at::Tensor& seq_lens,
                    const at::Tensor& block_table, const int16_t* record, int64_t layer,
                    double scale, int64_t window, bool mask_step_tokens) {
  if (key_cache.size(2) % 16 == 0) {
    switch (key_cache.size(3)) {
#define ADAPTIVE_HEAD_CASE(d)                                                                 \
  case d:                                                                                     \
    return dispatch_group<T, d / 16>(out, query, key_cache, value_cache, seq_lens,           \
                                     block_table, record, layer, scale, window,              \
                                     mask_step_tokens);
      ADAPTIVE_HEAD_CASE(64)
      ADAPTIVE_HEAD_CASE(80)
      ADAPTIVE_HEAD_CASE(96)
      ADAPTIVE_HEAD_CASE(128)
      ADAPTIVE_HEAD_CASE(256)
#undef ADAPTIVE_HEAD_CASE
      default:
        break;
    }
  }
  masked_decode_impl<T>(out, query, key_cache, value_cache, seq_lens, block_table, record, layer,
                        scale, window, mask_step_tokens);
}

void masked_decode(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                   const at::Tensor& value_cache, const at::Tensor& seq_lens,
                   const at::Tensor& block_table, const std::optional<at::Tensor>& depth_record,
                   int64_t layer, double scale, int64_t sliding_window, bool mask_step_tokens) {
  const int16_t* record = check_shared_args(out, query, "requests", key_cache, value_cache,
                                            block_table, query.size(0), depth_record);
  const int64_t BS = key_cache.size(2);
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() &&
                  seq_lens.numel() == query.size(0),
              "seq_lens must be contiguous int32 [requests]");
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t max_blocks = block_table.size(1);
  for (int64_t r = 0; r < query.size(0); ++r)
    TORCH_CHECK(lens[r] >= 1 && (lens[r] + BS - 1) / BS <= max_blocks,
                "request ", r, ": seq_len ", lens[r], " needs more blocks than block_table has");
  switch (key_cache.scalar_type()) {
    case at::kFloat:
      dispatch_shape<float>(out, query, key_cache, value_cache, seq_lens, block_table, record,
                                layer, scale, sliding_window, mask_step_tokens);
      break;
    case at::kBFloat16:
      dispatch_shape<at::BFloat16>(out, query, key_cache, value_cache, seq_lens, block_table,
                                       record, layer, scale, sliding_window, mask_step_tokens);
      break;
    case at::kHalf:  // rare on CPUs: the plain loops (fewer instances to build)
      masked_decode_impl<at::Half>(out, query, key_cache, value_cache, seq_lens, block_table,
                                   record, layer, scale, sliding_window, mask_step_tokens);
      break;
    default:
      TORCH_CHECK(false, "cache dtype must be float32, bfloat16 or float16, got ",
                  key_cache.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY(vllm_adaptive_native, m) {
  m.def(
      "masked_decode(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor seq_lens, Tensor block_table, Tensor? depth_record, int layer, float scale, "
      "int sliding_window, bool mask_step_tokens) -> ()");
  m.def(
      "masked_prefill(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor query_start_loc, Tensor seq_lens, Tensor block_table, Tensor? query_positions, "
      "Tensor? requests, Tensor? depth_record, int layer, float scale, int sliding_window, "
      "bool mask_step_tokens) -> ()");
}

TORCH_LIBRARY_IMPL(vllm_adaptive_native, CPU, m) { m.impl("masked_decode", &masked_decode); }
