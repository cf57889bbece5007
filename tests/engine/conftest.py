from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch


def make_tiny_llama(path: Path, *, num_kv_heads: int, seed: int = 0, **overrides) -> Path:
    """A random 2-layer Llama saved as an HF checkpoint (no tokenizer): no downloads."""
    from transformers import LlamaConfig, LlamaForCausalLM

    kwargs = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**kwargs)).eval()
    # Random init leaves logits nearly flat; scale the head so greedy choices are decisive
    # and parity is a meaningful check rather than a coin toss between near-ties.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama_mha(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-mha"), num_kv_heads=4)


@pytest.fixture(scope="session")
def tiny_llama_gqa(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-gqa"), num_kv_heads=2, seed=1)


@pytest.fixture(scope="session")
def tiny_llama_cpu_shapes(tmp_path_factory) -> Path:
    """GQA with head_dim 32: the smallest shapes the C++ CPU kernels take (``auto`` picks
    them on CPU), where the other tiny models (head_dim 16) run the torch reference."""
    return make_tiny_llama(
        tmp_path_factory.mktemp("tiny-cpu"),
        num_kv_heads=2,
        seed=2,
        hidden_size=128,
        intermediate_size=256,
    )


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """One torch thread for a module (``pytestmark = pytest.mark.usefixtures(...)``): tiny
    matmuls gain nothing from threads, and on a shared 2-core machine intra-op threads
    contend, so these tests run many times faster with one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
