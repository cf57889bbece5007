// Matmul against the checkpoint's own GGUF blocks (Q4_0, Q4_1, Q8_0), for batches of 1 to
// max_quant_rows() rows.
//
// Why: the default checkpoint ships its matmul weights as Q4_1 (5 bits a weight) and its tied
// embedding as Q8_0 (8.5); the engine runs on the float32 values `transformers` de-quantizes
// them to. A one-row decode step streams every weight once, so reading the blocks, packed
// below at 6 (Q4) or 9 (Q8) bits a weight, instead of 32-bit floats moves a fraction of the
// bytes for the same products.
//
// The weights, the invariant this file keeps: a Q4 weight is d * q + m with d, m float16 and
// q in 0..15, a Q8 weight is d * q with q in -128..127, exactly gguf-py's de-quantized float32
// values. d * q needs at most 11 + 8 significant bits, so it is exact in float32, and d * q + m
// is then one rounding whether or not the compiler fuses it into an FMA. Q4_0 (d * (q - 8)) is
// stored as Q4_1 with m = -8 d: d * q exact, -8 d exact, and the exact sum d * (q - 8) is
// representable, so also no rounding (a zero weight under a negative d comes out +0.0 where
// gguf-py has -0.0; they compare equal and multiply to the same sums). Linear's loader checks
// the claim on every tensor (dequantize_panels == the float32 weight, bitwise) before it uses
// this path.
//
// Two ways to multiply by them, picked by the build's target and the format (gemm.h):
//
// - Integer dot products (both formats with AVX-512 VNNI or AVX-VNNI; Q4 also with AVX2 or
//   AVX-512BW alone): one vpdpbusd multiplies 4 byte pairs per lane and adds them to an
//   int32, 64 products an instruction (vpmaddubsw + a 16-bit add, 2 per instruction pair,
//   without VNNI), where de-quantizing to float costs a widen, a convert and an FMA per 16
//   weights before the product's own FMA. A one-row step de-quantizing to float was
//   compute-bound (it read the blocks well below the memory's bandwidth). x is not rounded to 8
//   bits, as llama.cpp does (that changes greedy output): each 32-element block of a row is
//   scaled by a power of two 2^e so that its largest |x| is in [2^21, 2^22), rounded to the
//   integer X = round(x 2^e), and split into three signed base-256 digits,
//   X = D0 + 256 D1 + 65536 D2. Then per block and column
//     sum_k q_k X_k = S0 + 256 S1 + 65536 S2,   S_t = sum_k q_k D_t,k   (exact in int32),
//   scaled back by d 2^-e (and + m sum_k x~_k for Q4's offset). The only rounding beyond a
//   float32 matmul's is x's, to 22 bits below its block's largest element (|x~ - x| <=
//   2^-22 max|x|, about a float32 ulp of that element times 2-4), of the order of the float32
//   summation's own error; the parity tests hold greedy output to transformers' token for
//   token, on every target.
// - Float (the rest): each weight de-quantized to its float32 value in registers, then FMAs;
//   a product differs from the float32 kernel's only in summation order.
//
// Panels are NBQ<Q4> output columns wide (one vector with integer dot products; the float32
// kernel's NB otherwise: gemm.h) and hold their K range in blocks of 32 (the GGUF
// block), so a panel is one contiguous stream:
//   q4 block (24 NBQ bytes): float d[NBQ], float m[NBQ], then 16 byte rows: byte row j holds
//      k = j (low nibble) and k = j + 16 (high), as a GGUF Q4 block does;
//   q8 block (36 NBQ bytes): float d[NBQ], then 32 byte rows, byte row j = k.
// The float path stores byte rows as they read (row j: NBQ columns' bytes, so kVec of them
// widen into one vector of kVec columns) and Q8's q as int8. The integer path groups them by
// 4 in the order vpdpbusd sums (byte t of column c's lane in group g is byte row 4 g + t) and
// stores Q8's q + 128, the unsigned operand vpdpbusd takes (the 128 is taken back in
// integers: int_tile). q_byte() is the one place that says where a byte goes.
// The packed tensor is uint8 [ceil(N / NBQ), K / 32, block bytes]; its last size names the
// format. Scales are kept as float32 (not float16) so the inner loop converts only q.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "gemm.h"
#include "ops.h"
#include "team.h"
#include "vec.h"

