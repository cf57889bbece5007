// Float32 matmul for batches of 1-256 rows (decodes, prefill chunks, a long step's passes), y = x @ W (+ bias),
// against weights packed once at load into column panels, [ceil(N / NB), K, NB] (NB = 64
// floats with AVX-512, 16 with AVX2: gemm.h says why): each panel is one contiguous stream.
//
// Why not oneDNN/MKL here: for small batches this kernel is clearly faster on the same
// weights (rows x 4 accumulators of 16 floats stay in registers while a panel streams past;
// the panel's later row groups hit L2), and up to kMaxPackedRows it stays ahead because it
// reads the packed panels while the library packs the weight again on every call
// (kMaxPackedRows says how far). One row is a pure weight stream: each thread reads
// one contiguous share of the weights as two sequential streams (kRowStreams says why), as
// fast as a plain sum over them. Larger batches (long prefill chunks) use the library on the
// unpacked weights.

#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "gemm.h"
#include "ops.h"
#include "team.h"
#include "vec.h"

namespace pagedserve_cpu {

namespace {

// y[r, 0:NB] = bias + x[r, 0:K] @ panel[0:K, 0:NB] for R rows. The k range is cut into S
// segments walked in lockstep: S concurrent sequential streams per thread keep more cache
// misses in flight than one (a single stream falls well short of the memory bandwidth).
// Registers: S * R * NV accumulators + NV weights + 1 broadcast (R * S <= 6 fits AVX-512 and AVX2).
// `pf`, if set: one cache line per k step, pf[0 : K * kLineFloats), is prefetched into L2.
template <int R, int S>
static inline void micro(const float* __restrict x, int64_t ldx, const float* __restrict panel, int64_t K,
                         float* __restrict y, int64_t ldy, const float* bias, const float* pf = nullptr) {
  vf acc[S][R][NV];
  for (int s = 0; s < S; ++s)
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < NV; ++v) acc[s][r][v] = vzero();
  const int64_t seg = K / S;
  for (int64_t k = 0; k < seg; ++k) {
    if (pf) __builtin_prefetch(pf + k * kLineFloats, 0, 2);
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s) {
      const int64_t kk = s * seg + k;
      const float* w = panel + kk * NB;
      vf wv[NV];
      for (int v = 0; v < NV; ++v) wv[v] = vload(w + kVec * v);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        vf b = vbcast(x + r * ldx + kk);
        for (int v = 0; v < NV; ++v) acc[s][r][v] += b * wv[v];
      }
    }
  }
  for (int64_t kk = S * seg; kk < K; ++kk) {  // the tail when S does not divide K
    const float* w = panel + kk * NB;
    for (int r = 0; r < R; ++r) {
      vf b = vbcast(x + r * ldx + kk);
      for (int v = 0; v < NV; ++v) acc[0][r][v] += b * vload(w + kVec * v);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) {
      vf t = bias ? vload(bias + kVec * v) : vzero();
      for (int s = 0; s < S; ++s) t += acc[s][r][v];
      vstore(y + r * ldy + kVec * v, t);
    }
}

// Panels one row walks in lockstep: 2, each a sequential stream. Since each thread reads one
// contiguous share of a matmul (one_row_shared) from one buffer (engine/backends/cpu.py, gather),
// fewer streams read faster than the 4 (AVX-512) or 6 (AVX2) that fit the registers. Over
// the model's one-row matmuls, 2 streams were the fastest on AVX2 and even with 1 on
// AVX-512, in fast and slow memory-bandwidth periods alike, and as fast as a plain sum over
// the same weights: the matmul is then bound by the memory, not by the kernel.
constexpr int kRowStreams = 2;

// One row against P panels `pstride` floats apart, all walked in lockstep: P sequential
// streams per thread, the most misses in flight a single row can have.
template <int P>
static inline void row_streams(const float* __restrict x, const float* __restrict panel, int64_t pstride,
                               int64_t K, float* __restrict y, int64_t ystride, const float* bias) {
  vf acc[P][NV];
  for (int p = 0; p < P; ++p)
    for (int v = 0; v < NV; ++v) acc[p][v] = vzero();
  for (int64_t k = 0; k < K; ++k) {
    const vf b = vbcast(x + k);
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) {
      const float* w = panel + p * pstride + k * NB;
      for (int v = 0; v < NV; ++v) acc[p][v] += b * vload(w + kVec * v);
    }
  }
  for (int p = 0; p < P; ++p)
    for (int v = 0; v < NV; ++v) {
      const vf t = bias ? vload(bias + p * ystride + kVec * v) + acc[p][v] : acc[p][v];
      vstore(y + p * ystride + kVec * v, t);
    }
}

