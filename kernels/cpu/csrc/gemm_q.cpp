// Matmul against the checkpoint's own GGUF blocks (Q4_0, Q4_1, Q8_0), de-quantized inside
// the kernel to exactly the float32 weights everything else multiplies by.
//
// Why: the default checkpoint ships its matmul weights as Q4_1 (5 bits a weight) and its tied
// embedding as Q8_0 (8.5); the engine runs on the float32 values `transformers` de-quantizes
// them to (538 MB). A one-row decode step streams every weight once, so reading the blocks,
// packed below at 6 (Q4) or 9 (Q8) bits a weight, instead of the floats moves 4.8x fewer bytes
// for the same products (112 MB instead of 538).
//
// Exactness, the invariant this file keeps: a Q4 weight is d * q + m with d, m float16 and
// q in 0..15, a Q8 weight is d * q with q in -128..127. d * q needs at most 11 + 8 significant
// bits, so it is exact in float32, and d * q + m is then one rounding whether or not the
// compiler fuses it into an FMA: the same float32 value gguf-py's de-quantizer computes.
// Q4_0 (d * (q - 8)) is stored as Q4_1 with m = -8 d: d * q exact, -8 d exact, and the exact
// sum d * (q - 8) is representable, so also no rounding (a zero weight under a negative d
// comes out +0.0 where gguf-py has -0.0; they compare equal and multiply to the same sums).
// So a product here differs from the float32 kernel's only in summation order, as any two
// matmul libraries do. Linear's loader
// checks the claim on every tensor (dequantize_panels == the float32 weight, bitwise) before
// it uses this path.
//
// Panels, like the float32 kernel's, are NB output columns wide (64 with AVX-512, 16 with
// AVX2: gemm.h), and each holds its K range in blocks of 32 (the GGUF block), so a panel is
// one contiguous stream:
//   q4 block (24 NB bytes): float d[NB], float m[NB], uint8 q[16][NB]; q[j][c] holds column
//      c's values at k = j (low nibble) and k = j + 16 (high nibble), as a GGUF Q4 block does;
//   q8 block (36 NB bytes): float d[NB], int8 q[32][NB].
// The packed tensor is uint8 [ceil(N / NB), K / 32, block bytes]; its last size names the
// format. Scales are kept as float32 (not float16) so the inner loop converts only q.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "gemm.h"
#include "ops.h"
#include "vec.h"

