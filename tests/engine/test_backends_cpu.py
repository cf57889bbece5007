"""engine/backends/cpu.py: the StackSpec's slot order against the C++ enums, the weights it
hands the stack, and the copies it keeps and drops."""

from __future__ import annotations

import pytest
import torch

from engine import LLM
from engine.backends import cpu as backend
from engine.backends.cpu import CpuForward, HeadSlots, LayerSlots, Matmul, slot_names
from engine.llama import Linear
from kernels import cpu as cpu_kernels
from tests.engine.conftest import make_tiny_llama


def test_slot_fields_follow_the_enums_in_decoder_layer_cpp():
    """Read from the source the extension is built from: no build needed."""
    layer, head = cpu_kernels.stack_slots()
    assert slot_names(LayerSlots) == layer
    assert slot_names(HeadSlots) == head
    assert len(layer) == 18 and len(head) == 6
    assert layer[:3] == ("input_norm", "post_norm", "qkv_w")
    assert head[-1] == "head_bias"


def test_a_slot_order_that_differs_from_the_cpp_enum_fails(monkeypatch):
    layer, head = cpu_kernels.stack_slots()
    swapped = (layer[1], layer[0], *layer[2:])
    monkeypatch.setattr(cpu_kernels, "stack_slots", lambda: (swapped, head))
    with pytest.raises(AssertionError):
        backend.check_slot_order()


@pytest.fixture(scope="module")
def llm(tmp_path_factory, ops) -> LLM:
    path = make_tiny_llama(
        tmp_path_factory.mktemp("tiny-cpu-backend"),
        num_kv_heads=2,
        seed=1,
        hidden_size=128,
        intermediate_size=256,
        attention_bias=True,
    )
    return LLM(str(path), attention_backend="cpu", num_kv_blocks=32, device="cpu")


def test_spec_weights_list_every_tensor_at_its_enum_slot(llm):
    forward = llm.engine.runner.model
    assert isinstance(forward, CpuForward)
    spec = forward.spec
    layer, head = cpu_kernels.stack_slots()
    weights = spec.weights()
    num_layers = len(spec.layers)
    assert len(weights) == len(layer) * num_layers + len(head) == forward.stack_weights.size()
    assert weights[len(layer) + layer.index("o_packed")] is spec.layers[1].o.packed
    assert weights[layer.index("qkv_bias")] is spec.layers[0].qkv.bias is not None
    assert weights[layer.index("down_quant")] is None  # no GGUF file: no blocks
    base = len(layer) * num_layers
    assert weights[base + head.index("embed")] is spec.head.embed
    assert weights[base + head.index("head_packed")] is spec.head.head.packed
    model = llm.engine.model
    assert spec.eps == spec.final_eps == model.config.rms_norm_eps and spec.head_in_stack
    assert spec.scale == model.config.head_dim**-0.5
    assert spec.rope_cos is model.rope.cos and spec.rope_sin is model.rope.sin


def test_matmuls_keep_panels_and_lose_their_plain_weights(llm):
    """Every pass runs a layer's matmuls on the panels, and the head gets at most
    max_num_seqs (64) rows, so every plain copy is freed (moved to the meta device). The
    memory report says what each copy costs."""
    model, forward = llm.engine.model, llm.engine.runner.model
    linears = {n: m for n, m in model.named_modules() if isinstance(m, Linear)}
    assert all(m.weight.is_meta for m in linears.values())
    assert forward.pass_rows <= forward.panel_rows
    spec = forward.spec
    matmuls = [m for layer in spec.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    matmuls.append(spec.head.head)
    for m in matmuls:
        assert isinstance(m, Matmul)
        assert m.w.stride() == (0, 0) and m.packed is not None
    dropped = sum(m.weight.numel() * 4 for m in linears.values())
    memory = llm.engine.memory
    assert memory.dropped == forward.memory.dropped_bytes == dropped
    assert memory.packed == sum(m.packed.numel() * 4 for m in matmuls)
    assert memory.blocks == 0
    assert memory.weights == sum(p.numel() * 4 for p in model.parameters() if not p.is_meta)
    assert memory.kv_cache == llm.engine.kv_capacity.total_bytes
    # The KV cache's pages may not be resident yet (zero pages, touched on first write):
    # only the copies the load wrote are surely in the resident set.
    assert memory.rss > memory.weights + memory.packed
    # Both are read (the build's end may be below its start: malloc_trim returns freed heap).
    assert memory.rss_before > 0 and memory.rss > 0
    assert "the rest" in memory.describe() and "before loading" in memory.describe()


def test_a_head_that_may_get_more_rows_than_the_panels_keeps_its_weight(tmp_path, ops):
    """With more sequences than the panels' rows, a step's head can reach the library's
    matmul, which reads the plain weight: the head keeps it, the layers still drop theirs."""
    path = make_tiny_llama(tmp_path, num_kv_heads=2, seed=1, hidden_size=128, intermediate_size=256)
    llm = LLM(str(path), attention_backend="cpu", num_kv_blocks=32, max_num_seqs=300, device="cpu")
    model = llm.engine.model
    assert not model.lm_head.weight.is_meta
    assert all(layer.o_proj.weight.is_meta for layer in model.layers)
    assert torch.equal(llm.engine.runner.model.spec.head.head.w, model.lm_head.weight)


def test_passes_past_the_panels_keep_the_plain_weights(tmp_path, monkeypatch, ops):
    """A test's larger passes reach the library's matmul, which reads the plain weight."""
    path = make_tiny_llama(tmp_path, num_kv_heads=2, seed=1, hidden_size=128, intermediate_size=256)
    monkeypatch.setattr(CpuForward, "rows_per_pass", 1 << 30)
    llm = LLM(str(path), attention_backend="cpu", num_kv_blocks=32, device="cpu")
    assert not any(p.is_meta for p in llm.engine.model.parameters())
    assert llm.engine.memory.dropped == 0