// One row, panels [begin, end): kRowStreams equal runs of panels walked in lockstep, then
// the leftover panels one at a time with their k range cut into 4 streams.
static void one_row(const float* x, const float* wp, int64_t K, float* y, const float* bias,
                    int64_t begin, int64_t end) {
  constexpr int P = kRowStreams;
  const int64_t q = (end - begin) / P;
  for (int64_t i = 0; i < q; ++i) {
    const int64_t b = begin + i;
    row_streams<P>(x, wp + b * K * NB, q * K * NB, K, y + b * NB, q * NB, bias ? bias + b * NB : nullptr);
  }
  for (int64_t b = begin + P * q; b < end; ++b)
    micro<1, 4>(x, K, wp + b * K * NB, K, y + b * NB, NB, bias ? bias + b * NB : nullptr);
}

// One row's matmul split into equal shares of its bytes. The panels lie end to end in memory
// as nb runs of K rows of NB floats, and thread t of T takes rows [nb K t / T, nb K (t + 1) / T):
// one contiguous range, the same size for every thread whether or not T divides nb. Inside
// it, the panels it holds entirely go through one_row; rows [k0, k1) of a panel it shares
// with a neighbouring thread (at most one at each end) are cut into kRowStreams streams and
// written as a partial row into the thread's own row of a [T, NP] buffer, and the shared
// panels' partial rows are added up once every thread is done.
//
// Why not whole panels per thread: the model's 576 columns are 9 panels of 64 (5 + 4 on 2
// threads, one thread idle a ninth of the matmul), its q/k/v 15 (8 + 7). Why not each thread
// a half of every panel's K range (what this kernel did before for those shapes): a thread
// then reads 9-15 short runs instead of one, and equal contiguous shares measured faster
// over the model's one-row matmuls. The GGUF-block kernel (gemm_q.cpp) keeps whole panels:
// its one-row matmuls are compute-bound, and a piece de-quantized apart from its thread's
// other panels cost more than the balance saved.
static void one_row_shared(const float* x, const float* wp, int64_t K, int64_t nb, int64_t NP,
                           const float* bias, float* y) {
  const int64_t T = num_threads(), total = nb * K;
  thread_local std::vector<float> part;  // [T, NP]; only shared panels' entries are written
  part.resize(static_cast<size_t>(T * NP));
  float* pp = part.data();
  // Rows [k0, k1) of panel b into thread t's partial row.
  auto piece = [&](int64_t t, int64_t b, int64_t k0, int64_t k1) {
    micro<1, kRowStreams>(x + k0, K, wp + (b * K + k0) * NB, k1 - k0, pp + t * NP + b * NB, NB, nullptr);
  };
  parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r0 = total * t / T, r1 = total * (t + 1) / T;
      int64_t b = r0 / K;
      if (r0 % K) {  // the head: the end of a panel the previous thread begins
        piece(t, b, r0 % K, std::min(K, r1 - b * K));
        ++b;
      }
      const int64_t last = r1 / K;  // panels [b, last) are this thread's alone
      if (last > b) one_row(x, wp, K, y, bias, b, last);
      if (last >= b && last < nb && r1 % K)  // the tail: the start of a panel the next thread ends
        piece(t, last, 0, r1 % K);
    }
  });
  // Shared panels: y = the sum of the partial rows of every thread whose range meets them.
  for (int64_t s = 1, done = -1; s < T; ++s) {
    const int64_t r = total * s / T, b = r / K;
    if (r % K == 0 || b == done) continue;
    done = b;
    float* yb = y + b * NB;
    for (int64_t j = 0; j < NB; ++j) yb[j] = bias ? bias[b * NB + j] : 0.f;
    for (int64_t t = 0; t < T; ++t)
      if (total * t / T < (b + 1) * K && total * (t + 1) / T > b * K)
        for (int64_t j = 0; j < NB; ++j) yb[j] += pp[t * NP + b * NB + j];
  }
}

// Rows of the L2 tiles after a panel's first group: 6 x NV accumulators fill AVX-512's and
// AVX2's registers (micro). parallel_panels cuts batches in whole tiles of this size.
constexpr int kRowTile = 6;

