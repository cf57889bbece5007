"""GGUF files of each family (engine/gguf_families.py, engine/loader.py): a tiny random model
written as an F32 GGUF the way llama.cpp lays one out (tests/engine/gguf_writer.py), served
by ``LLM("x.gguf")`` and checked against transformers loading the same file; architectures
transformers' GGUF reader does not turn into the model the file holds are refused with one
line naming them, before any conversion."""

from __future__ import annotations

import re

import pytest
import torch

from engine import LLM
from engine.config import UnsupportedModelError
from tests.engine.gguf_writer import write_gguf
from tests.engine.parity import hf_greedy
from tests.engine.test_families import ENGINE, _check, _prompts, make_tiny

TOKENS = 8

# family -> make_tiny overrides that keep to what llama.cpp writes and transformers' GGUF
# reader reads: Qwen3's head_dim and Qwen3-MoE's expert width are not read, so they take
# the config classes' defaults.
GGUF_FAMILIES = {
    "qwen3": dict(head_dim=128),
    "gemma2": dict(tie_word_embeddings=True),  # llama.cpp has no separate gemma2 head
    "gemma3": {},
    "phi3": {},
    "qwen3-moe": dict(moe_intermediate_size=768, mlp_only_layers=[]),
}


@pytest.mark.parametrize("name", list(GGUF_FAMILIES))
def test_family_gguf_matches_transformers_reading_the_same_file(name, tmp_path, monkeypatch):
    import transformers

    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    _, source = make_tiny(tmp_path / "source", name, **GGUF_FAMILIES[name])
    gguf = write_gguf(source, tmp_path / f"tiny-{name}.gguf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=gguf.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    # The file holds the source weights (Gemma's norms, stored as 1 + w, to float32 rounding).
    read, written = hf.state_dict(), source.state_dict()
    assert read.keys() == written.keys()
    for key, value in written.items():
        torch.testing.assert_close(read[key], value, rtol=0, atol=1e-6, msg=key)
    prompts = _prompts(256, seed=7)[1:3]
    refs = [hf_greedy(hf, p, TOKENS, eos_token_id=2) for p in prompts]
    llm = LLM(str(gguf), block_size=8, max_num_batched_tokens=16, num_kv_blocks=64, **ENGINE)
    assert llm.engine.model_config.model_type == hf.config.model_type
    _check(llm, prompts, refs, f"{name} gguf", TOKENS)


def _foreign_gguf(path, arch: str):
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    "case,named",
    [
        ("falcon", "unsupported GGUF architecture 'falcon'"),
        ("mixtral", "unsupported GGUF architecture 'mixtral' .*llama with 4 experts"),
        ("qwen3-head-dim-16", "unsupported GGUF architecture 'qwen3' with head_dim 16"),
        # llama named exactly "mistral": transformers maps it to a mistral that gguf-py's
        # tensor names do not know, and fails while converting.
        ("mistral-sliding", "could not read .* as a GGUF model .*model_type: mistral"),
    ],
)
def test_gguf_architecture_transformers_misreads_is_one_clear_error(case, named, tmp_path,
                                                                     monkeypatch):  # fmt: skip
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    if case == "falcon":
        gguf = _foreign_gguf(tmp_path / "falcon.gguf", "falcon")
    else:
        _, source = make_tiny(tmp_path / "source", case.split("-head")[0])
        gguf = write_gguf(source, tmp_path / f"{case}.gguf", name=source.config.model_type)
    with pytest.raises(UnsupportedModelError, match=named) as err:
        LLM(str(gguf), **ENGINE)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "cache" / "models").exists() or not any(
        (tmp_path / "cache" / "models").iterdir()
    )  # nothing converted, nothing left behind


def test_a_gguf_readers_own_failure_is_one_clear_error(tmp_path, monkeypatch):
    """An exception transformers' GGUF reader was not written to raise (5.17: AttributeError
    on a BPE tokenizer without merges) is one line naming the file and transformers' version,
    with nothing converted or left behind."""
    import transformers

    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    _, source = make_tiny(tmp_path / "source", "qwen3", **GGUF_FAMILIES["qwen3"])
    gguf = write_gguf(source, tmp_path / "tiny-qwen3.gguf")

    def trips(*args, **kwargs):
        raise AttributeError("'GGUFTokenizerSkeleton' object has no attribute 'bpe_ranks'")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", trips)
    named = (
        f"could not read .*tiny-qwen3.gguf.* as a GGUF model: transformers "
        f"{re.escape(transformers.__version__)}'s GGUF reader failed \\(AttributeError: .*bpe_ranks"
    )
    with pytest.raises(UnsupportedModelError, match=named) as err:
        LLM(str(gguf), **ENGINE)
    assert "\n" not in str(err.value)
    models = tmp_path / "cache" / "models"
    assert not models.exists() or not any(models.iterdir())  # nothing converted or left
