"""``PAGEDSERVE_DECODE_MATMUL=triton``: a CUDA engine's dense ``Linear`` layers run decode
batches (at most ``DECODE_ROWS`` rows) on the split-K Triton kernel
(``kernels.quant_matmul.dense_matmul``, engine/backends/cuda.py's ``TritonLinear``).

Greedy tokens against transformers in float32 on the same device, several requests at once
(decode batches of 1-3 rows, and with a 16-token step budget every prefill chunk too), with
asynchronous steps and through the decode and prefill graphs' buffers (their CPU stand-ins
on the CPU, as on CUDA without the capture): on the CPU under the interpreter with the
layer ops swapped in as the builder does on CUDA, and on CUDA as the builder builds it.
tests/kernels/test_quant_matmul.py checks the kernel case by case.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.backends.cuda import TritonLinear, fuse_layer_ops
from engine.llama import Linear
from kernels.settings import DECODE_MATMUL_ENV
from tests.engine.graph_stand_ins import install_decode_stand_in, install_prefill_stand_in
from tests.engine.parity import assert_parity, random_prompts_and_references
from tests.split_k_calls import record_split_k_calls
from tests.triton_devices import TRITON_DEVICES

TOKENS = 5


def _linears(model: torch.nn.Module) -> tuple[int, int]:
    """(TritonLinear layers, plain dense Linear layers) of ``model``."""
    triton = sum(isinstance(m, TritonLinear) for m in model.modules())
    plain = sum(type(m) is Linear for m in model.modules())
    return triton, plain


def test_only_the_switch_swaps_the_linears(tiny_llama_gqa):
    """fuse_layer_ops swaps every dense Linear (4 a layer and the LM head) only when asked,
    sharing the weight tensors."""
    llm = LLM(str(tiny_llama_gqa), device="cpu", dtype="float32", num_kv_blocks=16,
              block_size=8, enforce_eager=True)  # fmt: skip
    model = llm.engine.model
    layers = model.config.num_layers
    fuse_layer_ops(model)
    assert _linears(model) == (0, 4 * layers + 1)
    head = model.lm_head.weight
    fuse_layer_ops(model, triton_matmuls=True)
    assert _linears(model) == (4 * layers + 1, 0)
    assert model.lm_head.weight is head


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-stand-ins"])
@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_triton_matmuls_match_transformers(tiny_llama_gqa, device, graphs, monkeypatch):
    import engine.backends.cuda as cuda_backend

    monkeypatch.setenv(DECODE_MATMUL_ENV, "triton")
    rows_seen: list[int] = []

    def counting(x, *args, _dense=cuda_backend.dense_matmul, **kwargs):  # type: ignore[no-untyped-def]
        rows_seen.append(x.shape[0])
        return _dense(x, *args, **kwargs)

    monkeypatch.setattr(cuda_backend, "dense_matmul", counting)
    prompts, refs = random_prompts_and_references(tiny_llama_gqa, device, 11, (7, 21, 3), TOKENS)
    llm = LLM(str(tiny_llama_gqa), attention_backend="triton", device=device,
              dtype="float32", num_kv_blocks=64, block_size=8, max_num_seqs=4,
              max_num_batched_tokens=16, async_scheduling=True,
              enforce_eager=device == "cpu" or not graphs)  # fmt: skip
    engine = llm.engine
    if device == "cpu":  # the builder swaps them on CUDA only
        fuse_layer_ops(engine.model, triton_matmuls=True)
        if graphs:
            install_decode_stand_in(engine, [1, 2, 4])
            install_prefill_stand_in(engine, [8, 16])
    assert _linears(engine.model) == (4 * engine.model.config.num_layers + 1, 0)
    outs = llm.generate(prompts, SamplingParams(max_tokens=TOKENS, temperature=0.0,
                                                ignore_eos=True))  # fmt: skip
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        assert_parity(out.token_ids, ref, f"triton matmuls on {device}, prompt {i}")
    # Decode batches of 1-3 rows and prompt chunks of up to 16 tokens took the kernel (on
    # CUDA graphs replay what their capture called; a 1-row LM head call is every step's).
    assert 1 in rows_seen and max(rows_seen) <= 16, sorted(set(rows_seen))
    if device == "cpu":
        assert {2, 3} <= set(rows_seen) and max(rows_seen) > 3, sorted(set(rows_seen))


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_a_tuning_tables_launches_keep_the_tokens(tiny_llama_gqa, device, monkeypatch, tmp_path):
    """With PAGEDSERVE_MATMUL_TUNING (kernels/matmul_tuning.py) every layer matmul takes the
    table's split launches (two splits, summed by the second kernel or by the last split)
    and the LM head the library's: greedy tokens against transformers in float32, and the
    engine took the table's launches."""
    import json
    from dataclasses import asdict

    import kernels.quant_matmul as qm
    from kernels.matmul_tuning import MATMUL_TUNING_ENV

    # The third prompt's chunks come later: its last decodes run alone (1 row).
    prompts, refs = random_prompts_and_references(tiny_llama_gqa, device, 12, (9, 4, 20), TOKENS)
    llm = LLM(str(tiny_llama_gqa), attention_backend="triton", device=device,
              dtype="float32", num_kv_blocks=64, block_size=8, max_num_seqs=4,
              max_num_batched_tokens=16, enforce_eager=True)  # fmt: skip
    model = llm.engine.model
    fuse_layer_ops(model, triton_matmuls=True)
    split = qm.SplitKLaunch(1, 32, 16, 2, 4, 2, dot=False)
    summed_in_place = qm.SplitKLaunch(16, 64, 16, 2, 4, 2, dot=True, one_launch=True)
    shapes = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, TritonLinear)}
    head = tuple(model.lm_head.weight.shape)
    by_rows = ((1, split), (16, summed_in_place))
    entries = [{"weight": "float32", "k": k, "n": n, "rows": rows, "launch": asdict(launch)}
               for k, n in shapes - {head} for rows, launch in by_rows]  # fmt: skip
    entries.append({"weight": "float32", "k": head[0], "n": head[1], "rows": 16,
                    "launch": "library"})  # fmt: skip
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps({"format": 1, "device": "test", "entries": entries}))
    monkeypatch.setenv(MATMUL_TUNING_ENV, str(path))
    calls = record_split_k_calls(monkeypatch)
    outs = llm.generate(prompts, SamplingParams(max_tokens=TOKENS, temperature=0.0,
                                                ignore_eos=True))  # fmt: skip
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        assert_parity(out.token_ids, ref, f"tuned matmuls on {device}, prompt {i}")
    # The LM head's entry sends it to the library.
    assert head not in {call.weight_shape for call in calls}
    launched = {call.launch for call in calls}
    assert launched == {split, summed_in_place}, launched
