"""Shape presets: the published shapes of the models benchmarks name, and the synthetic
tokenizer that lets the HTTP server serve a preset (which has none) with dummy weights."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine.attention import PagedAttention
from engine.config import ModelConfig
from engine.llama import LlamaForCausalLM
from engine.loader import load_tokenizer
from engine.presets import preset, write_synthetic_tokenizer
from engine.rope import RotaryEmbedding
from loadtest.workloads import WORDS, make_prompt
from server.detokenizer import IncrementalDetokenizer


def test_llama_3_2_1b_has_the_published_shape() -> None:
    mc = ModelConfig.from_hf(preset("llama-3.2-1b"))
    assert (mc.vocab_size, mc.hidden_size, mc.num_layers) == (128256, 2048, 16)
    assert (mc.num_heads, mc.num_kv_heads, mc.head_dim) == (32, 8, 64)
    assert mc.intermediate_size == 8192 and mc.tie_word_embeddings
    assert mc.rope_theta == 500000.0 and not mc.attention_bias
    rope = mc.rope_scaling
    assert (rope.rope_type, rope.factor) == ("llama3", 32.0)
    assert (rope.low_freq_factor, rope.high_freq_factor) == (1.0, 4.0)
    assert rope.original_max_position_embeddings == 8192
    assert mc.max_position_embeddings == 131072


def test_qwen2_5_7b_has_the_published_shape() -> None:
    mc = ModelConfig.from_hf(preset("qwen2.5-7b"))
    assert (mc.vocab_size, mc.hidden_size, mc.num_layers) == (152064, 3584, 28)
    assert (mc.num_heads, mc.num_kv_heads, mc.head_dim) == (28, 4, 128)
    assert mc.intermediate_size == 18944 and not mc.tie_word_embeddings
    assert mc.attention_bias  # q, k and v projections carry biases
    assert mc.rope_theta == 1e6 and mc.rope_scaling.rope_type == "default"


@pytest.mark.parametrize(
    "name,billions", [("llama-3-8b", 8.030), ("llama-3.2-1b", 1.2358), ("qwen2.5-7b", 7.6156)]
)
def test_presets_have_the_published_parameter_counts(name: str, billions: float) -> None:
    """Counted on the model itself, built on the meta device (no memory), and by the
    config's formula, which the cost model and the planner use."""
    mc = ModelConfig.from_hf(preset(name))
    rope = RotaryEmbedding(mc, 16, torch.device("cpu"))  # plain tensors, not parameters
    with torch.device("meta"):
        model = LlamaForCausalLM(mc, PagedAttention("torch", mc.head_dim**-0.5), rope)
    counted = sum(p.numel() for p in model.parameters())
    if mc.tie_word_embeddings:  # the model keeps its own head copy: one matrix, counted once
        counted -= model.lm_head.weight.numel()
    assert counted == mc.num_params
    assert counted / 1e9 == pytest.approx(billions, abs=5e-4 * billions)


# ---- the synthetic tokenizer -------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny-llama", "qwen2.5-7b"])
def test_the_synthetic_tokenizer_has_exactly_the_presets_vocabulary(
    tmp_path: Path, name: str
) -> None:
    config = preset(name)
    tokenizer = load_tokenizer(write_synthetic_tokenizer(config, tmp_path, WORDS))
    assert tokenizer is not None and len(tokenizer) == config["vocab_size"]
    assert tokenizer.bos_token_id == config["bos_token_id"]
    assert tokenizer.eos_token_id == config["eos_token_id"]
    # Every id is one distinct token, and the last one decodes to text.
    tokens = tokenizer.convert_ids_to_tokens(list(range(config["vocab_size"])))
    assert len(set(tokens)) == config["vocab_size"]
    assert tokenizer.decode([config["vocab_size"] - 1]).strip()


def test_the_load_generators_prompts_have_as_many_tokens_as_words(tmp_path: Path) -> None:
    tokenizer = load_tokenizer(write_synthetic_tokenizer(preset("llama-3-8b"), tmp_path, WORDS))
    assert tokenizer is not None
    for n in (1, 16, 128):
        ids = tokenizer(make_prompt(n, random.Random(n)))["input_ids"]
        assert len(ids) == n and tokenizer.unk_token_id not in ids  # no BOS added
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "the city"}], add_generation_prompt=True, tokenize=False
    )
    ids = tokenizer(chat)["input_ids"]
    assert tokenizer.unk_token_id not in ids and len(ids) == 4  # user the city assistant


def test_every_synthetic_token_reaches_the_client_as_it_comes(tmp_path: Path) -> None:
    """The server's incremental detokenizer emits text for each token of a random model's
    output (high ids included), never holding one back: the client's inter-token gaps are
    then one step each, as the server's own histogram counts them."""
    config = preset("llama-3-8b")
    tokenizer = load_tokenizer(write_synthetic_tokenizer(config, tmp_path, WORDS))
    prompt = tokenizer("the city of")["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, prompt)
    rng = random.Random(0)
    output = [rng.randrange(config["vocab_size"]) for _ in range(64)]
    output = [t for t in output if t not in (config["bos_token_id"], config["eos_token_id"])]
    deltas = [detok.add([t]) for t in output]
    assert all(d.strip() for d in deltas)
    assert "".join(deltas).strip() == tokenizer.decode(output)
