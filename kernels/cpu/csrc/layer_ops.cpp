// The elementwise parts of a decoder layer, fused so that a decode step of a 30-layer model
// runs a few hundred ops instead of a thousand: on 2 cores each PyTorch op pays dispatch and
// thread wake-up, which at batch 1 adds up to a large share of the step.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <cstring>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "kv_quant.h"
#include "ops.h"
#include "team.h"
#include "vec.h"

namespace pagedserve_cpu {

namespace {

// out = x * rsqrt(mean(x^2) + eps) * weight, for one row of n floats (n % 16 == 0).
inline void rms_norm_row(const float* x, const float* w, float* out, int64_t n, float eps) {
  vf ss = vzero();
  for (int64_t i = 0; i < n; i += kVec) {
    const vf v = vload(x + i);
    ss += v * v;
  }
  const float r = 1.f / std::sqrt(vsum(ss) / float(n) + eps);
  const vf rv = vsplat(r);
  for (int64_t i = 0; i < n; i += kVec) vstore(out + i, (vload(x + i) * rv) * vload(w + i));
}

void check_rows(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "float32 only");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && w.is_contiguous() && w.numel() == x.size(1),
              "expected contiguous [rows, hidden] and [hidden]");
  TORCH_CHECK(x.size(1) % kVec == 0, "hidden size must be a multiple of 16");
}

// Rows per thread task: below this a step's handful of rows is not worth waking a thread.
constexpr int64_t kRowGrain = 16;

}  // namespace

void rms_norm_into(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out) {
  check_rows(x, weight);
  TORCH_CHECK(out.sizes() == x.sizes() && out.is_contiguous() && out.scalar_type() == at::kFloat);
  const int64_t n = x.size(1);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  parallel_for(0, x.size(0), kRowGrain, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) rms_norm_row(xp + r * n, wp, op + r * n, n, float(eps));
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  auto out = at::empty_like(x);
  rms_norm_into(x, weight, eps, out);
  return out;
}

// residual += x (in place), then out = rms_norm(residual).
void add_rms_norm_into(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps,
                       at::Tensor& out) {
  check_rows(residual, weight);
  TORCH_CHECK(x.sizes() == residual.sizes() && x.is_contiguous() && x.scalar_type() == at::kFloat);
  TORCH_CHECK(out.sizes() == x.sizes() && out.is_contiguous() && out.scalar_type() == at::kFloat);
  const int64_t n = x.size(1);
  const float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  parallel_for(0, x.size(0), kRowGrain, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      float* res = rp + r * n;
      for (int64_t i = 0; i < n; i += kVec) vstore(res + i, vload(res + i) + vload(xp + r * n + i));
      rms_norm_row(res, wp, op + r * n, n, float(eps));
    }
  });
}

// residual += x (in place), then returns rms_norm(residual).
at::Tensor add_rms_norm_(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                         double eps) {
  auto out = at::empty_like(x);
  add_rms_norm_into(x, residual, weight, eps, out);
  return out;
}

// [rows, 2 * inter] (gate | up) -> silu(gate) * up, [rows, inter].
void silu_mul_into(const at::Tensor& gate_up, at::Tensor& out) {
  TORCH_CHECK(gate_up.scalar_type() == at::kFloat && gate_up.dim() == 2 && gate_up.is_contiguous());
  const int64_t inter = gate_up.size(1) / 2;
  TORCH_CHECK(inter % kVec == 0, "intermediate size must be a multiple of 16");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == gate_up.size(0) && out.size(1) == inter && out.is_contiguous() &&
              out.scalar_type() == at::kFloat);
  const float* g = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  parallel_for(0, gate_up.size(0), kRowGrain, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* gr = g + r * 2 * inter;
      for (int64_t i = 0; i < inter; i += kVec) {
        const vf x = vload(gr + i);
        vstore(op + r * inter + i, x / (vsplat(1.f) + vexp(-x)) * vload(gr + inter + i));
      }
    }
  });
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  auto out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  silu_mul_into(gate_up, out);
  return out;
}

