// What the float32 matmul (gemm.cpp) and the GGUF-block matmul (gemm_q.cpp) share: the panel
// layout and the padded bias.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

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

// The bias padded with zeros to the panels' NP >= N columns (undefined tensor: no bias).
at::Tensor padded_bias(const c10::optional<at::Tensor>& bias, int64_t N, int64_t NP);

}  // namespace pagedserve_cpu
