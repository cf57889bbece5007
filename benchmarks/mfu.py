"""Model FLOPs per request and the matmul FLOP/s ceiling for the model's own shapes.

MFU = achieved model FLOP/s / the best FLOP/s this machine reaches on the model's matmuls at
the same number of rows. A square 1024 x 1024 matmul (``planner.cpu``) overstates what a
decode step with 16 or 64 rows can reach, so the ceiling here is measured with the model's
weight shapes, one distinct weight tensor per layer (30 layers of SmolLM2-135M are ~425 MB,
far beyond the caches, as in a real forward), both as ``x @ W`` with contiguous ``[in, out]``
weights (pagedserve's layout) and as ``F.linear(x, W)`` with ``[out, in]`` weights
(``transformers``' layout); the better of the two is the ceiling.
"""

from __future__ import annotations

import json
import time
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
        ``{"x_at_w": ..., "f_linear": ..., "ceiling": max of the two}`` in FLOP/s.
    """
    import torch
    import torch.nn.functional as F

    shapes_list = layer_matmuls(config) * config.num_layers + [
        (config.hidden_size, config.vocab_size)
    ]
    flops = sum(2 * num_rows * i * o for i, o in shapes_list)
    g = torch.Generator().manual_seed(0)
    inputs = {i: torch.rand(num_rows, i, generator=g) for i, _ in set(shapes_list)}

    def best_seconds(weights: list[torch.Tensor], linear: bool) -> float:
        def one_pass() -> None:
            for (i, _), w in zip(shapes_list, weights, strict=True):
                _ = F.linear(inputs[i], w) if linear else inputs[i] @ w

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

    with torch.inference_mode():
        # One layout at a time, so the two never hold 1 GB of weights together.
        w_in_out = [torch.rand(i, o, generator=g) for i, o in shapes_list]
        x_at_w = flops / best_seconds(w_in_out, linear=False)
        del w_in_out
        w_out_in = [torch.rand(o, i, generator=g) for i, o in shapes_list]
        f_linear = flops / best_seconds(w_out_in, linear=True)
        del w_out_in
    return {"x_at_w": x_at_w, "f_linear": f_linear, "ceiling": max(x_at_w, f_linear)}


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