namespace pagedserve_cpu {

namespace {

constexpr int QB = 32;  // GGUF block length along K
template <bool Q4>
constexpr int NVQ = NBQ<Q4> / kVec;  // vectors per panel row
template <bool Q4>
constexpr int64_t kBlockBytes = Q4 ? 24 * NBQ<true> : 36 * NBQ<false>;
template <bool Q4>
constexpr int64_t kGroupBytes = NBQ<Q4> * 4;  // one group of 4 k for every column of a panel
static_assert(kBlockBytes<true> != kBlockBytes<false>, "a panel's block size names its format");
// ggml type ids
constexpr int64_t kGgmlQ4_0 = 2, kGgmlQ4_1 = 3, kGgmlQ8_0 = 8;

typedef int32_t vi32u __attribute__((vector_size(kVec * 4), aligned(1), may_alias));
static inline vi32 load_i32(const uint8_t* p) { return *reinterpret_cast<const vi32u*>(p); }
static inline vf to_f(vi32 v) { return __builtin_convertvector(v, vf); }

static inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(bits);
}

// Whether a packed tensor holds q4 (else q8) blocks, after checking it is one of the two.
bool checked_q4(const at::Tensor& panels) {
  TORCH_CHECK(panels.scalar_type() == at::kByte && panels.dim() == 3, "not a quantized panel tensor");
  TORCH_CHECK(panels.size(2) == kBlockBytes<true> || panels.size(2) == kBlockBytes<false>,
              "not a quantized panel tensor");
  return panels.size(2) == kBlockBytes<true>;
}

// Where column c's byte row j lives among a block's q bytes (q4: j in 0..15 holds k = j in its
// low nibble and k = j + 16 in its high one; q8: j = k): grouped by 4 k for the integer path
// (file comment), byte rows of NBQ columns for the float path, whose vectors then widen
// kVec consecutive bytes into kVec columns' weights for one k.
template <bool Q4>
static inline int64_t q_byte(int64_t c, int j) {
  return kIntDot<Q4> ? (j / 4) * kGroupBytes<Q4> + c * 4 + j % 4 : int64_t(j) * NBQ<Q4> + c;
}
// Q8's stored byte: q + 128 where vpdpbusd takes it unsigned, q itself for the float path.
static inline uint8_t q8_stored(uint8_t gguf_byte) { return kIntDot<false> ? gguf_byte ^ 0x80 : gguf_byte; }

// The one definition of a weight from its block, for the float matmul and for
// dequantize_panels alike: the loader's bitwise check of dequantize_panels then vouches for
// what the matmuls multiply by (the integer path multiplies by the same d, q and m).
// Columns kVec v .. kVec (v + 1) - 1 of byte row j (float builds' layout).
template <bool Signed>
static inline vi32 widen8(const uint8_t* p) {  // kVec bytes widened to kVec int32 lanes
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
static inline void q4_weights(const uint8_t* blk, int j, int v, vf& lo, vf& hi) {
  constexpr int W = NBQ<true>;
  const float* d = reinterpret_cast<const float*>(blk);
  const vi32 z = widen8<false>(blk + 2 * W * 4 + j * W + kVec * v);
  const vf dv = vload(d + kVec * v), mv = vload(d + W + kVec * v);
  lo = to_f(z & 15) * dv + mv;
  hi = to_f(z >> 4) * dv + mv;
}
static inline vf q8_weight(const uint8_t* blk, int j, int v) {
  constexpr int W = NBQ<false>;
  return to_f(widen8<true>(blk + W * 4 + j * W + kVec * v)) * vload(reinterpret_cast<const float*>(blk) + kVec * v);
}
// One weight, any layout (dequantize_panels for the integer path, whose matmul never forms it).
template <bool Q4>
static inline float weight_at(const uint8_t* blk, int64_t c, int k) {
  constexpr int W = NBQ<Q4>;
  const float d = reinterpret_cast<const float*>(blk)[c];
  if constexpr (!Q4) {
    const uint8_t b = blk[W * 4 + q_byte<false>(c, k)];
    return float(kIntDot<false> ? int(b) - 128 : int(static_cast<int8_t>(b))) * d;
  }
  const uint8_t b = blk[2 * W * 4 + q_byte<true>(c, k % (QB / 2))];
  return float(k < QB / 2 ? b & 15 : b >> 4) * d + reinterpret_cast<const float*>(blk)[W + c];
}

// x's rows as the integer path reads them (file comment): per row and 32-block, the three
// base-256 digits of X, lowest first, and what turns integer sums back into floats.
struct XDigits {
  const int8_t* digits;  // [rows][nblk][3][QB]
  const float* unit;     // [rows][nblk]: 2^-e, what one unit of X is worth
  const float* sum;      // [rows][nblk]: sum of the block's x~ = X 2^-e (Q4's offset m multiplies it)
  const int32_t* zero;   // [rows][nblk][3]: 128 sum_k D_t,k (Q8's stored q + 128 takes it back)
};

// One 32-block of x, xs, into its digits d ([3][QB]), with unit, sum and zero as XDigits
// has them. The reference: element by element in double, the definition the vector path
// below must reproduce bit for bit. A block holding inf or NaN gets unit = NaN, so its row's
// outputs are NaN, non-finite as a float matmul's would be (inf or NaN).
static void split_block_scalar(const float* xs, int8_t* d, float& unit, float& sum, int32_t* zero) {
  float mx = 0.f;
  bool finite = true;
  for (int i = 0; i < QB; ++i) {
    mx = std::max(mx, std::fabs(xs[i]));
    finite &= std::isfinite(xs[i]);
  }
  int ex = 0;
  if (mx > 0.f) std::frexp(mx, &ex);  // mx < 2^ex
  const int e = 22 - ex;               // so mx 2^e < 2^22, and |D2| <= 64 below
  const double up = std::ldexp(1.0, e);
  int32_t total = 0, z[3] = {0, 0, 0};
  for (int i = 0; i < QB; ++i) {
    const int32_t X = finite ? static_cast<int32_t>(std::nearbyint(double(xs[i]) * up)) : 0;
    const int32_t d0 = static_cast<int8_t>(X), x1 = (X - d0) >> 8;
    const int32_t d1 = static_cast<int8_t>(x1), d2 = (x1 - d1) >> 8;
    d[i] = static_cast<int8_t>(d0);
    d[QB + i] = static_cast<int8_t>(d1);
    d[2 * QB + i] = static_cast<int8_t>(d2);
    total += X;
    z[0] += d0;
    z[1] += d1;
    z[2] += d2;
  }
  const double down = std::ldexp(1.0, -e);
  unit = finite ? static_cast<float>(down) : std::numeric_limits<float>::quiet_NaN();
  sum = finite ? static_cast<float>(double(total) * down) : std::numeric_limits<float>::quiet_NaN();
  for (int t = 0; t < 3; ++t) zero[t] = 128 * z[t];
}

typedef int8_t vi8u __attribute__((vector_size(kVec), aligned(1), may_alias));
static inline int32_t hsum(vi32 v) {
  int32_t s = 0;
  for (int i = 0; i < kVec; ++i) s += v[i];
  return s;
}

// The same block in vectors. The split runs on the calling thread before a matmul's threads
// start, so it is on every matmul's critical path, and a vector split shortens it at every
// batch size. Why it is bit for bit the scalar's: x 2^e is a power-of-two scaling, exact
// in float32 while 2^e is a normal float (|x 2^e| < 2^22: no overflow; an element scaled
// under float's normal range is < 2^-126 and rounds to 0 either way), and adding and taking
// away 1.5 2^23 rounds |v| < 2^22 to the nearest integer, ties to even, as nearbyint does in
// the default rounding mode. Blocks with inf or NaN, or with 2^e beyond float's range (largest
// |x| < 2^-104), take the scalar path.
static inline void split_block(const float* xs, int8_t* d, float& unit, float& sum, int32_t* zero) {
  constexpr int NVB = QB / kVec;
  // The largest |x| from the bits of |x|, which order as |x| does; inf and NaN have bits
  // >= 0x7f800000.
  vi32 top = vi32{};
  for (int v = 0; v < NVB; ++v) {
    const vi32 bits = *reinterpret_cast<const vi32u*>(xs + kVec * v) & 0x7fffffff;
    top = top > bits ? top : bits;
  }
  int32_t mx_bits = 0;
  for (int i = 0; i < kVec; ++i) mx_bits = std::max(mx_bits, top[i]);
  if (mx_bits >= 0x7f800000) return split_block_scalar(xs, d, unit, sum, zero);
  float mx;
  std::memcpy(&mx, &mx_bits, 4);
  int ex = 0;
  if (mx > 0.f) std::frexp(mx, &ex);
  const int e = 22 - ex;
  if (e > 126) return split_block_scalar(xs, d, unit, sum, zero);
  const vf up = vsplat(std::ldexp(1.0f, e)), magic = vsplat(12582912.f);  // 1.5 2^23
  vi32 z0 = vi32{}, z1 = vi32{}, z2 = vi32{};
  for (int v = 0; v < NVB; ++v) {
    const vf scaled = vload(xs + kVec * v) * up;
    const vi32 X = __builtin_convertvector((scaled + magic) - magic, vi32);  // an integer: exact
    const vi32 d0 = (X << 24) >> 24, x1 = (X - d0) >> 8;                     // int8(X), sign kept
    const vi32 d1 = (x1 << 24) >> 24, d2 = (x1 - d1) >> 8;
    *reinterpret_cast<vi8u*>(d + kVec * v) = __builtin_convertvector(d0, vi8u);
    *reinterpret_cast<vi8u*>(d + QB + kVec * v) = __builtin_convertvector(d1, vi8u);
    *reinterpret_cast<vi8u*>(d + 2 * QB + kVec * v) = __builtin_convertvector(d2, vi8u);
    z0 += d0;
    z1 += d1;
    z2 += d2;
  }
  const int32_t s0 = hsum(z0), s1 = hsum(z1), s2 = hsum(z2);
  const int32_t total = s0 + 256 * s1 + 65536 * s2;  // sum X: X = D0 + 256 D1 + 65536 D2
  const double down = std::ldexp(1.0, -e);
  unit = static_cast<float>(down);
  sum = static_cast<float>(double(total) * down);
  zero[0] = 128 * s0;
  zero[1] = 128 * s1;
  zero[2] = 128 * s2;
}

// The digits of M rows of x, into buffers this thread keeps (a matmul is called from one
// thread and its workers only read them).
XDigits split_digits(const float* x, int64_t M, int64_t K) {
  thread_local std::vector<int8_t> digits;
  thread_local std::vector<float> unit, sum;
  thread_local std::vector<int32_t> zero;
  const int64_t nblk = K / QB;
  digits.resize(M * nblk * 3 * QB);
  unit.resize(M * nblk);
  sum.resize(M * nblk);
  zero.resize(M * nblk * 3);
  for (int64_t b = 0; b < M * nblk; ++b)  // x is [M, K] contiguous, so block b is row b / nblk's
    split_block(x + b * QB, digits.data() + b * 3 * QB, unit[b], sum[b], zero.data() + b * 3);
  return XDigits{digits.data(), unit.data(), sum.data(), zero.data()};
}

// One block's integer sums for one digit: acc + each lane's 4 byte pairs u8s (unsigned) times
// s8s (signed). VNNI adds the 4 products into the lane's int32 (vpdpbusd). AVX2 alone adds
// vpmaddubsw's sums of 2 into 16-bit halves, and dot_finish widens them once a block; only
// for Q4: its 8 additions a block of |q D| <= 2 * 15 * 128 stay under 2^15.
static inline vi32 dot_add(vi32 acc, vi32 u8s, vi32 s8s) {
#if PAGEDSERVE_VNNI && defined(__AVX512F__)
  return reinterpret_cast<vi32>(_mm512_dpbusd_epi32(reinterpret_cast<__m512i>(acc), reinterpret_cast<__m512i>(u8s),
                                                    reinterpret_cast<__m512i>(s8s)));
#elif PAGEDSERVE_VNNI
  return reinterpret_cast<vi32>(_mm256_dpbusd_avx_epi32(reinterpret_cast<__m256i>(acc), reinterpret_cast<__m256i>(u8s),
                                                        reinterpret_cast<__m256i>(s8s)));
#elif PAGEDSERVE_MADDUBS && defined(__AVX512F__)
  return reinterpret_cast<vi32>(_mm512_add_epi16(
      reinterpret_cast<__m512i>(acc), _mm512_maddubs_epi16(reinterpret_cast<__m512i>(u8s), reinterpret_cast<__m512i>(s8s))));
#elif PAGEDSERVE_MADDUBS
  return reinterpret_cast<vi32>(_mm256_add_epi16(
      reinterpret_cast<__m256i>(acc), _mm256_maddubs_epi16(reinterpret_cast<__m256i>(u8s), reinterpret_cast<__m256i>(s8s))));
#else
  (void)u8s;
  (void)s8s;
  return acc;  // not compiled into a matmul: kIntDot<*> is false
#endif
}
static inline vi32 dot_finish(vi32 acc) {
#if PAGEDSERVE_VNNI || !PAGEDSERVE_MADDUBS
  return acc;
#elif defined(__AVX512F__)
  return reinterpret_cast<vi32>(_mm512_madd_epi16(reinterpret_cast<__m512i>(acc), _mm512_set1_epi16(1)));
#else
  return reinterpret_cast<vi32>(_mm256_madd_epi16(reinterpret_cast<__m256i>(acc), _mm256_set1_epi16(1)));
#endif
}
// 4 digit bytes (k .. k + 3) in every lane.
static inline vi32 bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return vi32{} + v;
}

// Where a tile's rows come from: x itself (float path) or its digits (integer path).
struct Rows {
  const float* x;  // row 0 of the tile
  int64_t ldx;
  XDigits xq;
  int64_t row0;  // the tile's first row in xq
};

// How far ahead of its loads a one-row tile prefetches each of its streams, in bytes.
// Why: a one-row step streams the model's blocks once, and each block costs 24 vpdpbusd (Q4)
// on the one port that runs them, so the core is busy computing for about a third of the
// time its loads take; while it is, the hardware prefetcher, which also stops at every 4 KB
// page, does not keep enough misses in flight. A prefetch a fixed distance ahead in the
// stream issues them whatever the core is doing. Decode steps got faster with the distance up
// to a page and little beyond it, which is why it is one page; the prefetches also hide the
// latency of the part of a step's blocks that stays in a shared L3 between steps, and a
// matmul over blocks that L3 cannot hold reads at the memory's full bandwidth with them.
// Into L1: an L2-only hint measured the same. A prefetch past the end of a stream lands in
// the next one (the thread's other stream, the next thread's share, or the next matmul:
// engine/backends/cpu.py's gather lays them end to end), and one past the buffer is dropped,
// as prefetches never fault.
constexpr int64_t kStreamAhead = 4096;

// The prefetches a tile issues before its block kb: with pf (a batch's row groups), the same
// block of the thread's next panel, into L2; with Ahead (one row), kStreamAhead bytes ahead in
// each of its P panel streams, into L1.
template <bool Q4, int P, bool Ahead>
static inline void prefetch_block(const uint8_t* panel, int64_t pstride, const uint8_t* pf, int64_t kb) {
  constexpr int64_t kBlock = kBlockBytes<Q4>;
#pragma GCC unroll 9
  for (int64_t off = 0; off < kBlock; off += kLineFloats * 4) {
    if (pf) __builtin_prefetch(pf + kb * kBlock + off, 0, 2);
    if constexpr (Ahead)
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p) __builtin_prefetch(panel + p * pstride + kb * kBlock + kStreamAhead + off, 0, 3);
  }
}

