// Attention over the paged KV cache for query rows that each carry their own block-table row
// and context length: decodes (one row per sequence) and prefill chunks (one row per token,
// context position + 1, which is causal attention), reading K/V in place through the table.
//
// A decode is one work item for every KV head (attend_span): each cached slot (all KV heads'
// K rows, adjacent in memory) is read once, in order, and scored against its query heads
// (GQA groups) as it is read, so every K and V byte is read once per step. Decodes too few
// for the threads (batch 1) are split along their context and merged (decode_all). A run of
// rows continuing one sequence (a prefill chunk) is an item per KV head: it reads its
// context once into a transposed K and scores several rows' query vectors together, one
// position per vector lane, with no horizontal sum per score, which makes prefill attention
// much faster than row by row. A short run (at most kMaxShortRun rows: a speculative
// verification) is split along its context like a decode (attend_rows_span): each slot is
// read once and scored against every row and query head of the run.
//
// A sliding window (sliding_window > 0) moves the start of each row's keys to
// max(0, len - sliding_window): a decode's spans cover only that range, and a run's rows
// mask the positions before their own start (window_start below).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <tuple>
#include <type_traits>
#include <vector>

#include "kv_quant.h"
#include "ops.h"
#include "team.h"
#include "vec.h"

namespace pagedserve_cpu {

namespace {

// How a KV cache of element type T holds one (slot, KV head) row: float32 caches hold
// head_dim floats; int8 and fp8 caches (--kv-cache-dtype int8|fp8) head_dim 8-bit values and
// then the row's float16 scale, value = q * scale (kernels/kv_quant.py; K rows hold the keys'
// Hadamard transform, so the query comes transformed too: paged_attention_decode_into). The
// float path multiplies by no scale at all (if constexpr), so it stays bitwise what it was.
// An fp8 row's values are read as q * 2^-8 and its scale as s * 2^8 (kv_quant.h: the
// half-precision decode), whose products are q * s exactly.
template <typename T>
struct Row;
template <>
struct Row<float> {
  static constexpr bool kQuantized = false;
  static constexpr int64_t kExtra = 0;  // elements after a row's head_dim values
  static vf load(const float* p) { return vload(p); }
  static float at(const float* p, int64_t d) { return p[d]; }
  static float scale(const float*, int64_t) { return 1.f; }
};
template <>
struct Row<int8_t> {
  static constexpr bool kQuantized = true;
  static constexpr int64_t kExtra = kScaleBytes;  // the float16 scale
  static vf load(const int8_t* p) { return vload_i8(p); }
  static float at(const int8_t* p, int64_t d) { return float(p[d]); }
  static float scale(const int8_t* row, int64_t head_dim) { return load_scale(row, head_dim); }
};
template <>
struct Row<Fp8> {
  static constexpr bool kQuantized = true;
  static constexpr int64_t kExtra = kScaleBytes;  // the float16 scale
  static vf load(const Fp8* p) { return vload_e4m3_scaled(p); }
  static float at(const Fp8* p, int64_t d) { return kE4m3Scaled[p[d].x]; }
  static float scale(const Fp8* row, int64_t head_dim) { return load_scale(row, head_dim) * kE4m3Unscale; }
};

// A row's D vectors (its head_dim values) as Row<T>::load reads them. fp8: decoded without
// the NaN select, then fixed up only in a row that holds a NaN byte (e4m3_has_nan).
template <typename T, int D>
inline void load_row(const T* p, vf* out) {
  if constexpr (std::is_same_v<T, Fp8>) {
    for (int i = 0; i < D; ++i) out[i] = vload_e4m3_scaled_raw(p + i * kVec);
    if (__builtin_expect(e4m3_has_nan(p, D * kVec), 0))
      for (int i = 0; i < D; ++i) out[i] = e4m3_fix_nan(out[i]);
  } else {
    for (int i = 0; i < D; ++i) out[i] = Row<T>::load(p + i * kVec);
  }
}

// Calls f(t - t0, row) for context positions t in [t0, t1), row pointing at position t's slot
// (one KV head's head_dim floats) through the block table: the block is looked up once per
// block, not with a division per position. With `prefetch` > 0, each call first prefetches
// that many floats from the same slot of the next block in the table.
template <typename T, typename F>
inline void for_each_slot(const T* cache, const int32_t* block_table, int64_t t0, int64_t t1,
                          int64_t block_size, int64_t slot_stride, F&& f, int64_t prefetch = 0) {
  for (int64_t b = t0 / block_size, t = t0; t < t1; ++b) {
    const T* p = cache + int64_t(block_table[b]) * block_size * slot_stride;
    const int64_t end = std::min((b + 1) * block_size, t1);
    if (prefetch && end < t1) {
      const T* pn = cache + int64_t(block_table[b + 1]) * block_size * slot_stride;
      for (; t < end; ++t) {
        const T* nx = pn + (t - b * block_size) * slot_stride;
        for (int64_t off = 0; off < prefetch; off += 64 / int64_t(sizeof(T))) __builtin_prefetch(nx + off, 0, 3);
        f(t - t0, p + (t - b * block_size) * slot_stride);
      }
      continue;
    }
    for (; t < end; ++t) f(t - t0, p + (t - b * block_size) * slot_stride);
  }
}

// Over one score row of len positions, padded with -inf to a multiple of kVec (the scratch
// rows are, see decode_all): s[t] = exp(s[t] - max), so every loop runs on full vectors and
// the padding comes out as 0. Returns (max, sum of the exponentials).
inline std::pair<float, float> exp_row(float* s, int64_t len) {
  const int64_t padded = (len + kVec - 1) / kVec * kVec;
  for (int64_t t = len; t < padded; ++t) s[t] = -std::numeric_limits<float>::infinity();
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
  return {m, vsum(sv)};
}

// Softmax in float32 over each of `group` score rows, max subtracted first (as torch.softmax).
inline void softmax_rows(float* scores, int group, int64_t row_stride, int64_t seq_len) {
  const int64_t padded = (seq_len + kVec - 1) / kVec * kVec;
  for (int j = 0; j < group; ++j) {
    float* s = scores + j * row_stride;
    const vf inv = vsplat(1.f / exp_row(s, seq_len).second);
    for (int64_t t = 0; t < padded; t += kVec) vstore(s + t, vload(s + t) * inv);
  }
}

// out_j = sum_t p[j][t - t0] v_t over context positions [t0, t1), for G heads at once
// (G is a template parameter so the G x D accumulators stay in registers).
template <typename T, int D, int G>
inline void weighted_values_g(const float* scores, int64_t row_stride, const T* value_cache,
                              const int32_t* block_table, int64_t t0, int64_t t1, int64_t block_size,
                              int64_t slot_stride, float* out, int64_t out_stride, int64_t prefetch = 0) {
  vf acc[G][D];
  for (int j = 0; j < G; ++j)
    for (int i = 0; i < D; ++i) acc[j][i] = vzero();
  for_each_slot(value_cache, block_table, t0, t1, block_size, slot_stride, [&](int64_t t, const T* v) {
    vf vv[D];
    load_row<T, D>(v, vv);
    [[maybe_unused]] const float v_scale = Row<T>::scale(v, D * kVec);
    for (int j = 0; j < G; ++j) {
      float pj = scores[j * row_stride + t];
      if constexpr (Row<T>::kQuantized) pj *= v_scale;  // sum_t (p_t * s_t) v_q,t
      const vf p = vsplat(pj);
      for (int i = 0; i < D; ++i) acc[j][i] += p * vv[i];
    }
  }, prefetch);
  for (int j = 0; j < G; ++j)
    for (int i = 0; i < D; ++i) vstore(out + j * out_stride + i * kVec, acc[j][i]);
}

// Accumulator registers a tile may use, leaving the rest for the operands: 24 of AVX-512's
// 32, 12 of AVX2's 16.
constexpr int kAccRegs = kRegs * 3 / 4;

// The whole group, in passes of at most min(6, kAccRegs / D) heads.
template <typename T, int D>
inline void weighted_values(const float* scores, int group, int64_t row_stride, const T* value_cache,
                            const int32_t* block_table, int64_t t0, int64_t t1, int64_t block_size,
                            int64_t slot_stride, float* out, int64_t out_stride, int64_t prefetch = 0) {
  constexpr int kPass = D >= kAccRegs ? 1 : std::min(6, kAccRegs / D);  // the cases below go up to 6
  for (int j0 = 0; j0 < group; j0 += kPass) {
    const float* s = scores + j0 * row_stride;
    float* o = out + j0 * out_stride;
#define PS_WV(G) weighted_values_g<T, D, G>(s, row_stride, value_cache, block_table, t0, t1, block_size, slot_stride, o, out_stride, j0 == 0 ? prefetch : 0)
    switch (std::min(kPass, group - j0)) {
      case 1: PS_WV(1); break;
      case 2: if constexpr (kPass >= 2) PS_WV(2); break;
      case 3: if constexpr (kPass >= 3) PS_WV(3); break;
      case 4: if constexpr (kPass >= 4) PS_WV(4); break;
      case 5: if constexpr (kPass >= 5) PS_WV(5); break;
      default: if constexpr (kPass >= 6) PS_WV(6); break;
    }
#undef PS_WV
  }
}

// scores[j][t - t0] = scale * <q_j, k_t> for context positions t in [t0, t1) and query heads
// j < heads, head j reading KV head j / group (key_cache points at the first KV head's
// slice of slot 0): each slot's K rows are scored against their query heads as they are
// read, so a slot spanning several KV heads is one contiguous read. D = head_dim / kVec.
template <typename T, int D>
inline void score_slots(const float* q,  // [heads, D * kVec], row stride q_stride
                        int64_t q_stride, int heads, int group, const T* key_cache,
                        const int32_t* block_table, int64_t t0, int64_t t1, int64_t block_size,
                        int64_t slot_stride,  // elements between consecutive slots (num_kv_heads rows)
                        float scale, float* scores, int64_t row_stride, int64_t prefetch = 0,
                        intptr_t v_delta = 0) {  // v_delta: bytes from a K slot to its V slot, 0: no V prefetch
  constexpr int64_t row = D * kVec + Row<T>::kExtra;  // elements per KV head's row
  for_each_slot(key_cache, block_table, t0, t1, block_size, slot_stride, [&](int64_t t, const T* slot) {
    if (v_delta) {
      const char* v = reinterpret_cast<const char*>(slot) + v_delta;
      const int64_t bytes = slot_stride * int64_t(sizeof(T));
      for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(v + off, 0, 3);
    }
    for (int j0 = 0; j0 < heads; j0 += group) {
      const T* k = slot + (j0 / group) * row;
      vf kv[D];
      load_row<T, D>(k, kv);
      [[maybe_unused]] const float k_scale = Row<T>::scale(k, D * kVec) * scale;
      for (int j = j0; j < j0 + group; ++j) {
        const float* qj = q + j * q_stride;
        vf acc = vload(qj) * kv[0];
        for (int i = 1; i < D; ++i) acc += vload(qj + i * kVec) * kv[i];
        if constexpr (Row<T>::kQuantized)
          scores[j * row_stride + t] = vsum(acc) * k_scale;  // <q, k_q> * s_k * scale
        else
          scores[j * row_stride + t] = vsum(acc) * scale;
      }
    }
  }, prefetch);
}

// One span [t0, t1) of a decode's context (t0 < t1), every query head at once: per query head
// n, the span's score max m[n], the sum of exp(score - m[n]) l[n], and
// out_n = sum_t exp(score_t - m[n]) v_t, not yet divided by the sum over all spans.
template <typename T, int D>
void attend_span(const float* q, int64_t q_stride, int64_t num_heads, int64_t num_kv_heads,
                 const T* key_cache, const T* value_cache, const int32_t* block_table, int64_t t0,
                 int64_t t1, int64_t block_size, float scale, float* scores, int64_t row_stride, float* m,
                 float* l, float* out, bool prefetch_values) {
  constexpr int64_t row = D * kVec + Row<T>::kExtra;  // elements per KV head's row
  const int group = int(num_heads / num_kv_heads);
  const int64_t slot_stride = num_kv_heads * row;
  // Each slot read prefetches the same slot of the next block (blocks are scattered, so the
  // hardware prefetcher restarts at each); it pays at every batch size.
  const int64_t pf = slot_stride;
  // With `prefetch_values`, scoring a slot's K also prefetches its V, which the weighted sum
  // reads after the whole span's scores: the K and V streams are then in flight together
  // (a span's V fits in L2), which pays with cold caches at batch 16 and more. Off for a
  // context split in spans (batch 1), where it measured slightly slower.
  const intptr_t v_delta = prefetch_values ? reinterpret_cast<intptr_t>(value_cache) -
                                                 reinterpret_cast<intptr_t>(key_cache)
                                           : 0;
  score_slots<T, D>(q, q_stride, int(num_heads), group, key_cache, block_table, t0, t1, block_size, slot_stride,
                 scale, scores, row_stride, pf, v_delta);
  for (int64_t n = 0; n < num_heads; ++n) std::tie(m[n], l[n]) = exp_row(scores + n * row_stride, t1 - t0);
  for (int64_t h = 0; h < num_kv_heads; ++h)
    weighted_values<T, D>(scores + h * group * row_stride, group, row_stride, value_cache + h * row, block_table,
                          t0, t1, block_size, slot_stride, out + h * group * D * kVec, D * kVec, h == 0 ? pf : 0);
}

// Up to kTileQ query vectors (rows x heads) scored together, so each transposed-K vector
// loaded serves them all: a row at a time, a long context's K would stream from L2 once per
// row. 12 with AVX-512, 6 with AVX2 (two positions' vectors per query: kAccRegs).
constexpr int kTileQ = kAccRegs / 2;

// s_n[t0 + kVec*b + l] = scale * <q_n, k_(t0 + kVec*b + l)> for NQ query vectors and TB blocks
// of kVec positions from a transposed K ([head_dim][ldk]): the dot products run along the vector
// lanes (one position per lane), so there is no horizontal sum per score as in attend_one.
template <int NQ, int TB>
inline void score_tile(const float* const* q, float* const* s, const float* kt, int64_t ldk,
                       int64_t head_dim, int64_t t0, float scale) {
  // With few accumulators, split the head_dim sum over S interleaved ones so NQ x TB x S
  // independent FMA chains hide the FMA latency (head_dim is a multiple of 16 >= 8 = S).
  constexpr int S = NQ * TB >= 8 ? 1 : NQ * TB >= 4 ? 2 : NQ * TB >= 2 ? 4 : 8;
  vf acc[S][NQ][TB];
  for (int u = 0; u < S; ++u)
    for (int n = 0; n < NQ; ++n)
      for (int b = 0; b < TB; ++b) acc[u][n][b] = vzero();
  for (int64_t d0 = 0; d0 < head_dim; d0 += S) {
    for (int u = 0; u < S; ++u) {
      const int64_t d = d0 + u;
      vf k[TB];
      for (int b = 0; b < TB; ++b) k[b] = vload(kt + d * ldk + t0 + b * kVec);
      for (int n = 0; n < NQ; ++n) {
        const vf qd = vbcast(q[n] + d);
        for (int b = 0; b < TB; ++b) acc[u][n][b] += qd * k[b];
      }
    }
  }
  const vf sc = vsplat(scale);
  for (int n = 0; n < NQ; ++n)
    for (int b = 0; b < TB; ++b) {
      vf a = acc[0][n][b];
      for (int u = 1; u < S; ++u) a += acc[u][n][b];
      vstore(s[n] + t0 + b * kVec, a * sc);
    }
}

// Positions [0, padded) for nq <= kTileQ query vectors: 4 vectors of positions per pass
// while NQ x 4 accumulators fit in kAccRegs, else 2; then the one-vector tail.
template <int NQ>
inline void score_span(const float* const* q, float* const* s, const float* kt, int64_t ldk,
                       int64_t head_dim, int64_t padded, float scale) {
  constexpr int TB = NQ * 4 <= kAccRegs ? 4 : 2;
  int64_t t0 = 0;
  for (; t0 + TB * kVec <= padded; t0 += TB * kVec) score_tile<NQ, TB>(q, s, kt, ldk, head_dim, t0, scale);
  for (; t0 < padded; t0 += kVec) score_tile<NQ, 1>(q, s, kt, ldk, head_dim, t0, scale);
}

inline void score_vectors(int nq, const float* const* q, float* const* s, const float* kt, int64_t ldk,
                          int64_t head_dim, int64_t padded, float scale) {
  switch (nq) {
#define PS_CASE(N) \
  case N:          \
    if constexpr (N <= kTileQ) return score_span<N>(q, s, kt, ldk, head_dim, padded, scale); \
    break;
    PS_CASE(1) PS_CASE(2) PS_CASE(3) PS_CASE(4) PS_CASE(5) PS_CASE(6)
    PS_CASE(7) PS_CASE(8) PS_CASE(9) PS_CASE(10) PS_CASE(11) PS_CASE(12)
#undef PS_CASE
    default: TORCH_CHECK(false, "score_vectors: at most ", kTileQ, " query vectors per tile");
  }
}

// How many rows of a run are scored together: as many whole groups of query heads as fit in
// one tile (at least one row).
inline int64_t rows_per_tile(int group) { return std::max(1, kTileQ / group); }

// The longest run of rows attend_rows_span takes (decode_all's short runs).
constexpr int64_t kMaxShortRun = 16;

// A run of query rows of one sequence at consecutive positions (a prefill chunk): row r sees
// seq_len0 + r context positions. The run's context is read through the block table once,
// into a transposed K; rows_per_tile rows at a time are scored against it (score_tile), each
// scored row position past a row's own context is discarded by softmax_rows.
// scores: [rows_per_tile(group) * group, row_stride] scratch.
// The first context position a row of a len-position context sees (0 without a window).
inline int64_t window_start(int64_t len, int64_t sliding_window) {
  return sliding_window > 0 ? std::max<int64_t>(0, len - sliding_window) : 0;
}

template <typename T, int D>
void attend_run(const float* q, int64_t q_row_stride, int64_t q_stride, int group, int64_t rows,
                const T* key_cache, const T* value_cache, const int32_t* block_table,
                int64_t seq_len0, int64_t block_size, int64_t slot_stride, float scale,
                float* scores, int64_t row_stride, std::vector<float>& kt_buf, float* out,
                int64_t out_row_stride, int64_t out_stride, int64_t sliding_window) {
  constexpr int64_t head_dim = D * kVec;
  const int64_t ctx = seq_len0 + rows - 1;  // the last row's context
  const int64_t ldk = (ctx + kVec - 1) / kVec * kVec;
  if (int64_t(kt_buf.size()) < head_dim * ldk) kt_buf.resize(size_t(head_dim * ldk));
  float* kt = kt_buf.data();
  for_each_slot(key_cache, block_table, 0, ctx, block_size, slot_stride, [&](int64_t t, const T* k) {
    if constexpr (Row<T>::kQuantized) {  // de-quantized as the reference does: float(q) * s
      const float s = Row<T>::scale(k, head_dim);
      for (int64_t d = 0; d < head_dim; ++d) kt[d * ldk + t] = Row<T>::at(k, d) * s;
    } else {
      for (int64_t d = 0; d < head_dim; ++d) kt[d * ldk + t] = k[d];
    }
  });
  // padding positions: finite, so their (discarded) scores are too
  for (int64_t d = 0; d < head_dim; ++d)
    for (int64_t t = ctx; t < ldk; ++t) kt[d * ldk + t] = 0.f;
  // Every row's weighted sum reads the whole context's V again. An fp8 V is de-quantized
  // once into float rows (q * s, the reference's values) that the rows read instead: its
  // decode costs several instructions a vector (kv_quant.h), where int8's two cost less
  // than the extra pass (benchmarks/RESULTS.md).
  constexpr bool kDecodeValuesOnce = std::is_same_v<T, Fp8>;
  thread_local std::vector<float> tl_values;
  const int32_t one_block = 0;  // the float rows as one block of ctx positions
  if constexpr (kDecodeValuesOnce) {
    if (int64_t(tl_values.size()) < ctx * head_dim) tl_values.resize(size_t(ctx * head_dim));
    float* vrows = tl_values.data();
    for_each_slot(value_cache, block_table, 0, ctx, block_size, slot_stride, [&](int64_t t, const T* v) {
      const vf s = vsplat(Row<T>::scale(v, head_dim));
      vf vv[D];
      load_row<T, D>(v, vv);
      for (int i = 0; i < D; ++i) vstore(vrows + t * head_dim + i * kVec, vv[i] * s);
    });
  }
  const int64_t tile_rows = rows_per_tile(group);
  for (int64_t r0 = 0; r0 < rows; r0 += tile_rows) {
    const int64_t nr = std::min(tile_rows, rows - r0);
    const int64_t last_len = seq_len0 + r0 + nr - 1;
    const int64_t padded = (last_len + kVec - 1) / kVec * kVec;
    // The tile's query vectors, (row, head) in order; more than kTileQ only when one row's
    // group alone is larger (then nr == 1), scored kTileQ at a time.
    const int64_t nq = nr * group;
    const float* qv[kTileQ];
    float* sv[kTileQ];
    for (int64_t n0 = 0; n0 < nq; n0 += kTileQ) {
      const int m = int(std::min<int64_t>(kTileQ, nq - n0));
      for (int i = 0; i < m; ++i) {
        const int64_t n = n0 + i, r = r0 + n / group, j = n % group;
        qv[i] = q + r * q_row_stride + j * q_stride;
        sv[i] = scores + n * row_stride;
      }
      score_vectors(m, qv, sv, kt, ldk, head_dim, padded, scale);
    }
    for (int64_t i = 0; i < nr; ++i) {
      const int64_t len = seq_len0 + r0 + i, start = window_start(len, sliding_window);
      float* si = scores + i * group * row_stride;
      for (int j = 0; j < group; ++j)  // before the window: weight exp(-inf) = 0
        std::fill_n(si + j * row_stride, start, -std::numeric_limits<float>::infinity());
      softmax_rows(si, group, row_stride, len);
      if constexpr (kDecodeValuesOnce)
        weighted_values<float, D>(si + start, group, row_stride, tl_values.data(), &one_block, start, len,
                                  std::max<int64_t>(ctx, 1), head_dim, out + (r0 + i) * out_row_stride, out_stride);
      else
        weighted_values<T, D>(si + start, group, row_stride, value_cache, block_table, start, len, block_size,
                              slot_stride, out + (r0 + i) * out_row_stride, out_stride);
    }
  }
}

// lane p = the sum of a[p]'s lanes, p < kVec: kVec horizontal sums in one vector. With
// AVX-512 a transpose-and-add tree (2 shuffles and an add per pair of vectors, then one
// permute): about 3 instructions a sum against 8 for a lone reduction, and one vector store.
static inline vf vsum_lanes(const vf* a) {
#if defined(__AVX512F__)
  __m512 x[8], y[4], z[2];
  for (int i = 0; i < 8; ++i) {  // x[i]: 256-bit halves = 8 partial sums of a[2i], of a[2i+1]
    const __m512 p = reinterpret_cast<__m512>(a[2 * i]), q = reinterpret_cast<__m512>(a[2 * i + 1]);
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(p, q, 0x44), _mm512_shuffle_f32x4(p, q, 0xEE));
  }
  for (int i = 0; i < 4; ++i)  // y[i]: 128-bit lane L = 4 partial sums of a[4i + L]
    y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // z[i]: lane L = 2 partial sums of a[8i + L], 2 of a[8i + 4 + L]
    z[i] = _mm512_add_ps(_mm512_shuffle_ps(y[2 * i], y[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(y[2 * i], y[2 * i + 1], 0xEE));
  // element 4L + s = the sum of a[L + 4s]; the permute puts the sum of a[p] at element p
  const __m512 w = _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], 0x88), _mm512_shuffle_ps(z[0], z[1], 0xDD));
  const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return reinterpret_cast<vf>(_mm512_permutexvar_ps(idx, w));
#else
  vf r;
  for (int p = 0; p < kVec; ++p) r[p] = vsum(a[p]);
  return r;
#endif
}

