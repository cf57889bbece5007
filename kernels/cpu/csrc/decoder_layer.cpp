// A whole decoder layer in one op call, for any step (decodes, prefill chunks or both):
// attention treats every query token as one row of the decode kernel, with its own block
// table row and context length (engine/attention.py builds them once per step).
//
// Why: at decode batch sizes a layer is ~18 Python-level calls (module calls, views, the
// kernels below); on 2 cores their interpreter and dispatch time between the kernels was
// 4-5 ms of a 37 ms batch-1 step. This runs exactly the kernels the Python layer runs on the
// cpu backend, in the same order on the same inputs, so its output is bitwise the same
// (tested); only the glue moves to C++.

#include "ops.h"

namespace pagedserve_cpu {

namespace {

// The order of the `weights` list (engine/llama.py DecoderLayer.fused_weights builds it).
enum Slot {
  kInputNorm, kPostNorm,
  kQkvW, kQkvPacked, kQkvQuant, kQkvBias,
  kOW, kOPacked, kOQuant, kOBias,
  kGateUpW, kGateUpPacked, kGateUpQuant, kGateUpBias,
  kDownW, kDownPacked, kDownQuant, kDownBias,
  kNumSlots
};

// Linear.forward for the matmul whose weight, packed copy, GGUF blocks and bias start at `slot`.
at::Tensor linear_at(const at::Tensor& x, const c10::List<c10::optional<at::Tensor>>& w, int slot) {
  return linear(x, *w.get(slot), w.get(slot + 1), w.get(slot + 2), w.get(slot + 3));
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> decoder_layer(
    const at::Tensor& x, const c10::optional<at::Tensor>& residual_in,
    const c10::List<c10::optional<at::Tensor>>& w, const at::Tensor& cos, const at::Tensor& sin,
    at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& slot_mapping,
    const at::Tensor& block_tables,  // [num_tokens, max_blocks]: each token's sequence's table
    const at::Tensor& seq_lens,      // [num_tokens]: context each token sees (position + 1)
    int64_t num_heads, int64_t num_kv_heads,
    double eps, double scale) {
  TORCH_CHECK(w.size() == kNumSlots, "decoder_layer: expected ", int(kNumSlots), " weight slots");
  const int64_t t = x.size(0), head_dim = key_cache.size(-1);
  // The first layer has no residual stream yet: it starts as the embeddings themselves.
  at::Tensor residual = residual_in.has_value() ? *residual_in : x;
  at::Tensor h = residual_in.has_value() ? add_rms_norm_(x, residual, *w.get(kInputNorm), eps)
                                         : rms_norm(x, *w.get(kInputNorm), eps);
  at::Tensor qkv = linear_at(h, w, kQkvW);
  rope_and_store_(qkv, cos, sin, key_cache, value_cache, slot_mapping, num_heads, num_kv_heads);
  const at::Tensor q = qkv.narrow(1, 0, num_heads * head_dim).view({t, num_heads, head_dim});
  const at::Tensor o = paged_attention_decode(q, key_cache, value_cache, block_tables, seq_lens, scale);
  h = add_rms_norm_(linear_at(o.reshape({t, num_heads * head_dim}), w, kOW), residual, *w.get(kPostNorm), eps);
  at::Tensor out = linear_at(silu_mul(linear_at(h, w, kGateUpW)), w, kDownW);
  return {out, residual};
}

}  // namespace pagedserve_cpu
