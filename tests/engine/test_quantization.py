"""--quantization (engine/quantization.py): the format's error bound, the transform, and the
engine end to end on a tiny random model.

Exactness where there is an exact answer: a quantized model multiplies by ``q * scale``, so
transformers' model with every matmul weight replaced by its de-quantized value is the
oracle, and our greedy output matches it token for token under the suite's float32 near-tie
rule (tests/engine/parity.py), on the C++ CPU stack (int8 panels for small batches) and on the
plain PyTorch path. What int8 costs against the float model is a quality figure, measured on
the default model in tests/benchmarks/test_quality.py.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from engine import LLM
from engine.attention import PagedAttention
from engine.backends.cpu import CpuForward
from engine.config import EngineConfig, ModelConfig
from engine.llama import Linear, LlamaForCausalLM
from engine.quantization import (
    QuantizedLinear,
    UnsupportedQuantizationError,
    check_supported,
    dequantize_weight,
    quantize_linears,
    quantize_weight,
)
from engine.rope import RotaryEmbedding
from scheduler.request import SamplingParams
from tests.engine.conftest import make_tiny_llama
from tests.engine.parity import assert_parity, hf_greedy


def _weight(k: int = 256, n: int = 96, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Columns of very different magnitudes, an outlier, a zero column.
    w = torch.randn(k, n, generator=g) * torch.logspace(-4, 1, n)
    w[3, 5] = 50.0
    w[:, 7] = 0.0
    return w


def test_int8_round_trip_error_is_at_most_half_a_step():
    w = _weight()
    q, scale = quantize_weight(w, "int8")
    assert q.dtype == torch.int8 and q.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == (w.shape[1],)
    assert q.abs().max() <= 127 and q.min() >= -127
    # Every non-zero column uses the full range (its largest |w| maps to 127).
    nonzero = w.abs().amax(0) > 0
    assert (q.abs().amax(0)[nonzero] == 127).all()
    err = (dequantize_weight(q, scale) - w).abs()
    # Half a quantization step, plus the float32 rounding of w / scale and of q * scale.
    assert (err <= scale * (0.5 + 1e-5)).all(), (err / scale).max()
    assert scale[7] == 1 and (q[:, 7] == 0).all()  # a zero column: scale 1, zeros


def test_fp8_round_trip_error_is_within_e4m3_rounding():
    w = _weight(seed=1)
    q, scale = quantize_weight(w, "fp8")
    assert q.dtype == torch.float8_e4m3fn
    err = (dequantize_weight(q, scale) - w).abs()
    # 3 mantissa bits: half an ulp is at most 2^-4 of |w|; near zero (subnormals, spacing
    # 2^-9 of the scale) at most 2^-10 of the scale.
    bound = torch.maximum(w.abs() * 2.0**-4, scale * 2.0**-10) * (1 + 1e-5)
    assert (err <= bound).all(), (err / bound).max()


def test_fp8_needs_cuda_and_unknown_modes_are_refused():
    check_supported("int8", torch.device("cpu"))
    with pytest.raises(UnsupportedQuantizationError, match="fp8 needs a CUDA GPU"):
        check_supported("fp8", torch.device("cpu"))
    with pytest.raises(UnsupportedQuantizationError, match="int4"):
        check_supported("int4", torch.device("cpu"))


def _tiny_model() -> LlamaForCausalLM:
    config = ModelConfig.from_hf(
        dict(
            model_type="llama",
            vocab_size=128,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            rms_norm_eps=1e-5,
            attention_bias=True,
        )
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        config,
        PagedAttention("torch", scale=config.head_dim**-0.5),
        RotaryEmbedding(config, 64, torch.device("cpu")),
    )
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return model


def test_transform_swaps_every_matmul_and_keeps_the_embedding():
    model = _tiny_model()
    floats = {
        n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, Linear)
    }
    embedding = model.embed_tokens.weight
    report = quantize_linears(model, "int8")
    assert report.num_matmuls == len(floats) == 2 * 4 + 1
    assert not any(type(m) is Linear for m in model.modules())
    assert model.embed_tokens.weight is embedding
    head_float = floats["lm_head"].numel() * 4
    assert report.lm_head_float_bytes == head_float
    assert report.lm_head_quant_bytes == floats["lm_head"].numel() + 4 * 128
    assert report.body_float_bytes == sum(w.numel() * 4 for w in floats.values()) - head_float
    assert "int8" in report.summary(torch.float32) and "3." in report.summary(torch.float32)
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            q, scale = quantize_weight(floats[name], "int8")
            assert torch.equal(module.qweight, q) and torch.equal(module.scale, scale)
            x = torch.randn(3, module.in_features)
            want = x @ dequantize_weight(q, scale)
            if module.bias is not None:
                want += module.bias
            torch.testing.assert_close(module(x), want, rtol=1e-5, atol=1e-5)


def _fake_quantized_hf(path, mode: str = "int8"):
    """transformers' model with every matmul weight replaced by its int8 de-quantized value
    (per output channel: a row of HF's [out, in] weight; fused q/k/v and gate/up quantize
    each output channel on its own, so the parts quantize alone to the same values)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        for module in hf.modules():
            if isinstance(module, torch.nn.Linear):
                q, scale = quantize_weight(module.weight.t(), mode)
                module.weight.copy_(dequantize_weight(q, scale).t())
    return hf


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_tiny_llama(
        tmp_path_factory.mktemp("tiny-quant"), num_kv_heads=2, seed=3, hidden_size=128,
        intermediate_size=256,
    )  # fmt: skip