// R rows against P panels `pstride` bytes apart, walked in lockstep, with integer dot
// products: per block, each row's three digit sums S_t (int32) for one vector of columns,
// then y += d 2^-e ((S0 + 256 S1) + 65536 S2) (+ m sum x~ for Q4). Q8's stored bytes are
// q + 128, so S_t there is sum (q + 128) D_t, and 128 sum D_t (xq.zero) is taken off in int32
// before anything is rounded.
template <bool Q4, int P, int R, bool Ahead>
static inline void int_tile(const Rows& rows, const uint8_t* __restrict panel, int64_t pstride, int64_t nblk,
                            float* __restrict y, int64_t ldy, int64_t ystride, const float* bias, const uint8_t* pf) {
  constexpr int64_t kBlock = kBlockBytes<Q4>;
  constexpr int W = NBQ<Q4>;
  const XDigits& xq = rows.xq;
  const vi32 nibble = vi32{} + 0x0F0F0F0F;
  vf acc[P][R];
  for (int p = 0; p < P; ++p)
    for (int r = 0; r < R; ++r) acc[p][r] = vzero();
  for (int64_t kb = 0; kb < nblk; ++kb) {
    prefetch_block<Q4, P, Ahead>(panel, pstride, pf, kb);
    const int64_t rb0 = rows.row0 * nblk + kb;  // (row, block) index of row 0; row r adds r nblk
    // g outside p: each digit broadcast is loaded once for all P panels.
    vi32 s[P][R][3];
    for (int p = 0; p < P; ++p)
      for (int r = 0; r < R; ++r)
        for (int t = 0; t < 3; ++t) s[p][r][t] = vi32{};
#pragma GCC unroll 8
    for (int g = 0; g < (Q4 ? 4 : 8); ++g) {
      vi32 lo[P], hi[P];
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p) {
        const vi32 z = load_i32(panel + p * pstride + kb * kBlock + (Q4 ? 2 : 1) * W * 4 + g * kGroupBytes<Q4>);
        lo[p] = Q4 ? (z & nibble) : z;
        if constexpr (Q4) hi[p] = (z >> 4) & nibble;
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int8_t* dg = xq.digits + (rb0 + r * nblk) * 3 * QB + 4 * g;
#pragma GCC unroll 3
        for (int t = 0; t < 3; ++t) {
          const vi32 b = bcast4(dg + t * QB);
#pragma GCC unroll 4
          for (int p = 0; p < P; ++p) s[p][r][t] = dot_add(s[p][r][t], lo[p], b);
          if constexpr (Q4) {
            const vi32 b2 = bcast4(dg + t * QB + QB / 2);
#pragma GCC unroll 4
            for (int p = 0; p < P; ++p) s[p][r][t] = dot_add(s[p][r][t], hi[p], b2);
          }
        }
      }
    }
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) {
      const float* blk = reinterpret_cast<const float*>(panel + p * pstride + kb * kBlock);
      const vf dv = vload(blk);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int64_t rb = rb0 + r * nblk;
        vi32 S[3];
        for (int t = 0; t < 3; ++t) S[t] = dot_finish(s[p][r][t]);
        if constexpr (!Q4)
          for (int t = 0; t < 3; ++t) S[t] -= xq.zero[rb * 3 + t];
        const vi32 low = (S[1] << 8) + S[0];  // |S1| < 2^21: no overflow
        const vf v = to_f(S[2]) * vsplat(65536.f) + to_f(low);
        // d first, then 2^-e: d 2^-e alone can fall below float32's normal range (x ~ 1e-37).
        acc[p][r] += (v * dv) * vsplat(xq.unit[rb]);
        if constexpr (Q4) acc[p][r] += vload(blk + W) * vsplat(xq.sum[rb]);
      }
    }
  }
  for (int p = 0; p < P; ++p)
    for (int r = 0; r < R; ++r) {
      float* o = y + r * ldy + p * ystride;
      vstore(o, bias ? vload(bias + p * ystride) + acc[p][r] : acc[p][r]);
    }
}

