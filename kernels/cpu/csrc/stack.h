// The fused decoder stack's entry point (decoder_layer.cpp) and the classes its weights and
// caches cross from Python in, registered as torch.classes.pagedserve_cpu.* (register.cpp).
// Apart from ops.h because ivalue.h, which the classes need, is a heavy header that the
// other sources do not.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>  // torch::CustomClassHolder, c10::List

#include <tuple>

namespace pagedserve_cpu {

// The fused stack's weights, kNumSlots tensors a layer (decoder_layer.cpp), converted from
// Python once (torch.classes.pagedserve_cpu.StackWeights) and passed to every step as one
// object. Why: passed as a list, every entry (kNumSlots a layer) was converted to C++ on
// every call, a visible share of a batch-1 step.
struct StackWeights : torch::CustomClassHolder {
  c10::List<c10::optional<at::Tensor>> w;
  explicit StackWeights(c10::List<c10::optional<at::Tensor>> weights) : w(std::move(weights)) {}
  int64_t size() const { return int64_t(w.size()); }
};

// The KV cache's per-layer tensors, converted from Python once, for the same reason: as two
// Tensor[] arguments, the default model's 60 cache tensors were converted on every call.
// key_offsets: none, or one per layer (rope_and_store_'s key_offset), set after construction.
struct StackCaches : torch::CustomClassHolder {
  c10::List<at::Tensor> k, v, key_offsets;
  StackCaches(c10::List<at::Tensor> key_caches, c10::List<at::Tensor> value_caches)
      : k(std::move(key_caches)), v(std::move(value_caches)) {}
  int64_t size() const { return int64_t(k.size()); }
  void set_key_offsets(c10::List<at::Tensor> offsets) {
    TORCH_CHECK(offsets.empty() || offsets.size() == k.size(), "one key offset per layer, or none");
    key_offsets = std::move(offsets);
  }
};

// The model from token ids to the last layer's output and residual stream, or with `logits`
// on to the logits of every row (decoder_layer.cpp).
std::tuple<at::Tensor, at::Tensor> decoder_layers(
    const at::Tensor& input_ids, const at::Tensor& positions, const c10::intrusive_ptr<StackWeights>& weights,
    const c10::intrusive_ptr<StackCaches>& caches, const at::Tensor& cos_table, const at::Tensor& sin_table,
    const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t num_heads,
    int64_t num_kv_heads, double eps, double scale, bool logits);

}  // namespace pagedserve_cpu
