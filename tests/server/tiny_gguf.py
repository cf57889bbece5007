"""A tiny Llama as a GGUF file, which ``pagedserve serve FILE.gguf`` converts in seconds.

The default model's GGUF takes tens of seconds to convert; this one has the shapes of the
tiny random Llama (2 layers, hidden size 64) with head_dim 32, so the C++ CPU kernels serve
it (``kernels.cpu.supports``), float32 tensors, and the byte-level BPE test tokenizer of
server_fakes.py written as llama.cpp writes a GPT-2-style vocabulary (``tokenizer.ggml.*``),
which transformers turns back into a tokenizer with its ChatML specials.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

HIDDEN_SIZE = 64
INTERMEDIATE_SIZE = 128
NUM_LAYERS = 2
NUM_HEADS = 2  # head_dim 32
GGUF_CONTROL = 3  # llama.cpp's token type of a special (control) token


def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    from gguf import GGUFWriter

    from tests.server.server_fakes import CHAT_TEMPLATE, tiny_tokenizer

    tok = tiny_tokenizer()
    model = json.loads(tok.backend_tokenizer.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda item: item[1])]
    specials = set(tok.all_special_tokens)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]

    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(NUM_LAYERS)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN_SIZE)
    writer.add_feed_forward_length(INTERMEDIATE_SIZE)
    writer.add_head_count(NUM_HEADS)
    writer.add_head_count_kv(NUM_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([GGUF_CONTROL if t in specials else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tok.bos_token_id)
    writer.add_eos_token_id(tok.eos_token_id)
    writer.add_chat_template(CHAT_TEMPLATE)

    rng = np.random.default_rng(seed)

    def weight(*shape: int) -> np.ndarray:  # [out_features, in_features], as torch stores it
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    ones = np.ones(HIDDEN_SIZE, dtype=np.float32)
    writer.add_tensor("token_embd.weight", weight(len(tokens), HIDDEN_SIZE))
    for i in range(NUM_LAYERS):
        block = f"blk.{i}"
        writer.add_tensor(f"{block}.attn_norm.weight", ones)
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(f"{block}.{name}.weight", weight(HIDDEN_SIZE, HIDDEN_SIZE))
        writer.add_tensor(f"{block}.ffn_norm.weight", ones)
        writer.add_tensor(f"{block}.ffn_gate.weight", weight(INTERMEDIATE_SIZE, HIDDEN_SIZE))
        writer.add_tensor(f"{block}.ffn_up.weight", weight(INTERMEDIATE_SIZE, HIDDEN_SIZE))
        writer.add_tensor(f"{block}.ffn_down.weight", weight(HIDDEN_SIZE, INTERMEDIATE_SIZE))
    writer.add_tensor("output_norm.weight", ones)
    writer.add_tensor("output.weight", weight(len(tokens), HIDDEN_SIZE) * 8.0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