// The same tile with each weight de-quantized to float once in registers and used by all R
// rows (the float path's layout).
template <bool Q4, int P, int R, bool Ahead>
static inline void float_tile(const Rows& rows, const uint8_t* __restrict panel, int64_t pstride, int64_t nblk,
                              float* __restrict y, int64_t ldy, int64_t ystride, const float* bias, const uint8_t* pf) {
  constexpr int64_t kBlock = kBlockBytes<Q4>;
  constexpr int NV = NVQ<Q4>;
  const float* x = rows.x;
  const int64_t ldx = rows.ldx;
  vf acc[P][R][NV];
  for (int p = 0; p < P; ++p)
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < NV; ++v) acc[p][r][v] = vzero();
  for (int64_t kb = 0; kb < nblk; ++kb) {
    const float* xb = x + kb * QB;
    const uint8_t* blk = panel + kb * kBlock;
    prefetch_block<Q4, P, Ahead>(panel, pstride, pf, kb);
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

// Ahead: prefetch kStreamAhead bytes ahead in each panel's stream (one-row matmuls; a
// batch's row groups prefetch the next panel through pf instead).
template <bool Q4, int P, int R, bool Ahead = false>
static inline void tile(const Rows& rows, const uint8_t* panel, int64_t pstride, int64_t nblk, float* y, int64_t ldy,
                        int64_t ystride, const float* bias, const uint8_t* pf = nullptr) {
  if constexpr (kIntDot<Q4>) int_tile<Q4, P, R, Ahead>(rows, panel, pstride, nblk, y, ldy, ystride, bias, pf);
  else float_tile<Q4, P, R, Ahead>(rows, panel, pstride, nblk, y, ldy, ystride, bias, pf);
}

// How many panels one row walks in lockstep (streams from memory at once), and how many rows
// share a panel's weights, so that the accumulators, the scales and the weights stay in
// registers.
// - Float path, one row: 4 panels of Q8 blocks (the default model's tied lm_head): with 2
//   the memory sat partly idle while the core de-quantized, and 4 read faster on AVX-512
//   and AVX2. Q4's heavier de-quantization leaves less to gain: 4 panels still gain a little
//   on AVX-512, but lose on AVX2 (16 registers), which keeps 2.
// - Float path, rows per tile: 6 with AVX-512's 32 registers; with AVX2's 16, 4 (the most
//   that fit, and faster than 3 or 2).
// - Integer path: a panel is one vector wide, so a row's tile is 3 digit sums + 1 float
//   accumulator a panel.
// - Integer path, one row: 2 panels in lockstep. Its compute no longer hides memory
//   latency, and more streams read slower and more erratically than 2.
// - Integer path, rows per tile: with AVX-512 VNNI, 4, 5, 6 and 8 rows all ran alike: there
//   a step is bound by vpdpbusd's throughput (about one a cycle), so the float path's 6 is
//   kept. AVX2's 16 registers hold 2 (4 a row); 3 fill all 16 and run slower.
// On AVX2 the integer path for Q4 beats its float path most at one row, and by less with each
// row added (the calling thread's CPU time on hot weights).
template <bool Q4>
constexpr int kRowStreams = kIntDot<Q4> ? 2 : Q4 ? (kRegs == 32 ? 4 : 2) : 4;
template <bool Q4>
constexpr int kRowTile = kIntDot<Q4> ? (kRegs == 32 ? 6 : 2) : kRegs == 32 ? 6 : 4;

// Panels [begin, end) for one row: P runs of panels in lockstep (P streams), then the rest.
template <bool Q4>
static void quant_one_row(const Rows& rows, const uint8_t* wp, int64_t nblk, int64_t pbytes, float* y,
                          const float* bias, int64_t begin, int64_t end) {
  constexpr int P = kRowStreams<Q4>, W = NBQ<Q4>;
  const int64_t q = (end - begin) / P;
  for (int64_t i = 0; i < q; ++i) {
    const int64_t b = begin + i;
    tile<Q4, P, 1, true>(rows, wp + b * pbytes, q * pbytes, nblk, y + b * W, 0, q * W, bias ? bias + b * W : nullptr);
  }
  for (int64_t b = begin + P * q; b < end; ++b)
    tile<Q4, 1, 1, true>(rows, wp + b * pbytes, 0, nblk, y + b * W, 0, 0, bias ? bias + b * W : nullptr);
}

static inline Rows offset(const Rows& rows, int64_t m) {
  return Rows{rows.x + m * rows.ldx, rows.ldx, rows.xq, rows.row0 + m};
}

// The last R < kRowTile rows of a panel.
template <bool Q4, int R = 1>
static inline void tail_rows(int left, const Rows& rows, const uint8_t* panel, int64_t nblk, float* y, int64_t ldy,
                             const float* bias, const uint8_t* pf) {
  if constexpr (R < kRowTile<Q4>) {
    if (left == R) return tile<Q4, 1, R>(rows, panel, 0, nblk, y, ldy, 0, bias, pf);
    tail_rows<Q4, R + 1>(left, rows, panel, nblk, y, ldy, bias, pf);
  }
}

// All M rows against one panel, kRowTile at a time: the first group streams the panel from
// memory, the others find it in L2. The second group (or the only one) prefetches `next`, the
// thread's next panel, into L2 as it goes, so that panel's first group does not wait on
// memory. It pays most at 4-16 rows, where a panel's groups are few.
template <bool Q4>
static void quant_panel_rows(const Rows& rows, int64_t M, const uint8_t* panel, int64_t nblk, float* y, int64_t ldy,
                             const float* bias, const uint8_t* next) {
  constexpr int T = kRowTile<Q4>;
  const int64_t fetching_group = M > T ? 1 : 0;
  int64_t m = 0, group = 0;
  for (; m + T <= M; m += T, ++group)
    tile<Q4, 1, T>(offset(rows, m), panel, 0, nblk, y + m * ldy, ldy, 0, bias, group == fetching_group ? next : nullptr);
  if (m < M)
    tail_rows<Q4>(static_cast<int>(M - m), offset(rows, m), panel, nblk, y + m * ldy, ldy, bias,
                  group == fetching_group ? next : nullptr);
}

// One panel back to float32, [K, NBQ] row-major.
template <bool Q4>
static void dequantize_panel(const uint8_t* panel, int64_t nblk, float* out) {
  constexpr int W = NBQ<Q4>;
  for (int64_t kb = 0; kb < nblk; ++kb) {
    float* o = out + kb * QB * W;
    const uint8_t* b = panel + kb * kBlockBytes<Q4>;
    if constexpr (kIntDot<Q4>) {
      for (int k = 0; k < QB; ++k)
        for (int64_t c = 0; c < W; ++c) o[k * W + c] = weight_at<Q4>(b, c, k);
    } else {
      for (int j = 0; j < (Q4 ? QB / 2 : QB); ++j)
        for (int v = 0; v < NVQ<Q4>; ++v) {
          if constexpr (Q4) {
            vf lo, hi;
            q4_weights(b, j, v, lo, hi);
            vstore(o + j * W + kVec * v, lo);
            vstore(o + (j + QB / 2) * W + kVec * v, hi);
          } else {
            vstore(o + j * W + kVec * v, q8_weight(b, j, v));
          }
        }
    }
  }
}

template <bool Q4>
at::Tensor pack(const uint8_t* src, int64_t ggml_type, int64_t N, int64_t nblk, int64_t bpb,
                const at::TensorOptions& options) {
  constexpr int W = NBQ<Q4>;
  const int64_t nb = (N + W - 1) / W;
  // Padding columns: d = m = 0, so whatever q is, their weights are 0.
  at::Tensor out = at::zeros({nb, nblk, kBlockBytes<Q4>}, options);
  uint8_t* dst = out.data_ptr<uint8_t>();
  for (int64_t n = 0; n < N; ++n) {
    const int64_t b = n / W, c = n % W;
    for (int64_t kb = 0; kb < nblk; ++kb) {
      const uint8_t* s = src + n * nblk * bpb + kb * bpb;
      uint8_t* blk = dst + (b * nblk + kb) * kBlockBytes<Q4>;
      float* d = reinterpret_cast<float*>(blk);
      d[c] = half_at(s);
      if constexpr (!Q4) {  // GGUF byte j is k = j, as int8
        for (int j = 0; j < QB; ++j) blk[W * 4 + q_byte<false>(c, j)] = q8_stored(s[2 + j]);
      } else {  // GGUF byte j holds k = j (low nibble) and k = j + 16 (high): kept as a pair
        d[W + c] = ggml_type == kGgmlQ4_1 ? half_at(s + 2) : -8.0f * d[c];
        const uint8_t* qs = s + (ggml_type == kGgmlQ4_1 ? 4 : 2);
        for (int j = 0; j < QB / 2; ++j) blk[2 * W * 4 + q_byte<true>(c, j)] = qs[j];
      }
    }
  }
  return out;
}

template <bool Q4>
at::Tensor dequantize(const at::Tensor& panels, int64_t N) {
  constexpr int W = NBQ<Q4>;
  const int64_t nb = panels.size(0), nblk = panels.size(1), K = nblk * QB;
  auto full = at::empty({K, nb * W}, at::kFloat);
  std::vector<float> buf(K * W);
  for (int64_t b = 0; b < nb; ++b) {
    dequantize_panel<Q4>(panels.data_ptr<uint8_t>() + b * nblk * panels.size(2), nblk, buf.data());
    for (int64_t k = 0; k < K; ++k)
      std::memcpy(full.data_ptr<float>() + k * nb * W + b * W, buf.data() + k * W, sizeof(float) * W);
  }
  return full.narrow(1, 0, N).contiguous();
}

template <bool Q4>
void linear_into(const float* xp, int64_t M, int64_t K, const at::Tensor& panels, int64_t N,
                 const c10::optional<at::Tensor>& bias_, float* yp) {
  constexpr int W = NBQ<Q4>;
  const int64_t nb = panels.size(0), nblk = panels.size(1), NP = nb * W;
  const at::Tensor biasp = padded_bias(bias_, N, NP);
  const float* bias = biasp.defined() ? biasp.data_ptr<float>() : nullptr;
  const Rows rows{xp, K, kIntDot<Q4> ? split_digits(xp, M, K) : XDigits{}, 0};
  const uint8_t* wp = panels.data_ptr<uint8_t>();
  const int64_t pbytes = nblk * panels.size(2);
  if (M == 1)
    parallel_for(0, nb, 1, [&](int64_t begin, int64_t end) {
      quant_one_row<Q4>(rows, wp, nblk, pbytes, yp, bias, begin, end);
    });
  else
    parallel_panels(nb, M, kRowTile<Q4>, [&](int64_t b, int64_t m0, int64_t m1, int64_t next) {
      quant_panel_rows<Q4>(offset(rows, m0), m1 - m0, wp + b * pbytes, nblk, yp + m0 * NP + b * W, NP,
                           bias ? bias + b * W : nullptr, next >= 0 ? wp + next * pbytes : nullptr);
    });
}

// Output columns of a panel tensor holding q4 (else q8) blocks.
int64_t panel_columns(const at::Tensor& panels, bool q4) { return panels.size(0) * (q4 ? NBQ<true> : NBQ<false>); }

}  // namespace