// A short run of `rows` query rows of one sequence at consecutive positions (a speculative
// verification's k + 1 rows, a short prefill chunk): row r sees context positions
// [window_start(len0 + r), len0 + r). Over one span [t0, t1) of the run's context, every
// row and query head at once: each cached slot is read once and scored against all of them
// as it is read, kVec positions at a time (vsum_lanes: no lone horizontal sum per score),
// so the run reads its context's K and V once, not once a row as row-by-row decodes did.
// Positions outside a row's own range score -inf. Results per query vector
// v = (h * rows + r) * group + j (KV head h's vectors adjacent, for weighted_values): the
// span's score max m[v] (-inf when the span holds none of row r's positions), the sum of
// exp(score - m[v]) l[v], and acc[v] = sum_t exp(score_t - m[v]) v_t, not yet divided.
// scores: rows * num_heads rows of row_stride >= (t1 - t0) rounded up to kVec.
template <typename T, int D>
void attend_rows_span(const float* q, int64_t q_row_stride, int64_t q_head_stride, int64_t rows,
                      int64_t num_heads, int64_t num_kv_heads, const T* key_cache, const T* value_cache,
                      const int32_t* block_table, int64_t len0, int64_t sliding_window, int64_t t0, int64_t t1,
                      int64_t block_size, float scale, float* scores, int64_t row_stride, float* m, float* l,
                      float* acc) {
  constexpr int64_t head_dim = D * kVec;
  constexpr int64_t row = head_dim + Row<T>::kExtra;  // elements per KV head's row
  const int group = int(num_heads / num_kv_heads);
  const int64_t slot_stride = num_kv_heads * row;
  const float ninf = -std::numeric_limits<float>::infinity();
  // Row r's positions inside the span: [lo[r], hi[r]), empty when lo >= hi.
  int64_t lo[kMaxShortRun], hi[kMaxShortRun];
  for (int64_t r = 0; r < rows; ++r) {
    lo[r] = std::max(t0, window_start(len0 + r, sliding_window));
    hi[r] = std::min(t1, len0 + r);
  }
  vf iota;
  for (int p = 0; p < kVec; ++p) iota[p] = float(p);
  const T* slot[kVec];
  int64_t b = t0 / block_size, off = t0 % block_size;  // the next position's block and offset
  for (int64_t tb = t0; tb < t1; tb += kVec) {
    // This tile's kVec slots through the block table; past t1, the last slot again (masked).
    for (int p = 0; p < kVec; ++p) {
      if (tb + p < t1) {
        slot[p] = key_cache + (int64_t(block_table[b]) * block_size + off) * slot_stride;
        if (++off == block_size) off = 0, ++b;
      } else {
        slot[p] = slot[p - 1];
      }
    }
    const vf tv = vsplat(float(tb)) + iota;  // positions (exact in float below 2^24)
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      vf ks = vsplat(scale);
      if constexpr (Row<T>::kQuantized)  // <q, k_q> * s_k * scale
        for (int p = 0; p < kVec; ++p) ks[p] = Row<T>::scale(slot[p] + h * row, head_dim) * scale;
      for (int64_t r = 0; r < rows; ++r) {
        if (lo[r] >= hi[r]) continue;
        const auto valid = (tv >= vsplat(float(lo[r]))) & (tv < vsplat(float(hi[r])));
        for (int j = 0; j < group; ++j) {
          const float* qj = q + r * q_row_stride + (h * group + j) * q_head_stride;
          vf qv[D];
          for (int i = 0; i < D; ++i) qv[i] = vload(qj + i * kVec);
          vf a[kVec];
          for (int p = 0; p < kVec; ++p) {
            const T* k = slot[p] + h * row;
            a[p] = qv[0] * Row<T>::load(k);
            for (int i = 1; i < D; ++i) a[p] += qv[i] * Row<T>::load(k + i * kVec);
          }
          const vf s = vsum_lanes(a) * ks;
          vstore(scores + ((h * rows + r) * group + j) * row_stride + (tb - t0), valid ? s : vsplat(ninf));
        }
      }
    }
  }
  const int64_t span = t1 - t0, padded = (span + kVec - 1) / kVec * kVec;
  for (int64_t h = 0; h < num_kv_heads; ++h)
    for (int64_t r = 0; r < rows; ++r)
      for (int j = 0; j < group; ++j) {
        const int64_t v = (h * rows + r) * group + j;
        float* s = scores + v * row_stride;
        if (lo[r] >= hi[r]) {  // nothing of row r here: weight 0 everywhere, merged away
          std::fill_n(s, padded, 0.f);
          m[v] = ninf;
          l[v] = 0.f;
        } else {
          std::tie(m[v], l[v]) = exp_row(s, span);
        }
      }
  for (int64_t h = 0; h < num_kv_heads; ++h) {
    const int64_t v0 = h * rows * group;
    weighted_values<T, D>(scores + v0 * row_stride, int(rows * group), row_stride, value_cache + h * row,
                          block_table, t0, t1, block_size, slot_stride, acc + v0 * head_dim, head_dim);
  }
}

