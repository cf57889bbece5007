"""Model FLOPs per request and the matmul FLOP/s ceiling for the model's own shapes.

MFU = achieved model FLOP/s / the best FLOP/s this machine reaches on the model's matmuls
(``benchmarks.speed`` measures the ceiling at each concurrency's row count and at 256 and
2,048 rows, and divides by the best: a server that runs prefill chunks beside its decodes
feeds its matmuls more rows than its concurrency). A square 1024 x 1024 matmul
(``planner.cpu``) says little about the model's thin shapes, so the ceiling is measured
with the model's weight shapes, one distinct weight tensor per layer (30 layers of
SmolLM2-135M are ~425 MB, far beyond the caches, as in a real forward), as ``x @ W`` with
contiguous ``[in, out]`` weights and as ``F.linear(x, W)`` with ``[out, in]`` weights
(``transformers``' layout) and, when the C++ CPU kernels build, with pagedserve's own
matmuls at the row counts it uses them for: the float32 panels, and the GGUF blocks (Q4_1
layers, a Q8_0 lm_head, as the default checkpoint ships them; the same float32 FLOPs from
4.8x fewer bytes). The best of them is the ceiling at that row count. Measured against the
library alone at the concurrency's row count, a server whose own kernels beat the library
read an MFU far above 100%: a ceiling the machine demonstrably exceeds says nothing about
how much compute is left.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.config import ModelConfig
from engine.cost import StepCostModel


def model_config(model_dir: Path) -> ModelConfig:
    """The engine's view of a checkpoint's HF ``config.json``."""
    return ModelConfig.from_hf(json.loads((model_dir / "config.json").read_text()))


def layer_matmuls(config: ModelConfig) -> list[tuple[int, int]]:
    """(in, out) of one decoder layer's matmuls as ``engine/llama.py`` fuses them:
    qkv, o, gate_up, down."""
    h, d = config.hidden_size, config.head_dim
    return [
        (h, (config.num_heads + 2 * config.num_kv_heads) * d),
        (config.num_heads * d, h),
        (h, 2 * config.intermediate_size),
        (config.intermediate_size, h),
    ]


def request_flops(cost: StepCostModel, prompt_tokens: float, output_tokens: float) -> float:
    """Model FLOPs one request needs, with the engine's own per-token coefficients
    (``StepCostModel``: what the MBU/MFU gauges count), summed over the whole request.

    NOTE: every token but the last output goes through the decoder layers (P + O - 1), and
    only the O positions that sample a token need the lm_head; a prefill that computed
    logits for every prompt position would do more work, not more useful work. Lengths may
    be means over a load-test point, hence floats.

         prompt P                 output O
      |-----------------|x x x x x x x x x x x|
       decoder layers: P + O - 1 tokens (the last output is never fed back)
       lm_head:                 O positions (last prompt position + O - 1 outputs)
    """
    forwarded = prompt_tokens + output_tokens - 1
    # Token t (1-based) attends to t positions: sum over t = 1..forwarded.
    attended_pairs = forwarded * (forwarded + 1) / 2
    return (
        2 * forwarded * cost.body_matmul_params
        + 2 * output_tokens * cost.lm_head_params
        + cost.attention_flops_per_pair * attended_pairs
    )


def achieved_flops_s(
    cost: StepCostModel,
    num_completed: int,
    mean_prompt_tokens: float,
    mean_output_tokens: float,
    duration_s: float,
) -> float:
    """Model FLOP/s of a load-test point (requests of equal lengths, as in this benchmark)."""
    if duration_s <= 0 or num_completed == 0:
        return 0.0
    per_request = request_flops(cost, mean_prompt_tokens, mean_output_tokens)
    return num_completed * per_request / duration_s


def measure_matmul_ceiling(
    config: ModelConfig, num_rows: int, min_repeats: int = 3, budget_s: float = 2.0
) -> dict[str, float]:
    """FLOP/s of one pass over every layer's matmuls plus the lm_head at ``num_rows`` rows.

    Returns:
        FLOP/s of ``x_at_w`` and ``f_linear``, and of ``panels`` and ``blocks`` when the C++
        kernels built and serve that many rows (``max_packed_rows`` / ``max_quant_rows``);
        ``ceiling`` is the best of them.
    """
    import torch
    import torch.nn.functional as F

    shapes_list = layer_matmuls(config) * config.num_layers + [
        (config.hidden_size, config.vocab_size)
    ]
    flops = sum(2 * num_rows * i * o for i, o in shapes_list)
    g = torch.Generator().manual_seed(0)
    inputs = {i: torch.rand(num_rows, i, generator=g) for i, _ in set(shapes_list)}

    def best_of(one_pass: Callable[[], None]) -> float:
        # Best of several passes: on a shared machine other work only ever slows one down.
        one_pass()  # warm-up
        best, runs = float("inf"), 0
        deadline = time.perf_counter() + budget_s
        while runs < min_repeats or time.perf_counter() < deadline:
            start = time.perf_counter()
            one_pass()
            best = min(best, time.perf_counter() - start)
            runs += 1
        return best

    def each(weights: list[Any], matmul: Callable[[Any, Any, int], object]) -> float:
        def one_pass() -> None:
            for (i, o), w in zip(shapes_list, weights, strict=True):
                matmul(inputs[i], w, o)

        return flops / best_of(one_pass)

    from kernels import cpu as cpu_kernels

    ops = cpu_kernels.load()
    out: dict[str, float] = {}
    with torch.inference_mode():
        # One layout at a time, so no two copies of ~0.5 GB of weights live together.
        w_in_out = [torch.rand(i, o, generator=g) for i, o in shapes_list]
        out["x_at_w"] = each(w_in_out, lambda x, w, _: x @ w)
        serves_panels = ops is not None and num_rows <= ops.max_packed_rows()
        packed = [ops.pack_weight(w) for w in w_in_out] if serves_panels else []
        del w_in_out
        if packed:
            out["panels"] = each(packed, lambda x, w, n: ops.packed_linear(x, w, n, None))
            del packed
        w_out_in = [torch.rand(o, i, generator=g) for i, o in shapes_list]
        out["f_linear"] = each(w_out_in, lambda x, w, _: F.linear(x, w))
        del w_out_in
        if ops is not None and num_rows <= ops.max_quant_rows():
            last = len(shapes_list) - 1  # the lm_head: Q8_0, the layers Q4_1
            blocks = [
                ops.pack_gguf(_gguf_raw(o, i, q8=n == last, g=g), 8 if n == last else 3, i)
                for n, (i, o) in enumerate(shapes_list)
            ]
            out["blocks"] = each(blocks, lambda x, w, n: ops.quant_linear(x, w, n, None))
            del blocks
    out["ceiling"] = max(out.values())
    return out


def _gguf_raw(rows: int, cols: int, *, q8: bool, g: Any) -> Any:
    """Raw GGUF blocks of a ``[rows, cols]`` weight: Q8_0 (float16 d, 32 int8) or Q4_1
    (float16 d and m, 16 bytes of nibbles) a block of 32, random quants and fixed moderate
    scales (what the values are does not change the time; no NaNs or subnormals)."""
    import torch

    num_blocks = cols // 32
    scales = torch.tensor([0.01] if q8 else [0.01, -0.08], dtype=torch.float16)
    head = scales.view(torch.uint8)
    size = 34 if q8 else 20
    raw = torch.randint(0, 256, (rows, num_blocks, size), dtype=torch.uint8, generator=g)
    raw[:, :, : head.numel()] = head
    return raw.view(rows, num_blocks * size)


def add_mfu(
    points: dict[str, dict[str, Any]], cost: StepCostModel, ceilings: dict[str, float]
) -> None:
    """Set ``model_flops_s`` and ``mfu`` on each point whose concurrency has a ceiling.

    Args:
        points: ``{"<concurrency>": row}`` as ``servers.measure_server`` returns them.
        ceilings: ``{"<rows>": FLOP/s}``; the point at concurrency c uses the ceiling at c rows.
    """
    for c, row in points.items():
        if c not in ceilings or not row.get("num_completed"):
            continue
        row["model_flops_s"] = achieved_flops_s(
            cost,
            row["num_completed"],
            row["mean_prompt_tokens"],
            row["mean_output_tokens"],
            row["duration_s"],
        )
        row["mfu"] = row["model_flops_s"] / ceilings[c]
