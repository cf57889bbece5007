// The quantized KV cache's row format in C++ (kernels/kv_quant.py is the definition): a row
// is head_dim 8-bit values (int8, or e4m3fn for fp8), then the row's float16 scale (2 bytes);
// K rows hold the
// block-diagonal Hadamard transform of the keys less their calibrated offset, if any. Shared
// by the store (layer_ops.cpp) and the decode kernel (paged_attention.cpp), which evaluate
// the reference's float32 operations in its order, so the bytes are the reference's.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "vec.h"

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

using Fp8 = c10::Float8_e4m3fn;  // an fp8 cache's element (--kv-cache-dtype fp8)

template <typename T>  // int8_t or Fp8: one byte a value, so the scale sits head_dim bytes in
inline float load_scale(const T* row, int64_t head_dim) {
  static_assert(sizeof(T) == 1, "quantized rows hold one byte a value");
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

// One row of n floats into the fp8 layout: s = float16(min(amax / 448, 65504)) (nearest
// even), q = x / s clamped to +-448 and cast with c10's round to nearest even (the cast
// torch's .to(float8_e4m3fn) makes); kv_quant.quantize's float32 operations, so the same
// bytes. A NaN propagates as in torch (amax, clamp): the row's scale is NaN.
inline void quantize_row_fp8(const float* x, int64_t n, Fp8* out) {
  constexpr float kQmax = 448.f;
  float amax = 0.f;
  for (int64_t d = 0; d < n; ++d) {
    const float a = std::fabs(x[d]);
    amax = (a > amax || a != a) ? a : amax;  // once NaN, stays NaN
  }
  const c10::Half s16(std::min(amax / kQmax, kScaleMax));  // std::min(NaN, _) is NaN
  const float s = float(s16);
  const float div = s > 0.f ? s : 1.f;
  for (int64_t d = 0; d < n; ++d) out[d] = Fp8(std::min(std::max(x[d] / div, -kQmax), kQmax));
  std::memcpy(reinterpret_cast<char*>(out) + n, &s16, sizeof s16);
}

// Decoding e4m3fn. A byte s eeee mmm is, as float16 bits s 0eeee mmm0000000, its value times
// 2^-8: the same mantissa under an exponent bias of 15 instead of 7, and e4m3's subnormals
// (eeee = 0: m/8 * 2^-6) land on float16's (m/8 * 2^-14), so one exact half-to-float
// conversion decodes 16 (or 8) values. The exception is e4m3fn's NaN (x111 1111), which
// comes out +-1.875 (no other byte does) and is replaced by NaN. The decode kernel folds the
// 2^8 into each row's scale (exact: a power of two). kE4m3Scaled is the same map as a table,
// built from c10's conversion (for scalar reads and the portable vector path).
constexpr float kE4m3Unscale = 256.f;  // what the decoded values are to be multiplied by

inline std::array<float, 256> e4m3_scaled_table() {
  std::array<float, 256> t{};
  for (int b = 0; b < 256; ++b) t[b] = float(Fp8(uint8_t(b), Fp8::from_bits())) / kE4m3Unscale;
  return t;
}
inline const std::array<float, 256> kE4m3Scaled = e4m3_scaled_table();

// e4m3fn's NaN bytes (x111 1111) decoded as floats come out +-1.875 (no other byte does):
// those lanes become NaN.
static inline vf e4m3_fix_nan(vf f) {
  const vi32 magnitude = reinterpret_cast<vi32>(f) & 0x7FFFFFFF;
  const vi32 nan = vi32{} + 0x7FC00000;
  return magnitude == 0x3FF00000 ? reinterpret_cast<vf>(nan) : f;  // 1.875f
}

// kVec e4m3fn values (any alignment) as floats, times 2^-8, except that a NaN byte reads as
// +-1.875 (e4m3_fix_nan makes it NaN).
static inline vf vload_e4m3_scaled_raw(const Fp8* p) {
#if defined(__AVX512F__)
  // vpmovsxbw: the sign lands in bits 15..7 of each 16-bit word; << 7 puts e and m in place
  // (bits 13..7) and the sign in 15 and 14; the mask clears bit 14.
  const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i h = _mm256_and_si256(_mm256_slli_epi16(w, 7), _mm256_set1_epi16(int16_t(0xBF80)));
  return reinterpret_cast<vf>(_mm512_cvtph_ps(h));
#elif defined(__AVX2__) && defined(__F16C__)
  const __m128i w = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i h = _mm_and_si128(_mm_slli_epi16(w, 7), _mm_set1_epi16(int16_t(0xBF80)));
  return reinterpret_cast<vf>(_mm256_cvtph_ps(h));
#else
  vf v;
  for (int i = 0; i < kVec; ++i) v[i] = kE4m3Scaled[p[i].x];
  return v;
#endif
}

// kVec e4m3fn values (any alignment) as floats, times 2^-8.
static inline vf vload_e4m3_scaled(const Fp8* p) { return e4m3_fix_nan(vload_e4m3_scaled_raw(p)); }

// Whether any of n bytes (a multiple of 32) is e4m3fn's NaN: a row's check, a compare per
// 64 (AVX-512) or 32 bytes, in place of a NaN select per vector decoded (which slowed the
// decode loops markedly: benchmarks/RESULTS.md). No CPU store writes a NaN byte beside a finite
// scale (their absmax propagates NaN), so rows that have one take the slow path only when
// a NaN is there to be read.
static inline bool e4m3_has_nan(const Fp8* p, int64_t n) {
  const auto* b = reinterpret_cast<const uint8_t*>(p);
#if defined(__AVX512BW__)
  const __m512i high = _mm512_set1_epi8(char(0x80)), ones = _mm512_set1_epi8(-1);
  __mmask64 any = 0;
  int64_t i = 0;
  for (; i + 64 <= n; i += 64)
    any |= _mm512_cmpeq_epi8_mask(_mm512_or_si512(_mm512_loadu_si512(b + i), high), ones);
  if (i < n) {
    const __mmask64 tail = (~__mmask64(0)) >> (64 - (n - i));
    any |= _mm512_mask_cmpeq_epi8_mask(tail, _mm512_or_si512(_mm512_maskz_loadu_epi8(tail, b + i), high), ones);
  }
  return any != 0;
#elif defined(__AVX2__)
  const __m256i high = _mm256_set1_epi8(char(0x80)), ones = _mm256_set1_epi8(-1);
  int any = 0;
  for (int64_t i = 0; i < n; i += 32)
    any |= _mm256_movemask_epi8(_mm256_cmpeq_epi8(
        _mm256_or_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + i)), high), ones));
  return any != 0;
#else
  bool any = false;
  for (int64_t i = 0; i < n; ++i) any |= (b[i] & 0x7F) == 0x7F;
  return any;
#endif
}

}  // namespace pagedserve_cpu