int64_t quant_panel_width(int64_t ggml_type) {
  TORCH_CHECK(ggml_type == kGgmlQ4_0 || ggml_type == kGgmlQ4_1 || ggml_type == kGgmlQ8_0, "unsupported ggml type ",
              ggml_type);
  return ggml_type == kGgmlQ8_0 ? NBQ<false> : NBQ<true>;
}

at::Tensor pack_gguf(const at::Tensor& raw_, int64_t ggml_type, int64_t K) {
  TORCH_CHECK(raw_.scalar_type() == at::kByte && raw_.dim() == 2, "raw GGUF blocks must be uint8 [N, bytes]");
  TORCH_CHECK(K % QB == 0, "K must be a multiple of 32");
  const int64_t bpb = ggml_type == kGgmlQ8_0 ? 34 : ggml_type == kGgmlQ4_1 ? 20 : ggml_type == kGgmlQ4_0 ? 18 : -1;
  TORCH_CHECK(bpb > 0, "unsupported ggml type ", ggml_type);
  const int64_t N = raw_.size(0), nblk = K / QB;
  TORCH_CHECK(raw_.size(1) == nblk * bpb, "raw rows hold ", raw_.size(1), " bytes, expected ", nblk * bpb);
  auto raw = raw_.contiguous();
  const uint8_t* src = raw.data_ptr<uint8_t>();
  return ggml_type == kGgmlQ8_0 ? pack<false>(src, ggml_type, N, nblk, bpb, raw.options())
                                : pack<true>(src, ggml_type, N, nblk, bpb, raw.options());
}

