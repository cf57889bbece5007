"""Model configs for planning: presets, HF directories, GGUF metadata."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from planner.models import PRESETS, gguf_to_hf_config, load_model


def test_default_is_smollm2_135m_without_any_file() -> None:
    planned = load_model("default")
    cfg = planned.config
    assert planned.name == "smollm2-135m" and planned.source == "preset"
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (9, 3, 64)
    assert (cfg.vocab_size, cfg.max_position_embeddings) == (49152, 8192)
    assert cfg.tie_word_embeddings


def test_presets_are_case_insensitive_and_complete() -> None:
    assert load_model("Llama-3-8B").config.num_kv_heads == 8
    assert {
        "llama-2-7b",
        "llama-2-13b",
        "llama-2-70b",
        "llama-3-8b",
        "llama-3-70b",
        "mistral-7b",
        "default",
    } <= set(PRESETS)
    assert load_model("mistral-7b").config.model_type == "mistral"


def test_hf_directory_and_config_file(tmp_path: Path) -> None:
    config = dict(PRESETS["llama-2-7b"], num_key_value_heads=4)
    (tmp_path / "config.json").write_text(json.dumps(config))
    from_dir = load_model(str(tmp_path))
    from_file = load_model(str(tmp_path / "config.json"))
    assert from_dir.config == from_file.config
    assert from_dir.config.num_kv_heads == 4
    assert from_dir.source.endswith("config.json")


def _write_gguf(path: Path, *, tied: bool) -> None:
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_context_length(256)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(100)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_tensor("token_embd.weight", np.zeros((100, 64), dtype=np.float32))
    if not tied:
        writer.add_tensor("output.weight", np.zeros((100, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("tied", [True, False])
def test_gguf_metadata(tmp_path: Path, tied: bool) -> None:
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, tied=tied)
    hf = gguf_to_hf_config(path)
    assert hf["tie_word_embeddings"] is tied
    planned = load_model(str(path))
    cfg = planned.config
    assert planned.name == "tiny"
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (2, 64, 128)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (4, 2, 16, 100)
    assert (cfg.max_position_embeddings, cfg.eos_token_id) == (256, 2)


def test_unknown_model_says_what_is_accepted() -> None:
    with pytest.raises(ValueError, match="preset"):
        load_model("gpt-5")