namespace pagedserve_cpu {

namespace {

constexpr int QB = 32;  // GGUF block length along K
constexpr int64_t kQ4Block = 2 * NB * 4 + (QB / 2) * NB;
constexpr int64_t kQ8Block = NB * 4 + QB * NB;
// ggml type ids
constexpr int64_t kGgmlQ4_0 = 2, kGgmlQ4_1 = 3, kGgmlQ8_0 = 8;

// kVec bytes widened to kVec int32 lanes, as unsigned (q4 nibble pairs) or signed (q8)
// bytes. Written with intrinsics: GCC 12 lowers __builtin_convertvector from a byte vector
// to one insert per lane.
template <bool Signed>
static inline vi32 widen8(const uint8_t* p) {
#if defined(__AVX512F__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<vi32>(Signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
#elif defined(__AVX2__)
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<vi32>(Signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
#else
  vi32 r;
  for (int i = 0; i < kVec; ++i) r[i] = Signed ? static_cast<int8_t>(p[i]) : p[i];
  return r;
#endif
}
static inline vf to_f(vi32 v) { return __builtin_convertvector(v, vf); }
static inline vi32 load_u8(const uint8_t* p) { return widen8<false>(p); }
static inline vf load_s8(const uint8_t* p) { return to_f(widen8<true>(p)); }

static inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(bits);
}

// Whether a packed tensor holds q4 (else q8) blocks, after checking it is one of the two.
bool checked_q4(const at::Tensor& panels) {
  TORCH_CHECK(panels.scalar_type() == at::kByte && panels.dim() == 3, "not a quantized panel tensor");
  TORCH_CHECK(panels.size(2) == kQ4Block || panels.size(2) == kQ8Block, "not a quantized panel tensor");
  return panels.size(2) == kQ4Block;
}

// The one definition of a weight from its block, for the matmul and for dequantize_panels
// alike: the loader's bitwise check of dequantize_panels then vouches for what the matmul
// multiplies by. Columns kVec v .. kVec (v + 1) - 1 of byte row j; a q4 byte row holds k = j (lo)
// and k = j + 16 (hi).
static inline void q4_weights(const uint8_t* blk, int j, int v, vf& lo, vf& hi) {
  const float* d = reinterpret_cast<const float*>(blk);
  const vi32 z = load_u8(blk + 2 * NB * 4 + j * NB + kVec * v);
  const vf dv = vload(d + kVec * v), mv = vload(d + NB + kVec * v);
  lo = to_f(z & 15) * dv + mv;
  hi = to_f(z >> 4) * dv + mv;
}
static inline vf q8_weight(const uint8_t* blk, int j, int v) {
  return load_s8(blk + NB * 4 + j * NB + kVec * v) * vload(reinterpret_cast<const float*>(blk) + kVec * v);
}

// How many panels one row walks in lockstep (streams from memory at once), and how many rows
// share a panel's de-quantized weights, so that the accumulators (P x R x NV vectors), the
// scales and the weights being de-quantized stay in registers.
// - One row: 4 panels of Q8 blocks (the default model's tied lm_head, 32 MB): with 2 it read
//   at ~14 GB/s; 4 gave 1.24x on AVX-512 and 1.06x on AVX2 (one run, paired medians of 21).
//   Q4's heavier de-quantization leaves less to gain: 4 panels gave 1.03x over the model's
//   Q4 matmuls on AVX-512, and lost ~4% on AVX2 (16 registers), which keeps 2.
// - Rows per tile: 6 with AVX-512's 32 registers; with AVX2's 16, 4 (over the default model's
//   matmuls, AVX2 build: 16 rows 75.6 ms with 4, 82.7 with 3, 98.1 with 2; 4 rows 21.5 / 26.1
//   / 28.6 ms).
constexpr int kQ8RowStreams = 4;
constexpr int kQ4RowStreams = kRegs == 32 ? 4 : 2;
constexpr int kQuantRowTile = kRegs == 32 ? 6 : 4;

// R rows against P panels `pstride` bytes apart, walked in lockstep: each weight is
// de-quantized once in registers and used by all R rows.
template <bool Q4, int P, int R>
static inline void block_tile(const float* __restrict x, int64_t ldx, const uint8_t* __restrict panel,
                              int64_t pstride, int64_t nblk, float* __restrict y, int64_t ldy, int64_t ystride,
                              const float* bias, const uint8_t* pf = nullptr) {
  constexpr int64_t kBlock = Q4 ? kQ4Block : kQ8Block;
  vf acc[P][R][NV];
  for (int p = 0; p < P; ++p)
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < NV; ++v) acc[p][r][v] = vzero();
  for (int64_t kb = 0; kb < nblk; ++kb) {
    const float* xb = x + kb * QB;
    const uint8_t* blk = panel + kb * kBlock;
    if (pf)  // the same block of the next panel, into L2
      for (int64_t off = 0; off < kBlock; off += kLineFloats * 4) __builtin_prefetch(pf + kb * kBlock + off, 0, 2);
    // Q4: byte row j holds k = j (low nibble) and k = j + 16 (high); Q8: byte row j is k = j.
    for (int j = 0; j < (Q4 ? QB / 2 : QB); ++j) {
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p) {
        const uint8_t* b = blk + p * pstride;
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) {
          if constexpr (Q4) {
            vf lo, hi;
            q4_weights(b, j, v, lo, hi);
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) {
              acc[p][r][v] += vbcast(xb + r * ldx + j) * lo;
              acc[p][r][v] += vbcast(xb + r * ldx + j + QB / 2) * hi;
            }
          } else {
            const vf w = q8_weight(b, j, v);
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) acc[p][r][v] += vbcast(xb + r * ldx + j) * w;
          }
        }
      }
    }
  }
  for (int p = 0; p < P; ++p)
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < NV; ++v) {
        float* o = y + r * ldy + p * ystride + kVec * v;
        vstore(o, bias ? vload(bias + p * ystride + kVec * v) + acc[p][r][v] : acc[p][r][v]);
      }
}

template <int P, int R>
static inline void tile(bool q4, const float* x, int64_t ldx, const uint8_t* panel, int64_t pstride,
                        int64_t nblk, float* y, int64_t ldy, int64_t ystride, const float* bias,
                        const uint8_t* pf = nullptr) {
  if (q4) block_tile<true, P, R>(x, ldx, panel, pstride, nblk, y, ldy, ystride, bias, pf);
  else block_tile<false, P, R>(x, ldx, panel, pstride, nblk, y, ldy, ystride, bias, pf);
}