PROMPTS = [[1, 17, 33, 90, 4], [1, 200, 5, 5, 5, 5, 71, 12, 9, 100, 3, 44, 44, 18, 250, 7, 7]]


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_int8_engine_matches_transformers_with_the_dequantized_weights(ops, tiny_path, backend):
    """Greedy, alone and batched together, on the C++ stack (int8 panels: every step here
    has at most max_quant_rows() rows but the prefill of the batch) and the plain path."""
    llm = LLM(str(tiny_path), quantization="int8", attention_backend=backend, num_kv_blocks=32,
              device="cpu")
    assert llm.engine.matmul_weights == "int8"
    if backend == "cpu":
        forward = llm.engine.runner.model
        assert isinstance(forward, CpuForward) and forward.uses_blocks
        assert forward.blocks is not None and forward.blocks.attached["int8"] == 9
        assert forward.spec.layers[0].qkv.quant is not None
    hf = _fake_quantized_hf(tiny_path)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    together = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, together, strict=True):
        ref = hf_greedy(hf, prompt, 24, None)
        alone = llm.generate([prompt], params)[0]
        assert_parity(alone.token_ids, ref, f"{backend} alone")
        assert_parity(out.token_ids, ref, f"{backend} batched")


def test_int8_decode_step_reads_fewer_weight_bytes(ops, tiny_path):
    """The MBU byte model (engine/cost.py) counts what a decode step reads: the int8 blocks
    (9 bits a weight) instead of float32 on the C++ stack."""
    plain = LLM(str(tiny_path), attention_backend="cpu", num_kv_blocks=32, device="cpu")
    quant = LLM(str(tiny_path), attention_backend="cpu", num_kv_blocks=32, quantization="int8",
                device="cpu")
    step = lambda llm: llm.engine.cost_model.step([(10, 1)], 1).weight_bytes  # noqa: E731
    matmul_params = sum(
        m.qweight.numel() for m in quant.engine.model.modules() if isinstance(m, QuantizedLinear)
    )
    saved = step(plain) - step(quant)
    assert saved == pytest.approx(matmul_params * (4 - 9 / 8), rel=0.02)


def test_unknown_quantization_is_a_value_error():
    with pytest.raises(ValueError, match="quantization must be int8 or fp8"):
        LLM("default", quantization="int4")


def test_quantization_with_tensor_parallelism_is_refused():
    """Not silently half-quantized: the sharded model's row-parallel matmuls and head are
    modules the transform does not swap."""
    with pytest.raises(ValueError, match="does not combine with --tensor-parallel-size"):
        EngineConfig(quantization="int8", tensor_parallel_size=2)


def test_an_unknown_mode_on_the_command_line_is_one_line(capsys):
    from server import cli

    with pytest.raises(SystemExit) as exited:
        cli.main(["serve", "--quantization", "int4"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "argument --quantization: invalid choice: 'int4'" in err.splitlines()[-1]
    assert "Traceback" not in err


def test_fp8_on_the_cpu_is_one_line_and_exit_2(tmp_path):
    """Refused before the model loads: one line on stderr, exit status 2, no traceback. (A
    tokenizer is given: a preset without one is refused first, from the flags alone.)"""
    from tests.server.server_fakes import tiny_tokenizer

    tiny_tokenizer().save_pretrained(tmp_path / "tokenizer")
    argv = ["--quantization", "fp8", "--device", "cpu", "--load-format", "dummy",
            "--model", "tiny-llama", "--tokenizer", str(tmp_path / "tokenizer"),
            "--log-level", "warning"]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "server", *argv], capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pagedserve serve: error: "), done.stderr
    assert "fp8 needs a CUDA GPU" in lines[0] and "--quantization int8" in lines[0]