// A per-output-channel int8 weight (engine/quantization.py: w[k][n] = q[k][n] * scale[n],
// |q| <= 127) as Q8 panels: every 32-block of column n gets d = scale[n], so the Q8 matmuls
// above multiply by it unchanged, with integer dot products (VNNI) or de-quantized to float in
// registers (AVX2, AVX-512 without VNNI), and dequantize_panels gives back exactly
// float(q) * scale, the float32 weight the loader checks against. Costs 9 bits a weight rather
// than 8 (the scale repeats once a block), for one tested matmul instead of a second one.
at::Tensor pack_int8(const at::Tensor& q_, const at::Tensor& scale_) {
  TORCH_CHECK(q_.scalar_type() == at::kChar && q_.dim() == 2, "pack_int8: the weight must be int8 [in, out]");
  TORCH_CHECK(scale_.scalar_type() == at::kFloat && scale_.dim() == 1 && scale_.size(0) == q_.size(1),
              "pack_int8: the scales must be float32 [out]");
  const int64_t K = q_.size(0), N = q_.size(1);
  TORCH_CHECK(K % QB == 0, "pack_int8: in_features must be a multiple of 32, got ", K);
  const auto q = q_.contiguous();
  const auto scale = scale_.contiguous();
  constexpr int W = NBQ<false>;
  const int64_t nb = (N + W - 1) / W, nblk = K / QB;
  // Padding columns: d = 0, so their weights are 0.
  at::Tensor out = at::zeros({nb, nblk, kBlockBytes<false>}, q.options().dtype(at::kByte));
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int8_t* src = q.data_ptr<int8_t>();
  const float* s = scale.data_ptr<float>();
  for (int64_t kb = 0; kb < nblk; ++kb)
    for (int64_t n = 0; n < N; ++n) {
      uint8_t* blk = dst + ((n / W) * nblk + kb) * kBlockBytes<false>;
      const int64_t c = n % W;
      reinterpret_cast<float*>(blk)[c] = s[n];
      for (int j = 0; j < QB; ++j)
        blk[W * 4 + q_byte<false>(c, j)] = q8_stored(static_cast<uint8_t>(src[(kb * QB + j) * N + n]));
    }
  return out;
}