// Panels [begin, end) for one row: P runs of panels in lockstep (P streams), then the rest.
template <int P>
static void quant_one_row(bool q4, const float* x, const uint8_t* wp, int64_t nblk, int64_t pbytes, float* y,
                          int64_t NP, const float* bias, int64_t begin, int64_t end) {
  const int64_t q = (end - begin) / P;
  for (int64_t i = 0; i < q; ++i) {
    const int64_t b = begin + i;
    tile<P, 1>(q4, x, 0, wp + b * pbytes, q * pbytes, nblk, y + b * NB, NP, q * NB, bias ? bias + b * NB : nullptr);
  }
  for (int64_t b = begin + P * q; b < end; ++b)
    tile<1, 1>(q4, x, 0, wp + b * pbytes, 0, nblk, y + b * NB, NP, 0, bias ? bias + b * NB : nullptr);
}

// The last R < kQuantRowTile rows of a panel.
template <int R = 1>
static inline void tail_rows(int left, bool q4, const float* x, int64_t K, const uint8_t* panel, int64_t nblk,
                             float* y, int64_t ldy, const float* bias, const uint8_t* pf) {
  if constexpr (R < kQuantRowTile) {
    if (left == R) return tile<1, R>(q4, x, K, panel, 0, nblk, y, ldy, 0, bias, pf);
    tail_rows<R + 1>(left, q4, x, K, panel, nblk, y, ldy, bias, pf);
  }
}

// All M rows against one panel, kQuantRowTile at a time: the first group streams the panel
// from memory, the others find it in L2. The second group (or the only one) prefetches
// `next`, the thread's next panel, into L2 as it goes, so that panel's first group does not
// wait on memory. Over the model's 121 matmuls (one run, paired medians of 15): 4-7% faster
// at 4-16 rows, 1% at 24.
static void quant_panel_rows(bool q4, const float* x, int64_t K, int64_t M, const uint8_t* panel, int64_t nblk,
                             float* y, int64_t ldy, const float* bias, const uint8_t* next) {
  constexpr int T = kQuantRowTile;
  const int64_t fetching_group = M > T ? 1 : 0;
  int64_t m = 0, group = 0;
  for (; m + T <= M; m += T, ++group)
    tile<1, T>(q4, x + m * K, K, panel, 0, nblk, y + m * ldy, ldy, 0, bias, group == fetching_group ? next : nullptr);
  if (m < M)
    tail_rows(static_cast<int>(M - m), q4, x + m * K, K, panel, nblk, y + m * ldy, ldy, bias,
              group == fetching_group ? next : nullptr);
}

// One panel back to float32, [K, NB] row-major (the float32 kernel's panel layout).
static void dequantize_panel(bool q4, const uint8_t* panel, int64_t nblk, float* out) {
  for (int64_t kb = 0; kb < nblk; ++kb) {
    float* o = out + kb * QB * NB;
    const uint8_t* b = panel + kb * (q4 ? kQ4Block : kQ8Block);
    for (int j = 0; j < (q4 ? QB / 2 : QB); ++j)
      for (int v = 0; v < NV; ++v) {
        if (q4) {
          vf lo, hi;
          q4_weights(b, j, v, lo, hi);
          vstore(o + j * NB + kVec * v, lo);
          vstore(o + (j + QB / 2) * NB + kVec * v, hi);
        } else {
          vstore(o + j * NB + kVec * v, q8_weight(b, j, v));
        }
      }
  }
}

}  // namespace