#define MICRO(R, S) micro<R, S>(x, ldx, panel, K, y, ldy, bias)
// All M >= 2 rows of one panel: the first group streams the panel from memory (several
// streams), the following groups find it in L2. Those groups also prefetch `next` (the
// thread's next panel, if any) into L2, one line per k step, so that its first group does
// not wait on memory: a panel is K * NB / kLineFloats lines, NB / kLineFloats groups' worth.
// The prefetch pays at 32-64 rows, where a panel's groups are few and its first group's
// wait is a large part of them; at 128-256 rows it is about even.
static void panel_rows(const float* x, int64_t ldx, int64_t M, const float* panel, int64_t K,
                       float* y, int64_t ldy, const float* bias, const float* next) {
  // first group (M >= 2: a single row goes to one_row)
  int64_t m = 0;
  if (M == 2) { MICRO(2, 3); m = 2; }
  else { MICRO(3, 2); m = 3; }
  for (int64_t group = 0; m < M; ++group) {
    int64_t left = M - m;
    const float* xm = x + m * ldx; float* ym = y + m * ldy;
    if (left >= kRowTile) {
      const bool fetch = next && group < NB / kLineFloats;
      micro<kRowTile, 1>(xm, ldx, panel, K, ym, ldy, bias, fetch ? next + group * K * kLineFloats : nullptr);
      m += kRowTile;
    } else {
      switch (left) {
        case 1: micro<1, 1>(xm, ldx, panel, K, ym, ldy, bias); break;
        case 2: micro<2, 1>(xm, ldx, panel, K, ym, ldy, bias); break;
        case 3: micro<3, 1>(xm, ldx, panel, K, ym, ldy, bias); break;
        case 4: micro<4, 1>(xm, ldx, panel, K, ym, ldy, bias); break;
        default: micro<5, 1>(xm, ldx, panel, K, ym, ldy, bias); break;
      }
      m += left;
    }
  }
}
#undef MICRO

}  // namespace

at::Tensor padded_bias(const c10::optional<at::Tensor>& bias, int64_t N, int64_t NP) {
  if (!bias.has_value()) return at::Tensor();
  auto out = at::zeros({NP}, bias->options().dtype(at::kFloat));
  out.narrow(0, 0, N).copy_(*bias);
  return out;
}

at::Tensor pack_weight(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat);
  auto wc = w.contiguous();
  int64_t K = w.size(0), N = w.size(1), nb = (N + NB - 1) / NB;
  auto out = at::zeros({nb, K, NB}, w.options());
  const float* src = wc.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  for (int64_t b = 0; b < nb; ++b) {
    int64_t n0 = b * NB, nc = std::min<int64_t>(NB, N - n0);
    for (int64_t k = 0; k < K; ++k) std::memcpy(dst + (b * K + k) * NB, src + k * N + n0, sizeof(float) * nc);
  }
  return out;
}

void packed_linear_into(const at::Tensor& x_, const at::Tensor& packed, int64_t N,
                        const c10::optional<at::Tensor>& bias_, at::Tensor& y) {
  auto x = x_.contiguous();
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat);
  int64_t M = x.size(0), K = x.size(1), nb = packed.size(0), NP = nb * NB;
  TORCH_CHECK(packed.size(1) == K && packed.size(2) == NB);
  TORCH_CHECK(y.scalar_type() == at::kFloat && y.is_contiguous() && y.dim() == 2 && y.size(0) == M && y.size(1) == NP,
              "packed_linear_into: y must be contiguous float32 [rows, whole panels]");
  const at::Tensor biasp = padded_bias(bias_, N, NP);
  const float* bias = biasp.defined() ? biasp.data_ptr<float>() : nullptr;
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (M == 1)
    one_row_shared(xp, wp, K, nb, NP, bias, yp);  // equal shares of the weight bytes per thread
  else
    // Several rows: each panel against every row of the batch while it is hot.
    parallel_panels(nb, M, kRowTile, [&](int64_t b, int64_t m0, int64_t m1, int64_t next) {
      if (m1 - m0 == 1) return one_row(xp + m0 * K, wp, K, yp + m0 * NP, bias, b, b + 1);
      panel_rows(xp + m0 * K, K, m1 - m0, wp + b * K * NB, K, yp + m0 * NP + b * NB, NP,
                 bias ? bias + b * NB : nullptr, next >= 0 ? wp + next * K * NB : nullptr);
    });
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N, const c10::optional<at::Tensor>& bias) {
  const int64_t NP = packed.size(0) * NB;
  auto y = at::empty({x.size(0), NP}, x.options());
  packed_linear_into(x, packed, N, bias, y);
  return NP == N ? y : y.narrow(1, 0, N).contiguous();
}