// qkv [tokens, (num_heads + 2 * num_kv_heads) * head_dim]: rotates the Q and K heads in place
// (x * cos + rotate_half(x) * sin) and writes each token's K and V rows into its cache slot
// (slot -1: padding, not stored). cos, sin: [tokens, head_dim].
void rope_and_store_(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                     at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& slot_mapping,
                     int64_t num_heads, int64_t num_kv_heads, const c10::optional<at::Tensor>& key_offset) {
  // A quantized cache (--kv-cache-dtype int8|fp8) takes each K/V row quantized, scale after
  // it, K less key_offset (when given) and Hadamard-transformed first (kv_quant.h).
  const bool int8_cache = key_cache.scalar_type() == at::kChar;
  const bool fp8_cache = key_cache.scalar_type() == at::kFloat8_e4m3fn;
  const bool quantized = int8_cache || fp8_cache;
  TORCH_CHECK(qkv.scalar_type() == at::kFloat &&
              (key_cache.scalar_type() == at::kFloat || quantized) &&
              value_cache.scalar_type() == key_cache.scalar_type() && cos.scalar_type() == at::kFloat &&
              sin.scalar_type() == at::kFloat, "float32 only (and an int8 or float8_e4m3fn cache)");
  TORCH_CHECK(qkv.is_contiguous() && cos.is_contiguous() && sin.is_contiguous() &&
              (quantized ? is_quantized_cache(key_cache) && is_quantized_cache(value_cache)
                         : key_cache.is_contiguous() && value_cache.is_contiguous()) &&
              slot_mapping.is_contiguous() && slot_mapping.scalar_type() == at::kLong);
  const int64_t tokens = qkv.size(0), head_dim = key_cache.size(3), half = head_dim / 2;
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim);
  TORCH_CHECK(cos.size(-1) == head_dim && cos.numel() == tokens * head_dim && half % kVec == 0,
              "head_dim must be a multiple of 32");
  const float* offset = nullptr;  // [num_kv_heads, head_dim]
  if (key_offset.has_value()) {
    TORCH_CHECK(quantized, "a key offset is for a quantized (int8, fp8) cache only");
    offset = key_offset_ptr(*key_offset, num_kv_heads, head_dim);
  }
  const int64_t row = qkv.size(1), kv = num_kv_heads * head_dim;
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  float* x = qkv.data_ptr<float>();
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  float* kc = quantized ? nullptr : key_cache.data_ptr<float>();
  float* vc = quantized ? nullptr : value_cache.data_ptr<float>();
  int8_t* kq = int8_cache ? key_cache.data_ptr<int8_t>() : nullptr;
  int8_t* vq = int8_cache ? value_cache.data_ptr<int8_t>() : nullptr;
  Fp8* kfp8 = fp8_cache ? key_cache.data_ptr<Fp8>() : nullptr;
  Fp8* vfp8 = fp8_cache ? value_cache.data_ptr<Fp8>() : nullptr;
  const int64_t qrow = head_dim + kScaleBytes;  // a quantized row: head_dim values, then the scale
  const int64_t block = hadamard_block(head_dim);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  parallel_for(0, tokens, kRowGrain, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      float* xt = x + t * row;
      const float* ct = c + t * head_dim;
      const float* st = s + t * head_dim;
      for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
        float* xh = xt + h * head_dim;
        for (int64_t i = 0; i < half; i += kVec) {
          const vf x1 = vload(xh + i), x2 = vload(xh + half + i);
          vstore(xh + i, x1 * vload(ct + i) + (-x2) * vload(st + i));
          vstore(xh + half + i, x2 * vload(ct + half + i) + x1 * vload(st + half + i));
        }
      }
      const int64_t slot = slots[t];
      if (slot < 0) continue;
      TORCH_CHECK(slot < num_slots, "slot ", slot, " out of range");
      const float* k = xt + num_heads * head_dim;
      if (quantized) {
        float kh[256];  // one K row, Hadamard-transformed (head_dim <= 256: cpu_kernels.supports)
        TORCH_CHECK(head_dim <= 256, "quantized cache: head_dim must be <= 256");
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          std::copy(k + h * head_dim, k + (h + 1) * head_dim, kh);
          if (offset != nullptr)
            for (int64_t d = 0; d < head_dim; ++d) kh[d] -= offset[h * head_dim + d];
          hadamard_row(kh, head_dim, block);
          const int64_t dst = (slot * num_kv_heads + h) * qrow;
          if (fp8_cache) {
            quantize_row_fp8(kh, head_dim, kfp8 + dst);
            quantize_row_fp8(k + kv + h * head_dim, head_dim, vfp8 + dst);
          } else {
            quantize_row_i8(kh, head_dim, kq + dst);
            quantize_row_i8(k + kv + h * head_dim, head_dim, vq + dst);
          }
        }
        continue;
      }
      std::copy(k, k + kv, kc + slot * kv);
      std::copy(k + kv, k + 2 * kv, vc + slot * kv);
    }
  });
}

// Index of each row's largest value, the first one on ties, as torch.argmax: a NaN counts as
// the largest (the first NaN wins). Greedy sampling reads this over the vocabulary every step,
// and torch.argmax reads it far below the memory's bandwidth, a visible part of a large step.
// One pass: each vector lane keeps its largest value and where that came first; then the
// first index among the lanes holding the overall max.
at::Tensor argmax_rows(const at::Tensor& x_) {
  const at::Tensor x = x_.contiguous();
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) > 0,
              "argmax_rows: expected float32 [rows, n > 0]");
  TORCH_CHECK(x.size(1) < (int64_t(1) << 24), "argmax_rows: positions are kept as exact floats");
  const int64_t rows = x.size(0), n = x.size(1), nv = n / kVec * kVec;
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  // One row a chunk; all on this thread while the fused stack runs narrowed (ops.h).
  parallel_for(0, rows, stack_narrowed() ? rows : 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * n;
      vf best = vsplat(-std::numeric_limits<float>::infinity()), at = vzero(), lane;
      for (int i = 0; i < kVec; ++i) lane[i] = float(i);
      vf nan = vzero();  // 1 in the lanes that saw a NaN (v != v)
      for (int64_t i = 0; i < nv; i += kVec) {
        const vf v = vload(row + i);
        const auto gt = v > best;
        best = gt ? v : best;
        at = gt ? lane + float(i) : at;
        nan = (v != v) ? vsplat(1.f) : nan;
      }
      bool has_nan = false;
      for (int i = 0; i < kVec; ++i) has_nan |= nan[i] != 0.f;
      float m = -std::numeric_limits<float>::infinity();
      int64_t idx = 0;  // also the answer when every value is -inf
      if (!has_nan) {
        for (int i = 0; i < kVec; ++i) m = std::max(m, best[i]);
        if (nv > 0) {
          idx = n;
          for (int i = 0; i < kVec; ++i)
            if (best[i] == m) idx = std::min<int64_t>(idx, int64_t(at[i]));
        }
        for (int64_t i = nv; i < n; ++i) {  // the tail past the last whole vector
          if (std::isnan(row[i])) { has_nan = true; break; }
          if (row[i] > m) { m = row[i]; idx = i; }
        }
      }
      if (has_nan)
        for (idx = 0; !std::isnan(row[idx]); ++idx) {}
      op[r] = idx;
    }
  });
  return out;
}

}  // namespace pagedserve_cpu
