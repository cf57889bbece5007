"""RoPE variants (engine/rope.py) against transformers' own rope init functions, and the
one clear refusal of a length-dependent variant past its original context."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine import LLM, SamplingParams
from engine.config import ModelConfig, UnsupportedModelError
from engine.rope import RotaryEmbedding, attention_factor, inverse_frequencies
from tests.engine.parity import assert_parity, hf_greedy, random_prompts

BASE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0 + 0.25 * i for i in range(8)],
    "long_factor": [4.0] * 8,
    "rope_theta": 10000.0,
}


@pytest.mark.parametrize(
    "config",
    [
        transformers.LlamaConfig(
            **BASE,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 1024,
                "rope_theta": 10000.0,
            },
        ),
        transformers.LlamaConfig(
            **BASE,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 8.0,
                "original_max_position_embeddings": 512,
                "rope_theta": 500000.0,
                "beta_fast": 16,
                "beta_slow": 2,
                "mscale": 1.0,
                "mscale_all_dim": 0.5,
            },
        ),
        transformers.Phi3Config(
            **BASE, original_max_position_embeddings=1024, rope_parameters=dict(LONGROPE)
        ),
    ],
    ids=["yarn", "yarn-mscale", "longrope"],
)
def test_frequencies_and_attention_factor_equal_transformers(config):
    rope_type = config.rope_parameters["rope_type"]
    inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    ours = ModelConfig.from_hf(config.to_dict())
    assert torch.equal(inverse_frequencies(ours), inv_freq)
    assert attention_factor(ours) == pytest.approx(factor, rel=1e-12)


@pytest.mark.parametrize(
    "rope_type,extra",
    [("longrope", LONGROPE), ("dynamic", {"rope_type": "dynamic", "factor": 2.0})],
)
def test_length_dependent_rope_is_refused_past_its_original_context(rope_type, extra):
    config = ModelConfig.from_hf(
        {**BASE, "model_type": "phi3", "original_max_position_embeddings": 1024,
         "rope_parameters": {**extra, "original_max_position_embeddings": 1024}}
    )  # fmt: skip
    RotaryEmbedding(config, 1024, torch.device("cpu"))  # within: exact
    with pytest.raises(UnsupportedModelError, match=f"'{rope_type}'.*--max-model-len 1024"):
        RotaryEmbedding(config, 1025, torch.device("cpu"))


@pytest.mark.parametrize("family", ["yarn", "longrope"])
def test_scaled_rope_models_match_transformers(tmp_path, family):
    if family == "yarn":
        config = transformers.LlamaConfig(
            **BASE,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32,
                "rope_theta": 10000.0,
            },
        )
    else:  # Phi-3's longrope with the short factors: within its original context
        config = transformers.Phi3Config(
            **BASE, original_max_position_embeddings=256, rope_parameters=dict(LONGROPE)
        )
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(8.0)
    hf.save_pretrained(tmp_path)
    prompts = random_prompts(0, (5, 40))
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", max_model_len=256,
              num_kv_blocks=64)  # fmt: skip
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0))
    for prompt, out in zip(prompts, outs, strict=True):
        ref = hf_greedy(hf, prompt, 12, eos_token_id=2)
        assert_parity(out.token_ids, ref, label=f"{family}, prompt of {len(prompt)}")
