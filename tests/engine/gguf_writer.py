"""Writing a tiny transformers model as an F32 GGUF file, the way llama.cpp's
convert_hf_to_gguf.py lays one out, so that tests can load GGUF files of each family.

Tensor names come from gguf-py's own HF-to-GGUF name map (the one transformers' reader
inverts); the per-architecture changes llama.cpp makes are made here too, and undone by
transformers on reading:

- ``llama``: q/k rows permuted into llama.cpp's RoPE layout;
- ``gemma2``/``gemma3``: norm weights stored as ``1 + w``;
- mixtures of experts: one ``ffn_{gate,up,down}_exps`` tensor per layer, experts stacked.

The tokenizer is a byte-level BPE of the model's vocabulary size with no merges: enough for
transformers to build one (tests send token ids).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

# The model_type of a transformers config -> (GGUF architecture, gguf-py MODEL_ARCH name).
ARCHITECTURES = {
    "llama": "llama",
    "mistral": "llama",  # llama.cpp writes Mistral as llama, named "mistral"
    "mixtral": "llama",  # and Mixtral as llama with experts
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3moe",
    "phi3": "phi3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py's LlamaModel.permute: rotate-half pairs to interleaved pairs.
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_gguf(model: torch.nn.Module, path: Path, name: str | None = None) -> Path:
    """Write ``model`` (a transformers causal LM) as an F32 GGUF at ``path``."""
    import gguf

    config = model.config
    arch = ARCHITECTURES[config.model_type]
    model_arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(model_arch, config.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name or config.model_type)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = config.rope_parameters
    writer.add_rope_freq_base(float(rope.get("full_attention", rope)["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if getattr(config, "sliding_window", None) is not None:
        writer.add_sliding_window(config.sliding_window)
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        moe_width = getattr(config, "moe_intermediate_size", config.intermediate_size)
        writer.add_expert_feed_forward_length(moe_width)
    # A byte-level BPE vocabulary: the 256 byte symbols, then placeholders up to vocab_size.
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = list(bytes_to_unicode().values())
    tokens = [symbols[i] if i < 256 else f"<t{i}>" for i in range(config.vocab_size)]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * config.vocab_size)
    writer.add_token_scores([0.0] * config.vocab_size)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_pad_token_id(config.pad_token_id if config.pad_token_id is not None else 0)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # a tied head is the embedding: llama.cpp writes no output tensor
        data = tensor.detach().float().numpy()
        base, suffix = hf_name.rsplit(".", 1) if hf_name.endswith((".weight", ".bias")) else (
            hf_name, "")  # fmt: skip
        suffix = f".{suffix}" if suffix else ".weight"
        if base.endswith("mlp.experts.gate_up_proj"):  # [experts, 2 * width, hidden]
            prefix = names.get_name(base.replace("gate_up_proj", "down_proj"))
            gate, up = np.split(data, 2, axis=1)
            writer.add_tensor(prefix.replace("down", "gate") + suffix, np.ascontiguousarray(gate))
            writer.add_tensor(prefix.replace("down", "up") + suffix, np.ascontiguousarray(up))
            continue
        gguf_name = names.get_name(base)
        assert gguf_name is not None, f"no GGUF name for {hf_name}"
        if arch == "llama" and base.endswith("self_attn.q_proj"):
            data = _permute(data, config.num_attention_heads)
        elif arch == "llama" and base.endswith("self_attn.k_proj"):
            data = _permute(data, config.num_key_value_heads)
        elif arch.startswith("gemma") and base.endswith("norm"):
            data = data + 1.0
        writer.add_tensor(gguf_name + suffix, np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
