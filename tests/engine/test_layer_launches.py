"""Kernels a decoder layer launches in a decode step on the CUDA path (issue 36: at most 8
besides the matmuls and attention; the fused ops make it 4).

The layer's ops are counted as they reach the dispatcher (``TorchDispatchMode``) and as
Triton launches (``run`` of the kernel objects), during the engine's own decode steps with
the Triton attention backend and the fused layer ops (``engine/backends/cuda.py``): on the
CPU under the interpreter, with the norms and SiLU swapped in as the builder does on CUDA,
and on CUDA itself. A CUDA graph replays the same launches, so a copy or an elementwise op
slipped into the layer's Python shows here without a GPU.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine import LLM, SamplingParams
from engine.backends.cuda import fuse_layer_ops
from engine.llama import DecoderLayer
from tests.triton_devices import TRITON_DEVICES

MATMULS = {"mm", "addmm", "matmul", "bmm", "linear"}
# Allocations launch nothing.
ALLOCATIONS = {"empty", "empty_like", "new_empty", "empty_strided"}
# issue 36's bound on a layer's launches besides its matmuls and attention
MAX_OTHER_LAUNCHES = 8


def _tensors(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


class LayerLaunches(TorchDispatchMode):
    """Each decoder layer call's launches, as ``kind:name`` (``kind``: matmul, attention,
    other). A view (an out-of-place op whose output shares an input's storage) and an
    allocation launch nothing; ops inside a Triton launch (the interpreter's own copies)
    are not the layer's."""

    def __init__(self) -> None:
        super().__init__()
        self.layers: list[tuple[int, list[str]]] = []  # (tokens, launches) per layer call
        self._current: list[str] | None = None
        self._in_kernel = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if self._current is None or self._in_kernel:
            return out
        name = func.overloadpacket.__name__
        if name in ALLOCATIONS:
            return out
        inputs = {t.untyped_storage().data_ptr() for t in _tensors(list(args)) if t.numel()}
        outputs = _tensors(out)
        viewed = outputs and all(
            t.numel() == 0 or t.untyped_storage().data_ptr() in inputs for t in outputs
        )
        if viewed and not name.endswith("_"):
            return out
        self._current.append(f"{'matmul' if name in MATMULS else 'other'}:{name}")
        return out

    def kernel(self, fn: object) -> contextlib.AbstractContextManager[None]:
        """A Triton launch of ``fn``; the attention modules' kernels (a split decode's
        merge kernel too) are attention, the split-K matmul's (and its reduction) matmul."""
        if self._current is not None and not self._in_kernel:
            module = getattr(fn, "__module__", "")
            if module in ("kernels.paged_attention", "kernels.prefill_attention"):
                kind = "attention"
            elif module == "kernels.quant_matmul":  # PAGEDSERVE_DECODE_MATMUL=triton
                kind = "matmul"
            else:
                kind = "other"
            self._current.append(f"{kind}:{getattr(fn, '__name__', repr(fn))}")
        return self._inside_kernel()

    @contextlib.contextmanager
    def _inside_kernel(self) -> Iterator[None]:
        before, self._in_kernel = self._in_kernel, True
        try:
            yield
        finally:
            self._in_kernel = before

    def start_layer(self) -> None:
        self._current = []

    def end_layer(self, num_tokens: int) -> None:
        assert self._current is not None
        self.layers.append((num_tokens, self._current))
        self._current = None


@pytest.mark.parametrize("triton_matmuls", [False, True], ids=["library", "triton-matmuls"])
@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_a_decode_steps_layer_launches_four_kernels_besides_matmuls_and_attention(
    tiny_llama_gqa, device, triton_matmuls, monkeypatch
):
    """With PAGEDSERVE_DECODE_MATMUL=triton each matmul is the split-K kernel (with its
    reduction where it splits, on CUDA), the others unchanged."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    from kernels.settings import DECODE_MATMUL_ENV

    monkeypatch.setenv(DECODE_MATMUL_ENV, "triton" if triton_matmuls else "library")

    # Eager: a CUDA graph replays these same launches without calling the layer's Python.
    llm = LLM(str(tiny_llama_gqa), attention_backend="triton", device=device,
              dtype="float32", num_kv_blocks=64, block_size=8, enforce_eager=True)  # fmt: skip
    model = llm.engine.model
    if device == "cpu":  # the builder fuses them on CUDA only
        assert fuse_layer_ops(model, triton_matmuls=triton_matmuls) > 0
    counter = LayerLaunches()
    for cls in (InterpretedFunction, JITFunction):
        original = cls.run

        def run(self, *args, _original=original, **kwargs):  # type: ignore[no-untyped-def]
            with counter.kernel(self.fn):
                return _original(self, *args, **kwargs)

        monkeypatch.setattr(cls, "run", run)
    hooks = []
    for module in model.modules():
        if isinstance(module, DecoderLayer):
            hooks.append(module.register_forward_pre_hook(lambda m, a: counter.start_layer()))
            hooks.append(
                module.register_forward_hook(lambda m, a, o: counter.end_layer(a[0].shape[0]))
            )
    try:
        with counter:
            llm.generate([[5, 6, 7, 8, 9], [3, 4, 5]],
                         SamplingParams(max_tokens=4, temperature=0))  # fmt: skip
    finally:
        for hook in hooks:
            hook.remove()
    decode_layers = [launches for tokens, launches in counter.layers if tokens == 2]
    assert len(decode_layers) >= 2 * model.config.num_layers, counter.layers
    for launches in decode_layers:
        kinds = Counter(item.split(":", 1)[0] for item in launches)
        others = [item for item in launches if item.startswith("other:")]
        matmuls = [item for item in launches if item.startswith("matmul:")]
        if triton_matmuls:  # qkv, o, gate_up, down; on CUDA a reduction after each split
            split_k = [m for m in matmuls if m == "matmul:_quant_matmul_split_k_kernel"]
            assert len(split_k) == 4 and len(matmuls) <= 8, launches
        else:
            assert kinds["matmul"] == 4, launches  # qkv, o, gate_up, down
        # the decode kernel, and on CUDA its merge kernel where the context is split
        assert 1 <= kinds["attention"] <= 2, launches
        # add_rms_norm_ (rms_norm in the first layer) twice, rope_and_store_, silu_mul
        assert len(others) == 4 <= MAX_OTHER_LAUNCHES, launches
