"""Shape presets: config.json contents of well-known models, for ``--load-format dummy``.

With dummy weights no checkpoint is read, so ``--model`` may name a preset instead of a
directory: the engine then builds the model of that shape with random weights. The shapes
(vocabulary, heads, KV heads, intermediate size, RoPE) are those the real models publish in
their ``config.json``, so benchmarks on a preset read and compute what the real model would.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

PRESETS: dict[str, dict[str, Any]] = {
    "llama-3-8b": {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    "llama-3.2-1b": {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {**_LLAMA3_ROPE, "factor": 32.0},
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    "qwen2.5-7b": {
        "model_type": "qwen2",
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
    },
    # SmolLM2-135M's shape: the default model, for dummy runs without its GGUF.
    "smollm2-135m": {
        "model_type": "llama",
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "qwen3-8b": {
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    "gemma-2-9b": {
        "model_type": "gemma2",
        "vocab_size": 256000,
        "hidden_size": 3584,
        "intermediate_size": 14336,
        "num_hidden_layers": 42,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "bos_token_id": 2,
        "eos_token_id": 1,
    },
    "mixtral-8x7b": {
        "model_type": "mixtral",
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    # A few-MB Llama for smoke tests of the benchmarks and the dummy path on CPU.
    "tiny-llama": {
        "model_type": "llama",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
}


def _llama2(
    hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int
) -> dict[str, Any]:
    """Llama 2's config.json (meta-llama/Llama-2-*-hf) at one size."""
    return {
        "model_type": "llama",
        "vocab_size": 32000,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


PRESETS["llama-2-7b"] = _llama2(4096, 11008, 32, 32, 32)
PRESETS["llama-2-13b"] = _llama2(5120, 13824, 40, 40, 40)
PRESETS["llama-2-70b"] = _llama2(8192, 28672, 80, 64, 8)
PRESETS["llama-3-70b"] = {
    **PRESETS["llama-3-8b"],
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
}
# Mistral-7B-v0.2 (v0.1 differs by a 4,096-token sliding window, v0.3 by a 32,768 vocab).
PRESETS["mistral-7b"] = {
    **_llama2(4096, 14336, 32, 32, 8),
    "model_type": "mistral",
    "rope_theta": 1000000.0,
    "max_position_embeddings": 32768,
    "sliding_window": None,
}
# Llama 3.1 is Llama 3's shape with llama3 RoPE scaling to a 128k context.
PRESETS["llama-3.1-8b"] = {
    **PRESETS["llama-3-8b"],
    "rope_scaling": _LLAMA3_ROPE,
    "max_position_embeddings": 131072,
}


def preset(name: str) -> dict[str, Any] | None:
    """The config.json dict of preset ``name`` (a copy), or None if there is none."""
    found = PRESETS.get(name.lower())
    return dict(found) if found is not None else None


def write_synthetic_tokenizer(
    hf_config: dict[str, Any], directory: Path, words: Sequence[str] = ()
) -> Path:
    """Write a tokenizer of exactly ``hf_config``'s vocabulary size into ``directory``
    (``tokenizer.json`` + ``tokenizer_config.json``, which ``AutoTokenizer`` loads), for a
    shape preset served with dummy weights, which has no tokenizer of its own.

    A word-level vocabulary split on whitespace: the BOS and EOS ids of the config are
    special tokens (``<|bos|>``, ``<|eos|>``; one token when they are the same id), ``words``
    come next, one token each, so text made of them has as many tokens as words, and every
    other id is a short distinct string. Every id decodes to visible text on its own
    (decoded ids are joined by spaces), so an incremental detokenizer emits each token as it
    comes, and a random model's tokens reach a client one by one. No BOS is added when
    encoding: a prompt of n words is n tokens. Returns ``directory``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab_size = int(hf_config["vocab_size"])
    tokens: list[str | None] = [None] * vocab_size
    special: dict[str, str] = {}  # tokenizer_config.json's key -> token
    bos, eos = (_token_ids(hf_config.get(f"{k}_token_id"), vocab_size) for k in ("bos", "eos"))
    for key, ids, name in (("bos_token", bos, "<|bos|>"), ("eos_token", eos, "<|eos|>")):
        for n, i in enumerate(ids):
            # BOS == EOS (Qwen's <|endoftext|>): one token.
            tokens[i] = tokens[i] or (name if n == 0 else f"{name[:-2]}_{n}|>")
        if ids:
            special[key] = str(tokens[ids[0]])
    specials = {t for t in tokens if t is not None}
    taken = set(specials)
    fillers = (f"t{n:x}" for n in itertools.count())
    # The unknown-word token first, then the chat roles (the chat template below spells
    # them), then ``words``, then fillers, into the ids BOS and EOS left.
    candidates = itertools.chain(
        ["<unk>", *dict.fromkeys(("system", "user", "assistant", *words))], fillers
    )
    unk = None
    for i in range(vocab_size):
        if tokens[i] is not None:
            continue
        word = next(candidates)
        while word in taken or not word or word.startswith("##") or any(map(str.isspace, word)):
            word = next(fillers)
        tokens[i] = word
        taken.add(word)
        unk = unk or word
    vocab = {str(t): i for i, t in enumerate(tokens)}
    assert len(vocab) == vocab_size and unk is not None
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # Tokens joined by spaces (no token starts with "##"); named, so a grammar compiler
    # reading tokenizer.json finds a decoder (it reads the vocabulary as raw strings).
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tokenizer.add_special_tokens(sorted(specials, key=vocab.__getitem__))
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": unk,
        **special,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(hf_config.get("max_position_embeddings", 2048)),
        # Roles and content joined by spaces: /v1/chat/completions works too.
        "chat_template": (
            "{% for message in messages %}{{ message['role'] }} {{ message['content'] }} "
            "{% endfor %}{% if add_generation_prompt %}assistant {% endif %}"
        ),
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return directory


def _token_ids(value: Any, vocab_size: int) -> list[int]:
    """A config's token id field (an int, a list of ints or None) as a list, in range."""
    ids = value if isinstance(value, list) else [] if value is None else [value]
    return [int(i) for i in ids if 0 <= int(i) < vocab_size]
