// The CPU kernels' entry points, shared by the op registration and the fused decoder layer.
#pragma once

// Each source includes the ATen headers it uses, not <ATen/ATen.h>: that one header takes
// about 9 s of a 2-core machine's compile per source, the core ones under 2.
#include <ATen/core/Tensor.h>

#include <tuple>

namespace pagedserve_cpu {

// Most ops come in two forms: one that returns a new tensor (the registered op) and `_into`,
// which writes into a tensor the caller owns (contiguous, of the op's output shape; a matmul's
// y has whole panels of columns). decoder_layers runs a step on `_into` forms over buffers it
// allocates once: a decode step streams megabytes of weights between two ops, which evicts
// the allocator's and the dispatcher's code and data from the caches, so each allocation
// there cost several microseconds of cache misses.

// sliding_window: each query row sees only the last that many keys of its context.
at::Tensor paged_attention_decode(const at::Tensor& query, const at::Tensor& key_cache,
                                  const at::Tensor& value_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, double scale,
                                  c10::optional<int64_t> sliding_window = c10::nullopt);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor add_rms_norm_(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps);
at::Tensor silu_mul(const at::Tensor& gate_up);
at::Tensor argmax_rows(const at::Tensor& x);
// An int8 or fp8 KV cache in the quantized layout: the values view of [blocks, block_size, kv_heads,
// head_dim + 2] rows, each followed by its float16 scale (kernels/kv_quant.py, kv_quant.h).
bool is_quantized_cache(const at::Tensor& cache);
void paged_attention_decode_into(const at::Tensor& query, const at::Tensor& key_cache,
                                 const at::Tensor& value_cache, const at::Tensor& block_tables,
                                 const at::Tensor& seq_lens, double scale, at::Tensor& out,
                                 int64_t sliding_window = 0);
void rms_norm_into(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out);
void add_rms_norm_into(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps,
                       at::Tensor& out);
void silu_mul_into(const at::Tensor& gate_up, at::Tensor& out);
void packed_linear_into(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                        const c10::optional<at::Tensor>& bias, at::Tensor& y);
void quant_linear_into(const at::Tensor& x, const at::Tensor& panels, int64_t out_features,
                       const c10::optional<at::Tensor>& bias, at::Tensor& y);
void linear_into(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& packed,
                 const c10::optional<at::Tensor>& quant, const c10::optional<at::Tensor>& bias, at::Tensor& y);
// key_offset (an int8 or fp8 cache): float32 [num_kv_heads, head_dim], subtracted from each key
// before it is quantized (kernels/kv_quant.py).
void rope_and_store_(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& key_cache,
                     at::Tensor& value_cache, const at::Tensor& slot_mapping, int64_t num_heads,
                     int64_t num_kv_heads, const c10::optional<at::Tensor>& key_offset = c10::nullopt);
at::Tensor pack_weight(const at::Tensor& weight);
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                         const c10::optional<at::Tensor>& bias);
at::Tensor pack_gguf(const at::Tensor& raw, int64_t ggml_type, int64_t in_features);
at::Tensor pack_int8(const at::Tensor& weight, const at::Tensor& scale);
at::Tensor dequantize_panels(const at::Tensor& panels, int64_t out_features);
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& panels, int64_t out_features,
                        const c10::optional<at::Tensor>& bias);
int64_t max_quant_rows();   // linear() uses GGUF blocks for batches of 1 to this many rows
int64_t max_packed_rows();  // ... and the float32 panels up to this many (then the library)
int64_t panel_width();     // output columns per packed panel (64 with AVX-512, 16 with AVX2)
int64_t quant_panel_width(int64_t ggml_type);  // ... per GGUF-block panel of that type (gemm.h NBQ)
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& packed,
                  const c10::optional<at::Tensor>& quant, const c10::optional<at::Tensor>& bias);
// The fused stack's entry point, decoder_layers, and its argument classes: stack.h.
// The step profile of decoder_layers (decoder_layer.cpp): on/off (either resets it), and
// read: seconds per kernel summed since the last read, then the seconds of whole
// decoder_layers calls, then the layer calls timed; resets.
void step_profile(bool on);
at::Tensor step_profile_read();
// decoder_layers runs steps of at most `rows` rows in one team of threads (team.h; 0: none,
// default 16); returns the previous limit. For tests and A/B measurements.
int64_t set_stack_team_rows(int64_t rows);
// Whether the fused stack narrows its team while other processes hold some of this
// process's CPUs (contention.h); returns the previous setting. On by default.
bool set_stack_adapt_threads(bool on);
// For tests and A/B measurements: threads > 0 runs every team step with that many of the
// team's threads (1: solo), in the whole team's split; 0 (default) lets contention.h decide.
// Returns the previous value.
int64_t set_stack_active_threads(int64_t threads);
// Whether the fused stack's last team step ran fewer threads than the team (contention.h):
// a kernel called between steps with little work then runs on its caller alone, because a
// parallel region's thread on a neighbour's CPU would hold the whole step up.
bool stack_narrowed();
// contention.h's CpuContention::read(): [threads of a team step now (0: the whole team),
// CPUs other processes took in the last period, periods sampled, periods ended narrowed].
at::Tensor stack_contention_read();

}  // namespace pagedserve_cpu