at::Tensor dequantize_panels(const at::Tensor& panels, int64_t N) {
  return checked_q4(panels) ? dequantize<true>(panels, N) : dequantize<false>(panels, N);
}

void quant_linear_into(const at::Tensor& x_, const at::Tensor& panels, int64_t N,
                       const c10::optional<at::Tensor>& bias, at::Tensor& y) {
  auto x = x_.contiguous();
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be float32");
  const bool q4 = checked_q4(panels);
  const int64_t M = x.size(0), K = x.size(1), nblk = panels.size(1), NP = panel_columns(panels, q4);
  TORCH_CHECK(nblk * QB == K, "x has ", K, " columns, the panels ", nblk * QB, " rows");
  TORCH_CHECK(y.scalar_type() == at::kFloat && y.is_contiguous() && y.dim() == 2 && y.size(0) == M && y.size(1) == NP,
              "quant_linear_into: y must be contiguous float32 [rows, whole panels]");
  if (q4) linear_into<true>(x.data_ptr<float>(), M, K, panels, N, bias, y.data_ptr<float>());
  else linear_into<false>(x.data_ptr<float>(), M, K, panels, N, bias, y.data_ptr<float>());
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& panels, int64_t N, const c10::optional<at::Tensor>& bias) {
  const int64_t NP = panel_columns(panels, checked_q4(panels));
  auto y = at::empty({x.size(0), NP}, x.options());
  quant_linear_into(x, panels, N, bias, y);
  return NP == N ? y : y.narrow(1, 0, N).contiguous();
}

}  // namespace pagedserve_cpu
