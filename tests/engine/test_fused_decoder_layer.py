"""The fused C++ decoder layer (cpu backend) against the Python layer it replaces: same
kernels in the same order, so tokens and logprobs must be bitwise equal."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.layer_ops import CpuLayerOps
from tests.engine.conftest import make_tiny_llama


def _run(path, prompts, *, fused: bool, monkeypatch) -> tuple[list, int]:
    calls = 0
    original = CpuLayerOps.decoder_layer

    def counting(self, *args, **kwargs):
        nonlocal calls
        calls += 1
        return original(self, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(CpuLayerOps, "fuses_layers", fused)
        m.setattr(CpuLayerOps, "decoder_layer", counting)
        llm = LLM(
            str(path),
            attention_backend="cpu",
            block_size=8,
            max_num_seqs=80,
            max_num_batched_tokens=64,
        )
        outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0, logprobs=3))
    return [(o.token_ids, [(lp.logprob, lp.top) for lp in o.logprobs]) for o in outs], calls


@pytest.mark.parametrize(
    "overrides",
    [{}, {"tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True}],
    ids=["plain", "tied-bias"],
)
@pytest.mark.parametrize("num_prompts", [1, 5, 70], ids=lambda n: f"{n}-seqs")
def test_fused_decoder_layer_is_bitwise_the_python_layer(
    tmp_path, monkeypatch, overrides, num_prompts
):
    """1 row (vector product), 5 (packed matmul) and 70 decode rows (past the packed range:
    the library's matmul), with and without biases; prompts cross block boundaries and a
    64-token budget makes chunked prefills and mixed prefill/decode steps."""
    path = make_tiny_llama(
        tmp_path, num_kv_heads=2, seed=5, hidden_size=128, intermediate_size=256, **overrides
    )
    g = torch.Generator().manual_seed(num_prompts)
    prompts = [
        torch.randint(3, 256, (int(n),), generator=g).tolist()
        for n in torch.randint(1, 40, (num_prompts,), generator=g)
    ]
    fused, fused_calls = _run(path, prompts, fused=True, monkeypatch=monkeypatch)
    python, python_calls = _run(path, prompts, fused=False, monkeypatch=monkeypatch)
    assert python_calls == 0
    # 2 layers x every step: at least the 10 steps of the longest request.
    assert fused_calls >= 2 * 10
    assert fused == python
