// Float vectors for the CPU kernels, written with GCC vector extensions so one source
// compiles to AVX-512, AVX2 or plain SSE, whatever -march finds. A vector is exactly one
// machine register wide (16, 8 or 4 floats): GCC keeps a generic vector wider than the
// registers on the stack and lowers every operation to loads and stores (an AVX2 build with
// 16-float vectors ran its matmuls several times slower than its register width accounts for).
#pragma once

#include <cstdint>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__SSE2__)
#include <immintrin.h>
#endif

namespace pagedserve_cpu {

#if defined(__AVX512F__)
constexpr int kVec = 16;   // floats per vector
constexpr int kRegs = 32;  // vector registers: what a tile's accumulators must fit in
#elif defined(__AVX2__)
constexpr int kVec = 8;
constexpr int kRegs = 16;
#else
constexpr int kVec = 4;
constexpr int kRegs = 16;
#endif

// may_alias + aligned(4): loads and stores from any float pointer, no alignment promise.
typedef float vf __attribute__((vector_size(kVec * 4), aligned(4), may_alias));
typedef int32_t vi32 __attribute__((vector_size(kVec * 4)));

static inline vf vload(const float* p) { return *reinterpret_cast<const vf*>(p); }
// kVec int8 values (any alignment) as floats: the quantized KV cache's rows. With AVX-512 /
// AVX2, one sign-extending load and one conversion (vpmovsxbd, vcvtdq2ps): GCC lowers the
// generic __builtin_convertvector to kVec scalar sign-extend-and-convert pairs and inserts.
typedef int8_t vi8 __attribute__((vector_size(kVec), aligned(1), may_alias));
static inline vf vload_i8(const int8_t* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<vf>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#elif defined(__AVX2__)
  return reinterpret_cast<vf>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#else
  return __builtin_convertvector(*reinterpret_cast<const vi8*>(p), vf);
#endif
}
static inline void vstore(float* p, vf v) { *reinterpret_cast<vf*>(p) = v; }
static inline vf vzero() { return vf{}; }

static inline vf vsplat(float s) {
#if defined(__AVX512F__)
  return reinterpret_cast<vf>(_mm512_set1_ps(s));
#elif defined(__AVX2__)
  return reinterpret_cast<vf>(_mm256_set1_ps(s));
#else
  vf v;
  for (int i = 0; i < kVec; ++i) v[i] = s;
  return v;
#endif
}

// Broadcast from memory: with AVX this is one load-port uop (vbroadcastss m32), not a
// shuffle competing with the FMA unit on port 5.
static inline vf vbcast(const float* p) { return vsplat(*p); }

static inline float vsum(vf v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v));
#else
  float s = 0.f;
  for (int i = 0; i < kVec; ++i) s += v[i];
  return s;
#endif
}

}  // namespace pagedserve_cpu

namespace pagedserve_cpu {

// exp for 16 floats: x = n ln2 + r with |r| <= ln2/2, exp(r) by a degree-6 polynomial
// (Cephes expf coefficients, ~1 ulp), times 2^n built in the exponent bits. Inputs below
// -87.3 flush to 0 (as softmax's exp(-inf) must), above 88.7 saturate.
static inline vf vexp(vf x) {
  const vf hi = vsplat(88.3762626647949f), lo = vsplat(-87.3365447504f);
  vf xc = x < lo ? lo : (x > hi ? hi : x);
  const vf log2e = vsplat(1.44269504088896341f);
  vf fx = xc * log2e + vsplat(0.5f);
  // floor
  vi32 n = __builtin_convertvector(fx, vi32);
  vf nf = __builtin_convertvector(n, vf);
  n = nf > fx ? n - 1 : n;
  nf = __builtin_convertvector(n, vf);
  vf r = xc - nf * vsplat(0.693359375f) - nf * vsplat(-2.12194440e-4f);
  vf y = vsplat(1.9875691500e-4f);
  y = y * r + vsplat(1.3981999507e-3f);
  y = y * r + vsplat(8.3334519073e-3f);
  y = y * r + vsplat(4.1665795894e-2f);
  y = y * r + vsplat(1.6666665459e-1f);
  y = y * r + vsplat(5.0000001201e-1f);
  y = y * r * r + r + vsplat(1.0f);
  vi32 bits = (n + 127) << 23;
  vf scale = reinterpret_cast<vf>(bits);
  vf res = y * scale;
  return x < lo ? vzero() : res;
}

}  // namespace pagedserve_cpu
