"""A mixture-of-experts MLP (Mixtral, Qwen3-MoE): top-k routing, experts run grouped.

Every token's router picks ``top_k`` of ``num_experts`` expert MLPs and sums their outputs
weighted by its routing probabilities: softmax over all experts, the top k kept, and (Mixtral
always, Qwen3-MoE when ``norm_topk_prob``) renormalised to sum to 1, as transformers does.

The experts are computed grouped by expert, never token by token: the step's (token, slot)
pairs are sorted by expert, each expert the step touched multiplies all of its tokens in one
matmul pair, and the weighted results are added back into their tokens' rows with
``index_add_``. A step costs one gate-up and one down matmul per touched expert, whatever its
token count, and reads only those experts' weights: ``experts_touched`` records how many, for
the step's byte count (``engine/cost.py``)::

    pairs (token, expert):  (0,2) (0,0) (1,2) (1,3) (2,0) (2,2)
    sorted by expert:       (0,0) (2,0) | (0,2) (1,2) (2,2) | (1,3)
                             expert 0      expert 2            expert 3   (1 untouched)

Experts are added in ascending expert order, the order transformers adds them in.
NOTE: the per-expert split reads the step's expert counts on the host (one sync), so a MoE
model's steps are not captured in CUDA graphs (the builder runs it eagerly).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig


class SparseMoe(nn.Module):
    def __init__(self, config: ModelConfig, act: nn.Module) -> None:
        super().__init__()
        h, i, e = config.hidden_size, config.moe_intermediate_size, config.num_experts
        self.num_experts = e
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        # Input-major like engine/llama.py's Linear: x @ weight.
        self.router = nn.Parameter(torch.empty(h, e))
        self.gate_up = nn.Parameter(torch.empty(e, h, 2 * i))  # per expert [gate | up]
        self.down = nn.Parameter(torch.empty(e, i, h))
        self.act = act  # gate_up [t, 2 * i] -> [t, i]
        self.experts_touched = 0  # distinct experts the last forward ran

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        t = x.shape[0]
        probs = torch.softmax(x @ self.router, dim=-1, dtype=torch.float32)  # [t, experts]
        weights, experts = probs.topk(self.top_k, dim=-1)  # [t, top_k] each
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype).flatten()  # [t * top_k], pair p = token p // top_k
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert, ascending
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # the one sync
        out = torch.zeros_like(x)
        start = 0
        touched = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            pairs = order[start : start + n]
            start += n
            touched += 1
            tokens = pairs // self.top_k
            y = self.act(x[tokens] @ self.gate_up[e]) @ self.down[e]  # [n, hidden]
            out.index_add_(0, tokens, y * weights[pairs, None])
        self.experts_touched = touched
        assert start == t * self.top_k
        return out


def expert_sources(
    config: ModelConfig, layer_prefix: str
) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """The checkpoint names of one layer's router, gate-up (expert by expert, gate then up)
    and down weights, in Mixtral's or Qwen3-MoE's spelling."""
    e = config.num_experts
    if config.model_type == "mixtral":
        moe = layer_prefix + "block_sparse_moe."
        gate, up, down = "w1", "w3", "w2"
    else:
        moe = layer_prefix + "mlp."
        gate, up, down = "gate_proj", "up_proj", "down_proj"
    gate_up = tuple(f"{moe}experts.{j}.{name}.weight" for j in range(e) for name in (gate, up))
    downs = tuple(f"{moe}experts.{j}.{down}.weight" for j in range(e))
    return (moe + "gate.weight",), gate_up, downs


def split_fused_experts(
    state: dict[str, torch.Tensor], config: ModelConfig
) -> dict[str, torch.Tensor]:
    """``state`` with transformers' in-memory expert layout, one tensor per layer
    (``mlp.experts.gate_up_proj`` ``[experts, 2 * width, hidden]``, gate rows first, and
    ``mlp.experts.down_proj`` ``[experts, hidden, width]``), split into the per-expert tensors
    ``expert_sources`` names. That layout is what transformers saves a model in when no
    checkpoint conversion maps it back, as after reading a GGUF file (engine/loader.py)."""
    fused = [k for k in state if k.endswith("mlp.experts.gate_up_proj")]
    if not fused:
        return state
    state = dict(state)
    for key in fused:
        layer_prefix = key.removesuffix("mlp.experts.gate_up_proj")
        _, gate_up_names, down_names = expert_sources(config, layer_prefix)
        gate_up = state.pop(key)  # [experts, 2 * width, hidden]
        down = state.pop(layer_prefix + "mlp.experts.down_proj")  # [experts, hidden, width]
        width = gate_up.shape[1] // 2
        for j in range(gate_up.shape[0]):
            state[gate_up_names[2 * j]] = gate_up[j, :width]
            state[gate_up_names[2 * j + 1]] = gate_up[j, width:]
            state[down_names[j]] = down[j]
    return state


def stack_experts(parts: list[torch.Tensor], num_experts: int) -> torch.Tensor:
    """Per-expert ``[out, in]`` checkpoint tensors (an expert's in a row) -> ``[experts, in,
    out]``, the input-major layout ``SparseMoe`` multiplies by."""
    stacked = torch.cat(parts)  # [experts * out, in]
    return stacked.view(num_experts, -1, stacked.shape[-1]).transpose(1, 2)


__all__ = ["SparseMoe", "expert_sources", "split_fused_experts", "stack_experts"]
