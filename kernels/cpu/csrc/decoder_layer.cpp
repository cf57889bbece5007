// Every decoder layer of a step in one op call, for any step (decodes, prefill chunks or
// both): attention treats every query token as one row of the decode kernel, with its own
// block table row and context length (engine/attention.py builds them once per step).
//
// Why: at decode batch sizes a layer is ~18 Python-level calls (module calls, views, the
// kernels below); on 2 cores their interpreter and dispatch time between the kernels was
// 4-5 ms of a 37 ms batch-1 step. One call per layer still cost ~100 us a layer in Python
// glue and argument conversion (18 weight slots each): ~3 ms of a 15 ms batch-1 step. One
// call for the whole stack pays that once. This runs exactly the kernels the Python layer
// runs on the cpu backend, in the same order on the same inputs, so its output is bitwise
// the same (tested); only the glue moves to C++.

#include "ops.h"

namespace pagedserve_cpu {

namespace {

// The order of each layer's slots in the `weights` list (engine/llama.py: DecoderLayer.fused_weights
// lists one layer's, LlamaForCausalLM.fused_weights all of them, layer after layer).
enum Slot {
  kInputNorm, kPostNorm,
  kQkvW, kQkvPacked, kQkvQuant, kQkvBias,
  kOW, kOPacked, kOQuant, kOBias,
  kGateUpW, kGateUpPacked, kGateUpQuant, kGateUpBias,
  kDownW, kDownPacked, kDownQuant, kDownBias,
  kNumSlots
};

// Linear.forward for the matmul whose weight, packed copy, GGUF blocks and bias start at `slot`.
at::Tensor linear_at(const at::Tensor& x, const c10::List<c10::optional<at::Tensor>>& w, size_t slot) {
  return linear(x, *w.get(slot), w.get(slot + 1), w.get(slot + 2), w.get(slot + 3));
}

// One decoder layer, its tensors at w[base + Slot]. Returns (its output, not yet added to the
// residual stream, the residual stream).
std::tuple<at::Tensor, at::Tensor> layer_forward(
    const at::Tensor& x, const c10::optional<at::Tensor>& residual_in,
    const c10::List<c10::optional<at::Tensor>>& w, size_t base, const at::Tensor& cos, const at::Tensor& sin,
    at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& slot_mapping,
    const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t num_heads, int64_t num_kv_heads,
    double eps, double scale) {
  const int64_t t = x.size(0), head_dim = key_cache.size(-1);
  // The first layer has no residual stream yet: it starts as the embeddings themselves.
  at::Tensor residual = residual_in.has_value() ? *residual_in : x;
  at::Tensor h = residual_in.has_value() ? add_rms_norm_(x, residual, *w.get(base + kInputNorm), eps)
                                         : rms_norm(x, *w.get(base + kInputNorm), eps);
  at::Tensor qkv = linear_at(h, w, base + kQkvW);
  rope_and_store_(qkv, cos, sin, key_cache, value_cache, slot_mapping, num_heads, num_kv_heads);
  const at::Tensor q = qkv.narrow(1, 0, num_heads * head_dim).view({t, num_heads, head_dim});
  const at::Tensor o = paged_attention_decode(q, key_cache, value_cache, block_tables, seq_lens, scale);
  h = add_rms_norm_(linear_at(o.reshape({t, num_heads * head_dim}), w, base + kOW), residual,
                    *w.get(base + kPostNorm), eps);
  at::Tensor out = linear_at(silu_mul(linear_at(h, w, base + kGateUpW)), w, base + kDownW);
  return {out, residual};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> decoder_layers(
    const at::Tensor& x, const c10::List<c10::optional<at::Tensor>>& w, at::TensorList key_caches,
    at::TensorList value_caches, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slot_mapping,
    const at::Tensor& block_tables,  // [num_tokens, max_blocks]: each token's sequence's table
    const at::Tensor& seq_lens,      // [num_tokens]: context each token sees (position + 1)
    int64_t num_heads, int64_t num_kv_heads, double eps, double scale) {
  const size_t layers = key_caches.size();
  TORCH_CHECK(layers > 0 && value_caches.size() == layers && w.size() == layers * kNumSlots,
              "decoder_layers: expected a key and a value cache and ", int(kNumSlots), " weight slots a layer");
  at::Tensor h = x;
  c10::optional<at::Tensor> residual;
  for (size_t l = 0; l < layers; ++l) {
    at::Tensor key_cache = key_caches[l], value_cache = value_caches[l];
    auto [out, res] = layer_forward(h, residual, w, l * kNumSlots, cos, sin, key_cache, value_cache, slot_mapping,
                                    block_tables, seq_lens, num_heads, num_kv_heads, eps, scale);
    h = std::move(out);
    residual = std::move(res);
  }
  return {h, *residual};
}

}  // namespace pagedserve_cpu
