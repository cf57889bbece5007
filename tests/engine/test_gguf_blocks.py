"""engine/gguf_blocks.py: the GGUF tensor directory, the row-order search, and the rule that
a matmul reads the checkpoint's blocks only where they de-quantize to its float32 weight.

The engine tests load the embedded default model twice (blocks, and float32 only) and need
the C++ CPU kernels; they skip where those are off or do not build.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize, quantize

from engine import LLM, SamplingParams
from engine.backends.cpu import Matmul, gather
from engine.builder import load_model
from engine.config import ModelConfig
from engine.gguf_blocks import BlocksReport, _row_order, exact_gguf_blocks, read_tensor_index
from engine.llama import Linear, LlamaForCausalLM
from engine.loader import default_model_gguf, read_hf_config, resolve_model

NUM_LAYERS = 30  # SmolLM2-135M
NUM_LINEARS = NUM_LAYERS * 4 + 1  # qkv, o, gate_up, down per layer + the tied lm_head
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    # Longer than max_quant_rows() without VNNI (12 with AVX-512, 8 with AVX2): there its
    # prefill runs on the float32 panels in both engines (with VNNI, on the blocks: 64).
    "Write a short story about a lighthouse keeper who finds a message in a bottle "
    "washed up on the rocks one stormy night, and what he decides to do about it.",
]
KV_BLOCKS = 64  # the prompts need a few; the default pool would be 1 GiB per engine
# GGUF blocks run on the C++ CPU kernels: float32 on the CPU, whatever else the machine has.
DEVICE = {"device": "cpu", "dtype": "float32"}


@pytest.fixture(scope="module")
def gguf_path():
    try:
        return default_model_gguf()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def reader(gguf_path) -> GGUFReader:
    return GGUFReader(gguf_path)  # slow to open (~5-8 s): once per module


def _matmuls(llm: LLM) -> dict[str, Matmul]:
    """The cpu backend's matmuls by the model's module names, in forward order."""
    spec = llm.engine.runner.model.spec
    out = {}
    for i, layer in enumerate(spec.layers):
        out |= {
            f"layers.{i}.qkv_proj": layer.qkv,
            f"layers.{i}.o_proj": layer.o,
            f"layers.{i}.gate_up_proj": layer.gate_up,
            f"layers.{i}.down_proj": layer.down,
        }
    return out | {"lm_head": spec.head.head}


def _linears(model: LlamaForCausalLM) -> dict[str, Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, Linear)}


def _cpu_llm(matmul_weights: str) -> LLM:
    llm = LLM("default", matmul_weights=matmul_weights, num_kv_blocks=KV_BLOCKS, **DEVICE)
    if llm.engine.attention_backend != "cpu":
        pytest.skip(f"the default engine runs the {llm.engine.attention_backend} backend here")
    return llm


@pytest.fixture(scope="module")
def llm_gguf(ops, gguf_path) -> LLM:
    return _cpu_llm("gguf")


@pytest.fixture(scope="module")
def llm_float32(ops, gguf_path) -> LLM:
    return _cpu_llm("float32")


@pytest.fixture(scope="module")
def plain_model(gguf_path) -> LlamaForCausalLM:
    """The default model as loaded, before any backend: its float32 weights all there."""
    resolved = resolve_model("default")
    config = ModelConfig.from_hf(read_hf_config(resolved.path))
    return load_model(resolved.path, config, "torch", 64, torch.device("cpu"), torch.float32)


# --- read_tensor_index --------------------------------------------------------------------


def test_read_tensor_index_matches_gguf_reader(gguf_path, reader):
    arch, index = read_tensor_index(gguf_path)
    assert arch == "llama"
    theirs = {t.name: t for t in reader.tensors}
    assert set(index) == set(theirs)
    for name, info in index.items():
        t = theirs[name]
        assert info.qtype == int(t.tensor_type), name
        assert info.shape == tuple(int(s) for s in t.shape), name
        assert info.offset == t.data_offset, name
    data = np.memmap(gguf_path, dtype=np.uint8, mode="r")
    for name in ("blk.0.attn_q.weight", "token_embd.weight", "blk.3.ffn_down.weight"):
        info, t = index[name], theirs[name]
        want = np.ascontiguousarray(t.data).view(np.uint8).reshape(-1)
        got = data[info.offset : info.offset + want.size]
        assert np.array_equal(got, want), name
    assert index["token_embd.weight"].qtype == GGMLQuantizationType.Q8_0
    assert index["blk.0.attn_q.weight"].qtype == GGMLQuantizationType.Q4_1
    assert index["blk.3.ffn_down.weight"].shape == (1536, 576)  # ne0 (input) first


def test_read_tensor_index_rejects_a_non_gguf_file(tmp_path):
    path = tmp_path / "not.gguf"
    path.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_tensor_index(path)


# --- the engine on blocks vs on float32 -----------------------------------------------------


@pytest.mark.slow
def test_default_engine_reads_blocks_for_every_matmul(llm_gguf, ops):
    linears = _matmuls(llm_gguf)
    assert len(linears) == NUM_LINEARS
    assert llm_gguf.engine.matmul_weights == "gguf"
    missing = [n for n, m in linears.items() if m.quant is None]
    assert not missing, missing
    assert all(m.packed is not None for m in linears.values())
    # The tied lm_head comes from token_embd (Q8_0: 36 bytes a column in a panel block), the
    # rest Q4_1 (24 bytes a column).
    assert linears["lm_head"].quant.shape[2] == 36 * ops.quant_panel_width(8)
    q4_bytes = 24 * ops.quant_panel_width(3)
    assert {m.quant.shape[2] for n, m in linears.items() if n != "lm_head"} == {q4_bytes}


@pytest.mark.slow
def test_float32_engine_reads_no_blocks(llm_float32):
    linears = _matmuls(llm_float32)
    assert len(linears) == NUM_LINEARS
    assert llm_float32.engine.matmul_weights == "float32"
    assert all(m.quant is None for m in linears.values())
    assert all(m.packed is not None for m in linears.values())


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["llm_gguf", "llm_float32"])
def test_matmul_copies_lie_in_one_buffer_in_forward_order(request, engine):
    """gather: each kind of copy (packed panels, GGUF blocks) is one buffer, the matmuls'
    copies end to end in forward order (q/k/v, o, gate/up, down, layer after layer, then the
    head), so a decode step reads it front to back."""
    linears = list(_matmuls(request.getfixturevalue(engine)).values())
    for attr in ("packed", "quant"):
        copies = [getattr(m, attr) for m in linears if getattr(m, attr) is not None]
        if attr == "quant" and engine == "llm_float32":
            assert not copies
            continue
        assert len(copies) == NUM_LINEARS
        storage = copies[0].untyped_storage()
        assert all(c.untyped_storage().data_ptr() == storage.data_ptr() for c in copies)
        starts = [c.storage_offset() for c in copies]
        ends = [start + c.numel() for start, c in zip(starts, copies, strict=True)]
        # The buffer may start inside a larger mapping (huge-page aligned: host_memory).
        assert starts[1:] == ends[:-1]
        assert ends[-1] * copies[0].element_size() <= storage.nbytes()


def test_gather_keeps_every_value(ops):
    """Moving the copies into one buffer changes where they live, nothing else: same values,
    same products, in the order given."""
    g = torch.Generator().manual_seed(0)
    weights = {f"m{n}": torch.randn(64, n, generator=g) for n in (96, 64, 200)}
    packed = {name: ops.pack_weight(w) for name, w in weights.items()}
    raw = quantize(torch.randn(96, 64, generator=g).numpy(), GGMLQuantizationType.Q4_1)
    quant = {"m96": ops.pack_gguf(torch.from_numpy(raw), 3, 64)}
    x = torch.randn(3, 64, generator=g)

    def products(packed, quant):
        return [ops.linear(x, w, packed[n], quant.get(n), None) for n, w in weights.items()]

    want = products(packed, quant)
    moved_packed, moved_quant = gather(packed), gather(quant)
    assert list(moved_packed) == list(packed)
    for name, t in packed.items():
        assert torch.equal(moved_packed[name], t)
    assert torch.equal(moved_quant["m96"], quant["m96"])
    got = products(moved_packed, moved_quant)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert len({t.untyped_storage().data_ptr() for t in moved_packed.values()}) == 1
    starts = [t.storage_offset() for t in moved_packed.values()]
    ends = [s + t.numel() for s, t in zip(starts, moved_packed.values(), strict=True)]
    assert starts[1:] == ends[:-1]
    assert gather({}) == {}


@pytest.mark.slow
def test_blocks_are_bitwise_the_float32_weights(ops, llm_gguf, plain_model):
    theirs = _linears(plain_model)
    for name, m in _matmuls(llm_gguf).items():
        weight = theirs[name].weight.detach()
        assert torch.equal(ops.dequantize_panels(m.quant, weight.shape[1]), weight), name


@pytest.mark.slow
def test_the_engine_drops_the_plain_weights(llm_gguf, llm_float32, plain_model):
    """No step reads a plain float32 matmul weight once the cpu backend has packed it (and
    the head gets at most max_num_seqs rows): the engine keeps none of them."""
    for llm in (llm_gguf, llm_float32):
        assert all(linear.weight.is_meta for linear in _linears(llm.engine.model).values())
        float32_bytes = sum(m.weight.numel() * 4 for m in _linears(plain_model).values())
        assert llm.engine.memory.dropped == float32_bytes


@pytest.mark.slow
def test_greedy_output_is_the_same_on_blocks_and_float32(llm_gguf, llm_float32):
    params = SamplingParams(max_tokens=24, temperature=0)
    got = llm_gguf.generate(PROMPTS, params)
    want = llm_float32.generate(PROMPTS, params)
    assert len(llm_gguf.encode(PROMPTS[2])) > 24  # its prefill skips the blocks
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.prompt_token_ids == w.prompt_token_ids
        assert len(w.token_ids) > 0
        assert g.token_ids == w.token_ids, f"prompt {i}: {g.text!r} vs {w.text!r}"


@pytest.mark.slow
def test_a_weight_that_differs_from_its_blocks_stays_float32(ops, gguf_path, plain_model):
    """Runs on the plain model and puts its weight back as it was."""
    weight = plain_model.layers[0].o_proj.weight.data
    original = weight[5, 7].clone()
    try:
        weight[5, 7] += 1e-3
        found, report = exact_gguf_blocks(plain_model, gguf_path, ops)
    finally:
        weight[5, 7] = original
    assert isinstance(report, BlocksReport)
    assert set(report.skipped) == {"layers.0.o_proj"}, report.skipped
    assert "do not de-quantize" in report.skipped["layers.0.o_proj"]
    assert set(found) == set(_linears(plain_model)) - {"layers.0.o_proj"}
    assert report.attached == {"Q4_1": NUM_LINEARS - 2, "Q8_0": 1}
    assert 0 < report.body_block_bytes < report.body_float32_bytes
    assert report.body_saved_bytes == report.body_float32_bytes - report.body_block_bytes
    assert report.lm_head_block_bytes is not None
    assert 0 < report.lm_head_block_bytes < report.lm_head_float32_bytes
    assert "layers.0.o_proj" in report.summary()


# --- _row_order -----------------------------------------------------------------------------


def _q4_1_rows(n: int, k: int, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    """Raw Q4_1 blocks [n, bytes] of a random matrix and their de-quantized rows [n, k]."""
    w = np.random.default_rng(seed).standard_normal((n, k), dtype=np.float32)
    raw = quantize(w, GGMLQuantizationType.Q4_1)
    return raw, torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q4_1).astype(np.float32))


def test_row_order_identity():
    raw, rows = _q4_1_rows(96, 64, seed=0)
    order = _row_order(raw, 3, rows.contiguous())
    assert order is not None and np.array_equal(order, np.arange(96))


def test_row_order_finds_a_permutation():
    raw, rows = _q4_1_rows(200, 96, seed=1)
    perm = np.random.default_rng(2).permutation(200)
    target = rows[torch.from_numpy(perm)].contiguous()
    order = _row_order(raw, 3, target)
    assert order is not None
    assert np.array_equal(order, perm)
    # raw[order] is the blocks of the target, row for row
    again = dequantize(raw[order], GGMLQuantizationType.Q4_1)
    assert np.array_equal(again.view(np.uint32), target.numpy().view(np.uint32))


def test_row_order_none_when_a_row_matches_nothing():
    raw, rows = _q4_1_rows(200, 96, seed=3)
    perm = np.random.default_rng(4).permutation(200)
    target = rows[torch.from_numpy(perm)].contiguous()
    target[17, 40] += 1e-3
    assert _row_order(raw, 3, target) is None
    # the identity order with one changed weight is no match either
    target = rows.clone()
    target[0, 0] = torch.nextafter(target[0, 0], torch.tensor(float("inf")))
    assert _row_order(raw, 3, target) is None


def test_row_order_none_when_shapes_differ():
    raw, rows = _q4_1_rows(64, 64, seed=5)
    assert _row_order(raw, 3, rows[:63].contiguous()) is None
