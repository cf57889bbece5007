// Decode attention over the paged KV cache, reading K/V rows in place through the block
// table (no gathered copy of the context).
//
// One work item is (sequence, KV head): its group of query heads (GQA) is scored against
// each cached K row as the row is read, so every K and V byte is read once per step.
// Work items are spread over the OpenMP threads dynamically, since contexts differ in length.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace pagedserve_cpu {

namespace {

// Loads context position t's row (one KV head, D vectors) through the block table.
template <int D>
inline void load_row(const float* cache, const int32_t* block_table, int64_t t, int64_t block_size,
                     int64_t slot_stride, vf* row) {
  const int64_t slot = int64_t(block_table[t / block_size]) * block_size + t % block_size;
  const float* p = cache + slot * slot_stride;
  for (int i = 0; i < D; ++i) row[i] = vload(p + i * kVec);
}

// scores[j][t] = scale * <q_j, k_t>, then softmax over t, then out_j = sum_t p[j][t] v_t.
// D = head_dim / 16 vectors per row.
template <int D>
void attend_one(const float* q,  // [group, D*16], row stride q_stride
                int64_t q_stride, int group, const float* key_cache, const float* value_cache,
                const int32_t* block_table, int64_t seq_len, int64_t block_size,
                int64_t slot_stride,  // floats between consecutive slots (num_kv_heads * head_dim)
                float scale, float* scores,  // [group, row_stride] scratch
                int64_t row_stride,
                float* out, int64_t out_stride) {
  for (int64_t t = 0; t < seq_len; ++t) {
    vf kv[D];
    load_row<D>(key_cache, block_table, t, block_size, slot_stride, kv);
    for (int j = 0; j < group; ++j) {
      const float* qj = q + j * q_stride;
      vf acc = vload(qj) * kv[0];
      for (int i = 1; i < D; ++i) acc += vload(qj + i * kVec) * kv[i];
      scores[j * row_stride + t] = vsum(acc) * scale;
    }
  }
  // Softmax in float32, max subtracted first (as torch.softmax). Rows are padded to a
  // multiple of 16 in the scratch buffer (see decode_all), so every loop runs on full vectors;
  // the padding scores are -inf and come out as 0.
  const int64_t padded = (seq_len + kVec - 1) / kVec * kVec;
  for (int j = 0; j < group; ++j) {
    float* s = scores + j * row_stride;
    for (int64_t t = seq_len; t < padded; ++t) s[t] = -std::numeric_limits<float>::infinity();
    vf mv = vsplat(-std::numeric_limits<float>::infinity());
    for (int64_t t = 0; t < padded; t += kVec) {
      const vf v = vload(s + t);
      mv = v > mv ? v : mv;
    }
    float m = mv[0];
    for (int i = 1; i < kVec; ++i) m = std::max(m, mv[i]);
    const vf mm = vsplat(m);
    vf sv = vzero();
    for (int64_t t = 0; t < padded; t += kVec) {
      const vf e = vexp(vload(s + t) - mm);
      vstore(s + t, e);
      sv += e;
    }
    const vf inv = vsplat(1.f / vsum(sv));
    for (int64_t t = 0; t < padded; t += kVec) vstore(s + t, vload(s + t) * inv);
  }
  constexpr int kMaxGroup = 8;
  for (int j0 = 0; j0 < group; j0 += kMaxGroup) {
    const int g = std::min(kMaxGroup, group - j0);
    vf acc[kMaxGroup][D];
    for (int j = 0; j < g; ++j)
      for (int i = 0; i < D; ++i) acc[j][i] = vzero();
    for (int64_t t = 0; t < seq_len; ++t) {
      vf vv[D];
      load_row<D>(value_cache, block_table, t, block_size, slot_stride, vv);
      for (int j = 0; j < g; ++j) {
        const vf p = vsplat(scores[(j0 + j) * row_stride + t]);
        for (int i = 0; i < D; ++i) acc[j][i] += p * vv[i];
      }
    }
    for (int j = 0; j < g; ++j)
      for (int i = 0; i < D; ++i) vstore(out + (j0 + j) * out_stride + i * kVec, acc[j][i]);
  }
}

template <int D>
void decode_all(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                at::Tensor& out) {
  const int64_t num_seqs = query.size(0), num_heads = query.size(1);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t head_dim = key_cache.size(3);
  const int group = int(num_heads / num_kv_heads);
  const int64_t slot_stride = num_kv_heads * head_dim;
  const float* q = query.data_ptr<float>();
  const int64_t q_seq_stride = query.stride(0), q_head_stride = query.stride(1);
  const float* kc = key_cache.data_ptr<float>();
  const float* vc = value_cache.data_ptr<float>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int64_t bt_stride = block_tables.stride(0);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  float* o = out.data_ptr<float>();
  const int64_t max_len = num_seqs ? *std::max_element(lens, lens + num_seqs) : 0;
  const int64_t items = num_seqs * num_kv_heads;
  // grain 1: items differ in cost (context length), and there are few of them.
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    const int64_t row_stride = (std::max<int64_t>(max_len, 1) + kVec - 1) / kVec * kVec;
    std::vector<float> scores(size_t(group) * size_t(row_stride));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = item / num_kv_heads, h = item % num_kv_heads;
      attend_one<D>(q + i * q_seq_stride + h * group * q_head_stride, q_head_stride, group,
                    kc + h * head_dim, vc + h * head_dim, bt + i * bt_stride, lens[i], block_size,
                    slot_stride, float(scale), scores.data(), row_stride,
                    o + (i * num_heads + h * group) * head_dim, head_dim);
    }
  });
}

}  // namespace

at::Tensor paged_attention_decode(const at::Tensor& query,  // [num_seqs, num_heads, head_dim]
                                  const at::Tensor& key_cache,  // [blocks, block_size, kv_heads, head_dim]
                                  const at::Tensor& value_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(query.scalar_type() == at::kFloat && key_cache.scalar_type() == at::kFloat &&
                  value_cache.scalar_type() == at::kFloat,
              "paged_attention_decode: float32 only");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "paged_attention_decode: block_tables and seq_lens must be int32");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(query.stride(2) == 1, "query rows must be contiguous in head_dim");
  TORCH_CHECK(block_tables.stride(1) == 1 && seq_lens.is_contiguous());
  const int64_t head_dim = query.size(2);
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  auto out = at::empty({query.size(0), query.size(1), head_dim}, query.options());
  switch (head_dim) {
    case 64: decode_all<4>(query, key_cache, value_cache, block_tables, seq_lens, scale, out); break;
    case 128: decode_all<8>(query, key_cache, value_cache, block_tables, seq_lens, scale, out); break;
    case 32: decode_all<2>(query, key_cache, value_cache, block_tables, seq_lens, scale, out); break;
    case 96: decode_all<6>(query, key_cache, value_cache, block_tables, seq_lens, scale, out); break;
    case 256: decode_all<16>(query, key_cache, value_cache, block_tables, seq_lens, scale, out); break;
    default: TORCH_CHECK(false, "paged_attention_decode: unsupported head_dim ", head_dim);
  }
  return out;
}

}  // namespace pagedserve_cpu