at::Tensor pack_gguf(const at::Tensor& raw_, int64_t ggml_type, int64_t K) {
  TORCH_CHECK(raw_.scalar_type() == at::kByte && raw_.dim() == 2, "raw GGUF blocks must be uint8 [N, bytes]");
  TORCH_CHECK(K % QB == 0, "K must be a multiple of 32");
  const int64_t bpb = ggml_type == kGgmlQ8_0 ? 34 : ggml_type == kGgmlQ4_1 ? 20 : ggml_type == kGgmlQ4_0 ? 18 : -1;
  TORCH_CHECK(bpb > 0, "unsupported ggml type ", ggml_type);
  const int64_t N = raw_.size(0), nblk = K / QB, nb = (N + NB - 1) / NB;
  TORCH_CHECK(raw_.size(1) == nblk * bpb, "raw rows hold ", raw_.size(1), " bytes, expected ", nblk * bpb);
  auto raw = raw_.contiguous();
  const bool q8 = ggml_type == kGgmlQ8_0;
  const int64_t pbb = q8 ? kQ8Block : kQ4Block;
  auto out = at::zeros({nb, nblk, pbb}, raw.options());  // padding columns: d = m = 0, q = 0
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  for (int64_t n = 0; n < N; ++n) {
    const int64_t b = n / NB, c = n % NB;
    for (int64_t kb = 0; kb < nblk; ++kb) {
      const uint8_t* s = src + n * nblk * bpb + kb * bpb;
      uint8_t* blk = dst + (b * nblk + kb) * pbb;
      float* d = reinterpret_cast<float*>(blk);
      d[c] = half_at(s);
      if (q8) {
        for (int j = 0; j < QB; ++j) blk[NB * 4 + j * NB + c] = s[2 + j];
      } else {
        d[NB + c] = ggml_type == kGgmlQ4_1 ? half_at(s + 2) : -8.0f * d[c];
        const uint8_t* qs = s + (ggml_type == kGgmlQ4_1 ? 4 : 2);
        for (int j = 0; j < QB / 2; ++j) blk[2 * NB * 4 + j * NB + c] = qs[j];
      }
    }
  }
  return out;
}

at::Tensor dequantize_panels(const at::Tensor& panels, int64_t N) {
  const bool q4 = checked_q4(panels);
  const int64_t nb = panels.size(0), nblk = panels.size(1), K = nblk * QB;
  auto full = at::empty({K, nb * NB}, at::kFloat);
  std::vector<float> buf(K * NB);
  for (int64_t b = 0; b < nb; ++b) {
    dequantize_panel(q4, panels.data_ptr<uint8_t>() + b * nblk * panels.size(2), nblk, buf.data());
    for (int64_t k = 0; k < K; ++k)
      std::memcpy(full.data_ptr<float>() + k * nb * NB + b * NB, buf.data() + k * NB, sizeof(float) * NB);
  }
  return full.narrow(1, 0, N).contiguous();
}

void quant_linear_into(const at::Tensor& x_, const at::Tensor& panels, int64_t N,
                       const c10::optional<at::Tensor>& bias_, at::Tensor& y) {
  auto x = x_.contiguous();
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be float32");
  const bool q4 = checked_q4(panels);
  const int64_t M = x.size(0), K = x.size(1), nb = panels.size(0), nblk = panels.size(1), NP = nb * NB;
  TORCH_CHECK(nblk * QB == K, "x has ", K, " columns, the panels ", nblk * QB, " rows");
  TORCH_CHECK(y.scalar_type() == at::kFloat && y.is_contiguous() && y.dim() == 2 && y.size(0) == M && y.size(1) == NP,
              "quant_linear_into: y must be contiguous float32 [rows, whole panels]");
  const at::Tensor biasp = padded_bias(bias_, N, NP);
  const float* bias = biasp.defined() ? biasp.data_ptr<float>() : nullptr;
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = panels.data_ptr<uint8_t>();
  const int64_t pbytes = nblk * panels.size(2);
  float* yp = y.data_ptr<float>();
  if (M == 1)
    at::parallel_for(0, nb, 1, [&](int64_t begin, int64_t end) {
      if (q4) quant_one_row<kQ4RowStreams>(q4, xp, wp, nblk, pbytes, yp, NP, bias, begin, end);
      else quant_one_row<kQ8RowStreams>(q4, xp, wp, nblk, pbytes, yp, NP, bias, begin, end);
    });
  else
    parallel_panels(nb, M, kQuantRowTile, [&](int64_t b, int64_t m0, int64_t m1, int64_t next) {
      quant_panel_rows(q4, xp + m0 * K, K, m1 - m0, wp + b * pbytes, nblk, yp + m0 * NP + b * NB, NP,
                       bias ? bias + b * NB : nullptr, next >= 0 ? wp + next * pbytes : nullptr);
    });
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& panels, int64_t N, const c10::optional<at::Tensor>& bias) {
  const int64_t NP = panels.size(0) * NB;
  auto y = at::empty({x.size(0), NP}, x.options());
  quant_linear_into(x, panels, N, bias, y);
  return NP == N ? y : y.narrow(1, 0, N).contiguous();
}

}  // namespace pagedserve_cpu
