"""Loading checkpoints as the hub ships them: sharded safetensors with an index, and bf16
weights served in float32 on the CPU."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from engine import LLM, SamplingParams
from engine.config import ModelNotFoundError
from engine.loader import checkpoint_files, load_state_dict
from tests.engine.parity import assert_parity, hf_greedy
from tests.engine.test_families import make_tiny

ENGINE = {"device": "cpu", "dtype": "float32", "num_kv_blocks": 64}
PROMPT = [5, 17, 33, 8, 90, 41, 7, 120, 64, 3, 99]


def test_sharded_checkpoint_reads_the_shards_its_index_names(tmp_path):
    import transformers

    _, hf = make_tiny(tmp_path / "one", "mistral-sliding")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    sharded = tmp_path / "sharded"
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    # Mistral's repositories ship the same weights a second time under other names: with
    # an index, that file is never read.
    save_file({"tok_embeddings.weight": torch.zeros(3)}, str(sharded / "consolidated.safetensors"))
    assert (sharded / "consolidated.safetensors") not in checkpoint_files(sharded)
    assert "tok_embeddings.weight" not in load_state_dict(sharded)
    out = LLM(str(sharded), **ENGINE).generate(
        [PROMPT], SamplingParams(max_tokens=12, temperature=0)
    )[0]
    ref = transformers.AutoModelForCausalLM.from_pretrained(sharded).float().eval()
    assert_parity(out.token_ids, hf_greedy(ref, PROMPT, 12, eos_token_id=2), label="sharded")
    (sharded / sorted(set(index["weight_map"].values()))[0]).unlink()
    with pytest.raises(ModelNotFoundError, match="lacks the shards"):
        checkpoint_files(sharded)


def test_bf16_checkpoint_is_cast_to_the_configured_dtype(tmp_path):
    import transformers

    _, hf = make_tiny(tmp_path / "f32", "qwen3")
    hf.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    assert load_state_dict(tmp_path / "bf16")["model.norm.weight"].dtype == torch.bfloat16
    llm = LLM(str(tmp_path / "bf16"), **ENGINE)
    assert {p.dtype for p in llm.engine.model.parameters()} == {torch.float32}
    # transformers reading the same bf16 file in float32: the same upcast weights.
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "bf16", dtype=torch.float32
    ).eval()
    out = llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0))[0]
    assert_parity(out.token_ids, hf_greedy(ref, PROMPT, 12, eos_token_id=2), label="bf16")


def test_max_model_len_beyond_the_models_positions_is_capped_with_a_warning(caplog):
    with caplog.at_level("WARNING", logger="engine.builder"):
        llm = LLM(
            "tiny-llama", load_format="dummy", max_model_len=4096, num_kv_blocks=128,
            device="cpu", dtype="float32",
        )  # fmt: skip
    assert llm.engine.max_model_len == 2048  # the preset's max_position_embeddings
    assert any("exceeds the model's 2048 positions" in r.getMessage() for r in caplog.records)
