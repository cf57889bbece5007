// What the float32 matmul (gemm.cpp) and the GGUF-block matmul (gemm_q.cpp) share: the panel
// layout and the padded bias.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "team.h"
#include "vec.h"

namespace pagedserve_cpu {

// Panel width (floats): packed panels are [ceil(N / NB), K, NB]. A tile keeps rows x NB
// accumulators in vector registers while a panel streams past, so the width follows the
// register file: with AVX-512 (32 registers of 16 floats) 64 columns are 4 registers a row
// and leave room for 6 rows; with AVX2 (16 registers of 8 floats) 64 columns would take 8 a
// row, so panels are 16 wide, the classic 6 x 16 tile (12 accumulators + 2 weights + 1
// broadcast). The layout depends on the build's target; nothing stores packed panels.
constexpr int NB = kRegs == 32 ? 64 : 16;
constexpr int NV = NB / kVec;  // vectors per panel row
static_assert(NB % kVec == 0, "a panel row is whole vectors");

// Which GGUF formats the block matmul multiplies with integer dot products (gemm_q.cpp says
// how): both with VNNI; with AVX2 or AVX-512BW alone Q4 (vpmaddubsw's 16-bit sums hold Q4's
// 4-bit weights but would overflow on Q8's bytes). kVnni also sets how far the blocks serve (gemm.cpp).
// The two macros are the one statement of which instructions the build has at its vector
// width; gemm_q.cpp picks its intrinsics by them.
#if (defined(__AVX512VNNI__) && defined(__AVX512F__)) || (defined(__AVXVNNI__) && !defined(__AVX512F__))
#define PAGEDSERVE_VNNI 1  // vpdpbusd
#else
#define PAGEDSERVE_VNNI 0
#endif
#if (defined(__AVX512F__) && defined(__AVX512BW__)) || (!defined(__AVX512F__) && defined(__AVX2__))
#define PAGEDSERVE_MADDUBS 1  // vpmaddubsw
#else
#define PAGEDSERVE_MADDUBS 0
#endif
constexpr bool kVnni = PAGEDSERVE_VNNI;
constexpr bool kIntQ4 = PAGEDSERVE_VNNI || PAGEDSERVE_MADDUBS;
template <bool Q4>
constexpr bool kIntDot = Q4 ? kIntQ4 : kVnni;
// A block panel's width: one vector where the format's matmul is integer, NB where it
// de-quantizes to float.
template <bool Q4>
constexpr int NBQ = kIntDot<Q4> ? kVec : NB;

// The bias padded with zeros to the panels' NP >= N columns (undefined tensor: no bias).
at::Tensor padded_bias(const c10::optional<at::Tensor>& bias, int64_t N, int64_t NP);

// Floats in one 64-byte cache line: the unit of the software prefetches below.
constexpr int64_t kLineFloats = 16;

// fn(panel, row_begin, row_end, next) over every panel of an M-row matmul (M >= 2), the
// panels split over the threads; `next` is the panel the same thread takes after this one
// (-1 if none), for the caller to prefetch while this one is computed.
//
// Threads take whole panels, so each panel is streamed from memory once, by one thread.
// When the panel count does not divide evenly (9 panels for the model's 576 columns: 5 + 4 on
// 2 threads, a ninth of the matmul with one thread idle), each panel is cut into per-thread
// row ranges of whole `tile`s and the threads take equal runs of those pieces, so only the
// panel at a boundary is shared. Batches under 4 tiles keep whole panels: a thread's share of
// a small batch would be a partial tile.
template <class F>
void parallel_panels(int64_t nb, int64_t M, int64_t tile, const F& fn) {
  const int64_t T = num_threads();
  const int64_t G = T > 1 && nb % T != 0 && M >= 4 * tile ? T : 1;
  const int64_t chunk = ((M + G - 1) / G + tile - 1) / tile * tile;
  parallel_for(0, nb * G, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / G, m0 = (i % G) * chunk, m1 = std::min(M, m0 + chunk);
      const int64_t next = i + 1 < end && (i + 1) / G != b ? (i + 1) / G : -1;
      if (m0 < m1) fn(b, m0, m1, next);
    }
  });
}

}  // namespace pagedserve_cpu