template <typename T, int D>
void decode_all(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                at::Tensor& out, int64_t sliding_window) {
  const int64_t num_seqs = query.size(0), num_heads = query.size(1);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t head_dim = key_cache.size(3);
  const int group = int(num_heads / num_kv_heads);
  const int64_t row = head_dim + Row<T>::kExtra;  // elements per KV head's row
  const int64_t slot_stride = num_kv_heads * row;
  const float* q = query.data_ptr<float>();
  const int64_t q_seq_stride = query.stride(0), q_head_stride = query.stride(1);
  const T* kc = key_cache.data_ptr<T>();
  const T* vc = value_cache.data_ptr<T>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int64_t bt_stride = block_tables.stride(0);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  float* o = out.data_ptr<float>();
  const int64_t max_len = num_seqs ? *std::max_element(lens, lens + num_seqs) : 0;
  const int64_t bs_cols = block_tables.size(1);
  const int64_t threads = num_threads();
  // Runs: rows that continue one sequence at consecutive positions (the same block table,
  // context one longer each row) go to attend_run; other rows (decodes) are runs of one. A
  // long chunk is cut into at most kMaxPieces runs of at least kMinRunRows rows: enough
  // items to spread one prompt over the threads, few enough that re-reading the context into
  // each run's transposed K stays small next to the scoring.
  constexpr int64_t kMinRunRows = 32, kMaxPieces = 16;
  // A run of at most kMaxShortRun rows (a speculative verification's k + 1, a short chunk)
  // goes to attend_rows_span, in context spans like a decode: attend_run's fixed costs
  // (transposing the whole context's K, whatever the rows) are not paid back over so few
  // rows, and its one item per KV head leaves threads idle (3 items for 2 threads with the
  // default model), while attend_rows_span reads each slot once for all the run's rows and
  // splits over every thread.
  // The bookkeeping vectors below are thread_local and reused: allocated in every call they
  // were ~10 mallocs a layer, each a few cache misses after a step's weights streamed by.
  // NOTE: the workers below reach them through these references (a lambda does not capture
  // a thread_local: named inside it, it would be the worker's own, empty one).
  thread_local std::vector<int64_t> tl_whole, tl_run_start;
  std::vector<int64_t>& whole = tl_whole;
  std::vector<int64_t>& run_start = tl_run_start;
  whole.assign(1, 0);  // maximal runs first
  for (int64_t i = 1; i < num_seqs; ++i) {
    const bool continues =
        lens[i] == lens[i - 1] + 1 &&
        (bt_stride == 0 ||  // one table row broadcast to every row
         std::equal(bt + i * bt_stride,
                    bt + i * bt_stride + std::min<int64_t>(bs_cols, (lens[i] + block_size - 1) / block_size),
                    bt + (i - 1) * bt_stride));
    if (!continues) whole.push_back(i);
  }
  whole.push_back(num_seqs);
  run_start.clear();
  for (size_t w = 0; w + 1 < whole.size(); ++w) {
    const int64_t len = whole[w + 1] - whole[w];
    const int64_t piece = len <= kMaxShortRun ? len : std::max(kMinRunRows, (len + kMaxPieces - 1) / kMaxPieces);
    for (int64_t i = whole[w]; i < whole[w + 1]; i += piece) run_start.push_back(i);
  }
  run_start.push_back(num_seqs);
  const int64_t num_runs = int64_t(run_start.size()) - 1;
  // Work items. A decode is one item for all its KV heads: a slot's heads are adjacent in
  // memory, so the item reads its context's K and V blocks whole, in order. An item per
  // (decode, KV head) would read a fraction of every slot, the threads' reads interleaved,
  // which measured markedly slower at batch 16 and 64. When a step is decodes only and their
  // count does not divide over the threads (batch 1: one item for 2 threads), each decode's
  // context is cut into `spans` and the spans' partial softmaxes are merged after
  // (flash-decoding); that changes the summation order, not the math. A run of prefill rows
  // is one item per KV head.
  // Short runs split like decodes; with any among them, into `threads` spans each, so a
  // run (several decodes' work) is shared by every thread beside a step's plain decodes.
  const bool decodes_only = num_runs == num_seqs;
  int64_t longest_short = 1;  // rows of the longest short run
  bool short_only = num_runs > 0;
  for (int64_t r = 0; r < num_runs; ++r) {
    const int64_t rows = run_start[r + 1] - run_start[r];
    if (rows <= kMaxShortRun)
      longest_short = std::max(longest_short, rows);
    else
      short_only = false;
  }
  const int64_t spans = short_only && num_runs < 4 * threads
                            ? (decodes_only ? threads / std::gcd(num_seqs, threads) : threads)
                            : 1;
  struct Item {
    int64_t run, head, span;  // head -1: a decode's or short run's span, every KV head
    int64_t cost;
  };
  thread_local std::vector<Item> tl_items;
  std::vector<Item>& items = tl_items;
  items.clear();
  for (int64_t r = 0; r < num_runs; ++r) {
    const int64_t i = run_start[r], rows = run_start[r + 1] - i;
    if (rows <= kMaxShortRun)
      for (int64_t p = 0; p < spans; ++p) items.push_back({r, -1, p, rows * lens[i] / spans * num_kv_heads});
    else
      for (int64_t h = 0; h < num_kv_heads; ++h) items.push_back({r, h, 0, rows * (lens[i] + rows)});
  }
  // Items differ in cost (context length x rows), so threads take them one at a time from a
  // shared counter, costliest first (a static split of a prefill chunk's runs gives one thread
  // all the long contexts).
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const int64_t num_items = int64_t(items.size());
  // Split decodes' partial results, per (decode, span, query head): score max, exp-sum, and
  // the output not yet divided by the sum over the spans.
  thread_local std::vector<float> tl_part_m, tl_part_l, tl_part_acc;
  std::vector<float>&part_m = tl_part_m, &part_l = tl_part_l, &part_acc = tl_part_acc;
  if (spans > 1) {  // every entry is written by its span's item before the merge reads it
    part_m.resize(size_t(num_seqs * spans * num_heads));
    part_l.resize(part_m.size());
    part_acc.resize(part_m.size() * size_t(head_dim));
  }
  // Score rows per worker: a decode span needs every head's; a longer run, a tile's worth of
  // rows (row_stride: the longest context). A short run's span needs every row's, each only
  // as long as the longest such span (short_stride), not the context: rows x heads rows of
  // a long context would be many megabytes a thread, zeroed every call.
  const int64_t score_rows = std::max<int64_t>(num_heads, short_only ? 0 : rows_per_tile(group) * group);
  int64_t short_span = 0;
  for (int64_t r = 0; r < num_runs; ++r) {
    const int64_t i = run_start[r], rows = run_start[r + 1] - i;
    if (rows > 1 && rows <= kMaxShortRun)
      short_span = std::max(short_span, (lens[i] + rows - 1 - window_start(lens[i], sliding_window) + spans - 1) / spans);
  }
  const int64_t short_stride = (short_span + kVec - 1) / kVec * kVec;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(num_items, threads);
  parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    const int64_t row_stride = (std::max<int64_t>(max_len, 1) + kVec - 1) / kVec * kVec;
    // Each worker thread's own, reused (zeroed as the fresh vectors they replace were).
    thread_local std::vector<float> scores, kt, m, l, acc;
    scores.assign(std::max(size_t(score_rows) * size_t(row_stride), size_t(longest_short * num_heads * short_stride)),
                  0.f);
    m.assign(static_cast<size_t>(longest_short * num_heads), 0.f);
    l.assign(m.size(), 0.f);
    acc.assign(m.size() * static_cast<size_t>(head_dim), 0.f);
    for (int64_t n = next++; n < num_items; n = next++) {
      const Item& it = items[size_t(n)];
      const int64_t i = run_start[it.run], rows = run_start[it.run + 1] - i;
      if (it.head >= 0) {
        const int64_t h = it.head;
        attend_run<T, D>(q + i * q_seq_stride + h * group * q_head_stride, q_seq_stride, q_head_stride, group, rows,
                      kc + h * row, vc + h * row, bt + i * bt_stride, lens[i], block_size, slot_stride,
                      float(scale), scores.data(), row_stride, kt, o + (i * num_heads + h * group) * head_dim,
                      num_heads * head_dim, head_dim, sliding_window);
        continue;
      }
      // The spans cut the window [lo, len) of the context: of a run, from its first row's
      // first key to its last row's last.
      const int64_t len = lens[i] + rows - 1, lo = window_start(lens[i], sliding_window);
      const int64_t t0 = lo + (len - lo) * it.span / spans, t1 = lo + (len - lo) * (it.span + 1) / spans;
      const bool whole_context = spans == 1;
      if (rows > 1) {
        float* pm = m.data();  // per query vector, attend_rows_span's order
        float* pl = l.data();
        float* pacc = acc.data();
        const int64_t nv = rows * num_heads;
        if (t0 == t1) {
          std::fill_n(pm, nv, -std::numeric_limits<float>::infinity());
          std::fill_n(pl, nv, 0.f);
          std::fill_n(pacc, nv * head_dim, 0.f);
        } else {
          attend_rows_span<T, D>(q + i * q_seq_stride, q_seq_stride, q_head_stride, rows, num_heads, num_kv_heads, kc,
                                 vc, bt + i * bt_stride, lens[i], sliding_window, t0, t1, block_size, float(scale),
                                 scores.data(), short_stride, pm, pl, pacc);
        }
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t n2 = 0; n2 < num_heads; ++n2) {
            const int64_t v = ((n2 / group) * rows + r) * group + n2 % group;
            const float* src = pacc + v * head_dim;
            if (whole_context) {
              const vf inv = vsplat(1.f / pl[v]);
              for (int d = 0; d < D; ++d)
                vstore(o + ((i + r) * num_heads + n2) * head_dim + d * kVec, vload(src + d * kVec) * inv);
            } else {
              const int64_t k = ((i + r) * spans + it.span) * num_heads + n2;
              part_m[k] = pm[v];
              part_l[k] = pl[v];
              std::copy(src, src + head_dim, part_acc.data() + k * head_dim);
            }
          }
        continue;
      }
      float* pm = whole_context ? m.data() : part_m.data() + (i * spans + it.span) * num_heads;
      float* pl = whole_context ? l.data() : part_l.data() + (i * spans + it.span) * num_heads;
      float* pacc = whole_context ? acc.data() : part_acc.data() + (i * spans + it.span) * num_heads * head_dim;
      if (t0 == t1) {  // a context shorter than the span count: this span adds nothing
        std::fill_n(pm, num_heads, -std::numeric_limits<float>::infinity());
        std::fill_n(pl, num_heads, 0.f);
        std::fill_n(pacc, num_heads * head_dim, 0.f);
        continue;
      }
      attend_span<T, D>(q + i * q_seq_stride, q_head_stride, num_heads, num_kv_heads, kc, vc, bt + i * bt_stride, t0,
                     t1, block_size, float(scale), scores.data(), row_stride, pm, pl, pacc,
                     /*prefetch_values=*/whole_context);
      if (whole_context)
        for (int64_t n2 = 0; n2 < num_heads; ++n2) {
          const vf inv = vsplat(1.f / pl[n2]);
          for (int d = 0; d < D; ++d)
            vstore(o + (i * num_heads + n2) * head_dim + d * kVec, vload(pacc + n2 * head_dim + d * kVec) * inv);
        }
    }
  });
  if (spans == 1) return;
  // out = sum_p exp(m_p - M) acc_p / sum_p exp(m_p - M) l_p, M the max over the spans.
  for (int64_t i = 0; i < num_seqs; ++i)
    for (int64_t n = 0; n < num_heads; ++n) {
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t p = 0; p < spans; ++p) mx = std::max(mx, part_m[(i * spans + p) * num_heads + n]);
      float denom = 0.f;
      vf sum[D];
      for (int d = 0; d < D; ++d) sum[d] = vzero();
      for (int64_t p = 0; p < spans; ++p) {
        const int64_t k = (i * spans + p) * num_heads + n;
        const float w = std::exp(part_m[k] - mx);
        denom += w * part_l[k];
        const vf wv = vsplat(w);
        for (int d = 0; d < D; ++d) sum[d] += wv * vload(part_acc.data() + k * head_dim + d * kVec);
      }
      const vf inv = vsplat(1.f / denom);
      for (int d = 0; d < D; ++d) vstore(o + (i * num_heads + n) * head_dim + d * kVec, sum[d] * inv);
    }
}

