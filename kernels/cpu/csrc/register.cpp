// The operator schemas of the CPU kernels: torch.ops.pagedserve_cpu.<name>.

#include <torch/custom_class.h>
#include <torch/library.h>

#include "ops.h"
#include "stack.h"

TORCH_LIBRARY(pagedserve_cpu, m) {
  m.def("paged_attention_decode(Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_tables, Tensor seq_lens, float scale, int? sliding_window=None) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("rope_and_store_(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor(b!) key_cache, "
        "Tensor(c!) value_cache, Tensor slot_mapping, int num_heads, int num_kv_heads, "
        "Tensor? key_offset=None) -> ()");
  m.def("pack_weight(Tensor weight) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
  m.def("pack_gguf(Tensor raw, int ggml_type, int in_features) -> Tensor");
  m.def("pack_int8(Tensor weight, Tensor scale) -> Tensor");
  m.def("dequantize_panels(Tensor panels, int out_features) -> Tensor");
  m.def("quant_linear(Tensor x, Tensor panels, int out_features, Tensor? bias) -> Tensor");
  // No tensor argument, so a catch-all kernel (no dispatch key to select on).
  m.def("max_quant_rows() -> int", &pagedserve_cpu::max_quant_rows);
  m.def("max_packed_rows() -> int", &pagedserve_cpu::max_packed_rows);
  m.def("panel_width() -> int", &pagedserve_cpu::panel_width);
  m.def("quant_panel_width(int ggml_type) -> int", &pagedserve_cpu::quant_panel_width);
  m.def("step_profile(bool on) -> ()", &pagedserve_cpu::step_profile);
  m.def("step_profile_read() -> Tensor", &pagedserve_cpu::step_profile_read);
  m.def("set_stack_team_rows(int rows) -> int", &pagedserve_cpu::set_stack_team_rows);
  m.def("set_stack_adapt_threads(bool on) -> bool", &pagedserve_cpu::set_stack_adapt_threads);
  m.def("set_stack_active_threads(int threads) -> int", &pagedserve_cpu::set_stack_active_threads);
  m.def("stack_contention_read() -> Tensor", &pagedserve_cpu::stack_contention_read);
  m.def("linear(Tensor x, Tensor weight, Tensor? packed, Tensor? quant, Tensor? bias) -> Tensor");
  m.class_<pagedserve_cpu::StackWeights>("StackWeights")
      .def(torch::init<c10::List<c10::optional<at::Tensor>>>())
      .def("size", &pagedserve_cpu::StackWeights::size);
  m.class_<pagedserve_cpu::StackCaches>("StackCaches")
      .def(torch::init<c10::List<at::Tensor>, c10::List<at::Tensor>>())
      .def("size", &pagedserve_cpu::StackCaches::size)
      .def("set_key_offsets", &pagedserve_cpu::StackCaches::set_key_offsets);
  // The caches object's tensors are written (K/V of the step's tokens).
  m.def("decoder_layers(Tensor input_ids, Tensor positions, __torch__.torch.classes.pagedserve_cpu.StackWeights weights, "
        "__torch__.torch.classes.pagedserve_cpu.StackCaches caches, Tensor cos_table, Tensor sin_table, "
        "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, "
        "int num_heads, int num_kv_heads, float eps, float scale, bool logits) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) {
  m.impl("paged_attention_decode", pagedserve_cpu::paged_attention_decode);
  m.impl("rms_norm", pagedserve_cpu::rms_norm);
  m.impl("add_rms_norm_", pagedserve_cpu::add_rms_norm_);
  m.impl("silu_mul", pagedserve_cpu::silu_mul);
  m.impl("argmax_rows", pagedserve_cpu::argmax_rows);
  m.impl("rope_and_store_", pagedserve_cpu::rope_and_store_);
  m.impl("pack_weight", pagedserve_cpu::pack_weight);
  m.impl("packed_linear", pagedserve_cpu::packed_linear);
  m.impl("pack_gguf", pagedserve_cpu::pack_gguf);
  m.impl("pack_int8", pagedserve_cpu::pack_int8);
  m.impl("dequantize_panels", pagedserve_cpu::dequantize_panels);
  m.impl("quant_linear", pagedserve_cpu::quant_linear);
  m.impl("linear", pagedserve_cpu::linear);
  m.impl("decoder_layers", pagedserve_cpu::decoder_layers);
}
