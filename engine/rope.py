"""Rotary position embeddings, with the config's theta and scaling.

The cos/sin tables are precomputed for every position once; each step gathers the rows of
its positions. The per-element arithmetic is the one ``transformers`` does (float32
``inv_freq * position``, then cos/sin), so the values are bit-identical to its on-the-fly
computation.
"""

from __future__ import annotations

import math

import torch

from engine.config import (
    LENGTH_DEPENDENT_ROPE_TYPES,
    ModelConfig,
    RopeScaling,
    UnsupportedModelError,
)


def inverse_frequencies(
    config: ModelConfig, *, sliding: bool = False
) -> torch.Tensor:  # [head_dim // 2]
    """The config's frequencies; with ``sliding``, the sliding layers' own (Gemma 3: their
    own base, no scaling)."""
    dim = config.head_dim
    theta, scaling = config.rope_theta, config.rope_scaling
    if sliding:
        assert config.sliding_rope_theta is not None
        theta, scaling = config.sliding_rope_theta, RopeScaling()
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if scaling.rope_type == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.rope_type == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the band
        # between is interpolated smoothly.
        old_len = scaling.original_max_position_embeddings
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    elif scaling.rope_type == "yarn":
        inv_freq = _yarn(inv_freq, dim, theta, scaling)
    elif scaling.rope_type == "longrope":
        # The short factors: positions within original_max_position_embeddings (the
        # builder refuses a longer context, see check_rope_length).
        factors = torch.tensor(scaling.short_factor, dtype=torch.float32)
        assert factors.shape == inv_freq.shape, "longrope short_factor: one per frequency"
        shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        inv_freq = 1.0 / (factors * theta**shape)
    return inv_freq


def _yarn(inv_freq: torch.Tensor, dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than ``beta_slow`` times over the original context
    are interpolated by ``factor``, those turning more than ``beta_fast`` times kept, with a
    linear ramp between (transformers' ``_compute_yarn_parameters``)."""

    def correction_dim(rotations: float) -> float:
        old = scaling.original_max_position_embeddings
        return (dim * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singularity
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    interpolation = 1.0 / (scaling.factor * (1.0 / inv_freq))  # 1 / (factor * theta^(i/d))
    return interpolation * (1 - extrapolation) + inv_freq * extrapolation


def attention_factor(config: ModelConfig) -> float:
    """What yarn and longrope multiply cos and sin by (1 for the other variants)."""
    scaling = config.rope_scaling
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    factor = scaling.factor
    if scaling.rope_type == "yarn":

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if scaling.mscale and scaling.mscale_all_dim:
            return mscale(factor, scaling.mscale) / mscale(factor, scaling.mscale_all_dim)
        return mscale(factor)
    if scaling.rope_type == "longrope" and factor > 1.0:
        old = scaling.original_max_position_embeddings
        return math.sqrt(1 + math.log(factor) / math.log(old))
    return 1.0


def check_rope_length(config: ModelConfig, max_positions: int) -> None:
    """Refuse a context where transformers would switch a length-dependent RoPE (longrope's
    long factors, dynamic NTK) by the batch's longest sequence: the paged cache holds keys
    rotated once, so no per-batch switch can be reproduced, and serving it otherwise would
    be silently wrong."""
    scaling = config.rope_scaling
    old = scaling.original_max_position_embeddings
    if scaling.rope_type in LENGTH_DEPENDENT_ROPE_TYPES and max_positions > old:
        raise UnsupportedModelError(
            f"rope scaling {scaling.rope_type!r} beyond original_max_position_embeddings "
            f"({old}) is not supported (transformers switches its frequencies by the batch's "
            f"longest sequence): pass --max-model-len {old} or less"
        )


class RotaryEmbedding:
    """Precomputed cos/sin tables; plain tensors, not module buffers, so building the model
    on the meta device and materialising it never touches them."""

    def __init__(
        self,
        config: ModelConfig,
        max_positions: int,
        device: torch.device,
        *,
        sliding: bool = False,
    ) -> None:
        check_rope_length(config, max_positions)
        inv_freq = inverse_frequencies(config, sliding=sliding).to(device)
        positions = torch.arange(max_positions, device=device, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        scale = 1.0 if sliding else attention_factor(config)
        self.cos = emb.cos() if scale == 1.0 else emb.cos() * scale
        self.sin = emb.sin() if scale == 1.0 else emb.sin() * scale

    def lookup(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin rows of a step's positions, [num_tokens, 1, head_dim] each; looked up
        once per step and shared by every layer."""
        cos = self.cos[positions].unsqueeze(1).to(dtype)
        sin = self.sin[positions].unsqueeze(1).to(dtype)
        return cos, sin


def apply_rope(
    x: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, 1, head_dim]
    sin: torch.Tensor,
) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
