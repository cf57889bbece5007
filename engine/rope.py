"""Rotary position embeddings, with the config's theta and scaling.

The cos/sin tables are precomputed for every position once; each step gathers the rows of
its positions. The per-element arithmetic is the one ``transformers`` does (float32
``inv_freq * position``, then cos/sin), so the values are bit-identical to its on-the-fly
computation.
"""

from __future__ import annotations

import math

import torch

from engine.config import ModelConfig, RopeScaling


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
    return inv_freq


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
        inv_freq = inverse_frequencies(config, sliding=sliding).to(device)
        positions = torch.arange(max_positions, device=device, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        self.cos = emb.cos()
        self.sin = emb.sin()

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
