// The quantized KV cache's row format in C++ (kernels/kv_quant.py is the definition): a row
// is head_dim int8 values, then the row's float16 scale (2 bytes); K rows hold the
// block-diagonal Hadamard transform of the keys less their calibrated offset, if any. Shared
// by the store (layer_ops.cpp) and the decode kernel (paged_attention.cpp), which evaluate
// the reference's float32 operations in its order, so the bytes are the reference's.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace pagedserve_cpu {

constexpr int64_t kScaleBytes = 2;  // the float16 scale after a row's values
constexpr float kScaleMax = 65504.f;  // float16's largest finite value

// kv_quant.hadamard_block: the largest power of two dividing head_dim / 2.
inline int64_t hadamard_block(int64_t head_dim) {
  const int64_t half = head_dim / 2;
  return half & -half;
}

// kv_quant.hadamard, in place on n floats: for h = 1, 2, ..., block / 2, channels (i, i + h)
// with i % 2h < h become (x_i + x_(i+h), x_i - x_(i+h)). Additions only (nothing to fuse),
// so the result is the reference's bit for bit.
inline void hadamard_row(float* x, int64_t n, int64_t block) {
  for (int64_t h = 1; h < block; h *= 2)
    for (int64_t i0 = 0; i0 < n; i0 += 2 * h)
      for (int64_t i = i0; i < i0 + h; ++i) {
        const float a = x[i], b = x[i + h];
        x[i] = a + b;
        x[i + h] = a - b;
      }
}

// A store's key offset (kv_quant.check_key_offset): float32 [num_kv_heads, head_dim],
// contiguous, on the CPU.
inline const float* key_offset_ptr(const at::Tensor& offset, int64_t num_kv_heads, int64_t head_dim) {
  TORCH_CHECK(offset.scalar_type() == at::kFloat && offset.is_contiguous() && offset.device().is_cpu() &&
                  offset.dim() == 2 && offset.size(0) == num_kv_heads && offset.size(1) == head_dim,
              "key_offset must be contiguous float32 [num_kv_heads, head_dim] on the CPU");
  return offset.data_ptr<float>();
}

inline float load_scale(const int8_t* row, int64_t head_dim) {
  c10::Half s;
  std::memcpy(&s, row + head_dim, sizeof s);
  return float(s);
}

// One row of n floats into the int8 layout: s = float16(min(amax / 127, 65504)) (nearest
// even), q = x / s rounded half away from zero and clamped to +-127; kv_quant.quantize's
// float32 operations, so the same bytes.
inline void quantize_row_i8(const float* x, int64_t n, int8_t* out) {
  float amax = 0.f;
  for (int64_t d = 0; d < n; ++d) amax = std::max(amax, std::fabs(x[d]));
  const c10::Half s16(std::min(amax / 127.f, kScaleMax));
  const float s = float(s16);
  const float div = s > 0.f ? s : 1.f;
  for (int64_t d = 0; d < n; ++d) {
    const float y = x[d] / div;
    float r = std::floor(std::fabs(y) + 0.5f);
    r = std::min(r, 127.f);
    out[d] = int8_t(y < 0.f ? -r : r);
  }
  std::memcpy(out + n, &s16, sizeof s16);
}

}  // namespace pagedserve_cpu
