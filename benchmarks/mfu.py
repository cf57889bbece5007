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
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class ModelShapes:
    """The matmul shapes of a Llama-family decoder, from its HF ``config.json``."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelShapes:
        hidden = int(config["hidden_size"])
        num_heads = int(config["num_attention_heads"])
        head_dim = config.get("head_dim") or hidden // num_heads
        return cls(
            num_layers=int(config["num_hidden_layers"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            vocab_size=int(config["vocab_size"]),
        )

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> ModelShapes:
        return cls.from_config(json.loads((model_dir / "config.json").read_text()))

    def layer_matmuls(self) -> list[tuple[int, int]]:
        """(in, out) of one decoder layer's fused matmuls: qkv, o, gate_up, down."""
        h, d = self.hidden_size, self.head_dim
        return [
            (h, (self.num_heads + 2 * self.num_kv_heads) * d),
            (self.num_heads * d, h),
            (h, 2 * self.intermediate_size),
            (self.intermediate_size, h),
        ]

    @property
    def layer_params(self) -> int:
        """Matmul weights of all decoder layers (norms are negligible and not matmuls)."""
        return self.num_layers * sum(i * o for i, o in self.layer_matmuls())

    @property
    def lm_head_params(self) -> int:
        return self.hidden_size * self.vocab_size


def request_flops(shapes: ModelShapes, prompt_tokens: float, output_tokens: float) -> float:
    """Model FLOPs one request needs: matmuls (2 per weight per token) plus attention.

    NOTE: every token but the last output goes through the decoder layers (P + O - 1), and
    only the O positions that sample a token need the lm_head; a prefill that computed
    logits for every prompt position would do more work, not more useful work.
    Attention at a token that sees ``t`` positions costs 4 * t * num_heads * head_dim per
    layer (QK^T and PV, 2 FLOPs per multiply-add).

         prompt P                 output O
      |-----------------|x x x x x x x x x x x|
       decoder layers: P + O - 1 tokens (the last output is never fed back)
       lm_head:                 O positions (last prompt position + O - 1 outputs)
    """
    forwarded = prompt_tokens + output_tokens - 1
    matmul = 2 * forwarded * shapes.layer_params + 2 * output_tokens * shapes.lm_head_params
    # Token t (1-based) attends to t positions: sum over t = 1..forwarded.
    attended = forwarded * (forwarded + 1) / 2
    attention = 4 * shapes.num_layers * shapes.num_heads * shapes.head_dim * attended
    return matmul + attention


def achieved_flops_s(
    shapes: ModelShapes,
    num_completed: int,
    mean_prompt_tokens: float,
    mean_output_tokens: float,
    duration_s: float,
) -> float:
    """Model FLOP/s of a load-test point (requests of equal lengths, as in this benchmark)."""
    if duration_s <= 0 or num_completed == 0:
        return 0.0
    per_request = request_flops(shapes, mean_prompt_tokens, mean_output_tokens)
    return num_completed * per_request / duration_s


def measure_matmul_ceiling(
    shapes: ModelShapes, num_rows: int, min_repeats: int = 3, budget_s: float = 2.0
) -> dict[str, float]:
    """FLOP/s of one pass over every layer's matmuls plus the lm_head at ``num_rows`` rows.

    Returns:
        ``{"x_at_w": ..., "f_linear": ..., "ceiling": max of the two}`` in FLOP/s.
    """
    import torch
    import torch.nn.functional as F

    shapes_list = shapes.layer_matmuls() * shapes.num_layers + [
        (shapes.hidden_size, shapes.vocab_size)
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
    points: dict[str, dict[str, Any]], shapes: ModelShapes, ceilings: dict[str, float]
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
            shapes,
            row["num_completed"],
            row["mean_prompt_tokens"],
            row["mean_output_tokens"],
            row["duration_s"],
        )
        row["mfu"] = row["model_flops_s"] / ceilings[c]
