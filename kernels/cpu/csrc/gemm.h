// The float32 panel kernels of gemm.cpp that the quantized matmul (gemm_q.cpp) reuses once it
// has turned a panel back into float32.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace pagedserve_cpu {

constexpr int NB = 64;  // panel width (floats): packed panels are [ceil(N / 64), K, 64]

// y[0:M, 0:64] = bias + x[0:M, 0:K] @ panel[0:K, 0:64]; M >= 2.
void panel_rows(const float* x, int64_t ldx, int64_t M, const float* panel, int64_t K, float* y,
                int64_t ldy, const float* bias);

// The bias padded with zeros to the panels' NP >= N columns (undefined tensor: no bias).
at::Tensor padded_bias(const c10::optional<at::Tensor>& bias, int64_t N, int64_t NP);

}  // namespace pagedserve_cpu