template <typename T>
void decode_head_dim(int64_t head_dim, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                     double scale, at::Tensor& out, int64_t sliding_window) {
  switch (head_dim) {
    // decode_all<T, head_dim / kVec>: vectors per head row
    case 64: decode_all<T, 64 / kVec>(query, key_cache, value_cache, block_tables, seq_lens, scale, out, sliding_window); break;
    case 128: decode_all<T, 128 / kVec>(query, key_cache, value_cache, block_tables, seq_lens, scale, out, sliding_window); break;
    case 32: decode_all<T, 32 / kVec>(query, key_cache, value_cache, block_tables, seq_lens, scale, out, sliding_window); break;
    case 96: decode_all<T, 96 / kVec>(query, key_cache, value_cache, block_tables, seq_lens, scale, out, sliding_window); break;
    case 256: decode_all<T, 256 / kVec>(query, key_cache, value_cache, block_tables, seq_lens, scale, out, sliding_window); break;
    default: TORCH_CHECK(false, "paged_attention_decode: unsupported head_dim ", head_dim);
  }
}

}  // namespace

bool is_quantized_cache(const at::Tensor& cache) {
  if (cache.dim() != 4) return false;
  const int64_t row = cache.size(3) + kScaleBytes, kvh = cache.size(2), bs = cache.size(1);
  return cache.stride(3) == 1 && cache.stride(2) == row && cache.stride(1) == kvh * row &&
         cache.stride(0) == bs * kvh * row;
}