// The one rule for which matmul serves a batch (Linear.forward and decoder_layers both call
// this): the checkpoint's GGUF blocks (gemm_q.cpp) for 1 to kMaxQuantRows rows, where reading
// 6-9 bits a weight instead of 32 wins; the float32 panels up to kMaxPackedRows, where
// de-quantizing every weight again per 6 rows costs more than the bytes it saves; the
// library on the plain [in, out] weight for larger batches, where it is as fast and needs no
// packed copy's cache traffic. kMaxQuantRows is where the blocks stop beating the float32
// panels, measured for each build on one machine (time on 2 threads, and one thread's CPU
// time, which the VM's stolen time does not reach):
// - VNNI (both formats in integers): the two are even from 32 to 64 rows; the blocks keep
//   those, as they leave more of the memory bandwidth to anything running beside.
// - AVX-512 without VNNI (x86-64-v4: Q4 in integers, the Q8 head de-quantized): 12 rows.
// - AVX2 (x86-64-v3, the library held to AVX2 too): 8 rows.
// Multiplying Q4 in integers is cheaper for one row and dearer per extra row than
// de-quantizing to floats, so those builds cross over at fewer rows than they did before.
constexpr int64_t kMaxQuantRows = kVnni ? 64 : kRegs == 32 ? 12 : 8;
// Batches over 256 rows go to the library; the engine never sends any (engine/backends/cpu.py
// runs a larger step in passes of max_packed_rows() rows, so its matmuls stay here). AVX2
// builds too: with the library held to AVX2 (MKL_ENABLE_INSTRUCTIONS=AVX2,
// ATEN_CPU_CAPABILITY=avx2, as on an AVX2-only machine) the panels stay ahead of it at every
// batch size up to 256 rows, in time and in one thread's CPU time, and a batch of prompts'
// first step is faster in passes of 256 rows than of 64.
constexpr int64_t kMaxPackedRows = 256;
int64_t max_quant_rows() { return kMaxQuantRows; }
int64_t max_packed_rows() { return kMaxPackedRows; }
int64_t panel_width() { return NB; }

namespace {
enum class Matmul { kBlocks, kPanels, kLibrary };
// The rule above, for a batch of `rows` and the copies a Linear holds.
Matmul pick(int64_t rows, const c10::optional<at::Tensor>& packed, const c10::optional<at::Tensor>& quant) {
  if (quant.has_value() && rows >= 1 && rows <= kMaxQuantRows) return Matmul::kBlocks;
  if (packed.has_value() && rows >= 1 && rows <= kMaxPackedRows) return Matmul::kPanels;
  return Matmul::kLibrary;
}
}  // namespace

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& packed,
                  const c10::optional<at::Tensor>& quant, const c10::optional<at::Tensor>& bias) {
  switch (pick(x.size(0), packed, quant)) {
    case Matmul::kBlocks: return quant_linear(x, *quant, weight.size(1), bias);
    case Matmul::kPanels: return packed_linear(x, *packed, weight.size(1), bias);
    default: return bias.has_value() ? at::addmm(*bias, x, weight) : at::mm(x, weight);
  }
}

// linear() into y [rows, out_features], by the same rule. The kernels write whole panels, so
// an out_features that is not a multiple of the panel width goes through linear() and a copy.
void linear_into(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& packed,
                 const c10::optional<at::Tensor>& quant, const c10::optional<at::Tensor>& bias, at::Tensor& y) {
  const Matmul m = pick(x.size(0), packed, quant);
  if (m == Matmul::kLibrary) {
    if (bias.has_value()) at::addmm_out(y, *bias, x, weight);
    else at::mm_out(y, x, weight);
  } else if (weight.size(1) % NB != 0) {
    y.copy_(linear(x, weight, packed, quant, bias));
  } else if (m == Matmul::kBlocks) {
    quant_linear_into(x, *quant, weight.size(1), bias, y);
  } else {
    packed_linear_into(x, *packed, weight.size(1), bias, y);
  }
}
}  // namespace pagedserve_cpu