at::Tensor paged_attention_decode(const at::Tensor& query,  // [num_seqs, num_heads, head_dim]
                                  const at::Tensor& key_cache,  // [blocks, block_size, kv_heads, head_dim]
                                  const at::Tensor& value_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, double scale,
                                  c10::optional<int64_t> sliding_window) {
  auto out = at::empty({query.size(0), query.size(1), query.size(2)}, query.options());
  TORCH_CHECK(!sliding_window || *sliding_window >= 1, "paged_attention_decode: sliding_window must be >= 1");
  paged_attention_decode_into(query, key_cache, value_cache, block_tables, seq_lens, scale, out,
                              sliding_window.value_or(0));
  return out;
}

void paged_attention_decode_into(const at::Tensor& query, const at::Tensor& key_cache,
                                 const at::Tensor& value_cache, const at::Tensor& block_tables,
                                 const at::Tensor& seq_lens, double scale, at::Tensor& out,
                                 int64_t sliding_window) {
  const bool int8_cache = key_cache.scalar_type() == at::kChar;
  const bool fp8_cache = key_cache.scalar_type() == at::kFloat8_e4m3fn;
  const bool quantized = int8_cache || fp8_cache;
  TORCH_CHECK(query.scalar_type() == at::kFloat && (key_cache.scalar_type() == at::kFloat || quantized) &&
                  value_cache.scalar_type() == key_cache.scalar_type(),
              "paged_attention_decode: a float32 query over a float32, int8 or float8_e4m3fn cache");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "paged_attention_decode: block_tables and seq_lens must be int32");
  if (quantized) {
    TORCH_CHECK(is_quantized_cache(key_cache) && is_quantized_cache(value_cache),
                "quantized (int8, fp8) caches must be the values view of [blocks, block_size, kv_heads, "
                "head_dim + 2] rows with a float16 scale after each (kernels/kv_quant.py)");
  } else {
    TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  }
  TORCH_CHECK(query.stride(2) == 1, "query rows must be contiguous in head_dim");
  TORCH_CHECK(block_tables.stride(1) == 1 && seq_lens.is_contiguous());
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  const int64_t head_dim = query.size(2);
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.numel() == query.numel(),
              "paged_attention_decode_into: out must be contiguous float32 [num_seqs, num_heads, head_dim]");
  if (quantized) {
    // The cache holds H k (kv_quant.h): <q, k> = <H q, H k> / block, so the kernel attends
    // with H q and scale / block (a power of two: exact).
    const int64_t block = hadamard_block(head_dim);
    thread_local std::vector<float> tl_hq;
    const int64_t rows = query.size(0) * query.size(1);
    tl_hq.resize(size_t(rows * head_dim));
    const float* q = query.data_ptr<float>();
    for (int64_t i = 0; i < query.size(0); ++i)
      for (int64_t h = 0; h < query.size(1); ++h) {
        float* dst = tl_hq.data() + (i * query.size(1) + h) * head_dim;
        const float* src = q + i * query.stride(0) + h * query.stride(1);
        std::copy(src, src + head_dim, dst);
        hadamard_row(dst, head_dim, block);
      }
    const at::Tensor hq = at::from_blob(tl_hq.data(), query.sizes(), query.options());
    if (fp8_cache)
      decode_head_dim<Fp8>(head_dim, hq, key_cache, value_cache, block_tables, seq_lens, scale / double(block), out,
                           sliding_window);
    else
      decode_head_dim<int8_t>(head_dim, hq, key_cache, value_cache, block_tables, seq_lens, scale / double(block),
                              out, sliding_window);
  } else
    decode_head_dim<float>(head_dim, query, key_cache, value_cache, block_tables, seq_lens, scale, out, sliding_window);
}

}  // namespace pagedserve_cpu
