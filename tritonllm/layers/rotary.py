"""Rotary position embedding: the cos/sin table from the config's rope parameters, as HF transformers computes it."""
import math

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "yarn")


def rope_parameters(config) -> dict:
    """The config's rope parameters with rope_type, rope_theta and YaRN's two lengths filled in.

    transformers 5 keeps them all in config.rope_parameters; older versions keep config.rope_theta
    beside config.rope_scaling (None for plain RoPE, the type under "type" or "rope_type").
    """
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    if params["rope_type"] not in SUPPORTED_ROPE_TYPES:
        field = "rope_parameters" if getattr(config, "rope_parameters", None) else "rope_scaling"
        raise ValueError(f"{field} rope_type {params['rope_type']!r} is not supported: "
                         f"only {' and '.join(map(repr, SUPPORTED_ROPE_TYPES))}")
    if params.get("rope_theta") is None:
        params["rope_theta"] = config.rope_theta
    if params["rope_type"] == "yarn":
        original = params.get("original_max_position_embeddings") or config.max_position_embeddings
        params["original_max_position_embeddings"] = original
        # No factor: the ratio of the two lengths, as transformers takes it.
        params["factor"] = params.get("factor") or config.max_position_embeddings / original
    return params


def max_positions(config) -> int:
    """Positions the table covers: YaRN stretches the original context by its factor (Qwen3: 4 x 32,768)."""
    params = rope_parameters(config)
    if params["rope_type"] == "yarn":
        return max(config.max_position_embeddings, int(params["factor"] * params["original_max_position_embeddings"]))
    return config.max_position_embeddings


def yarn_scale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_frequencies(head_dim: int, base: float, yarn: dict) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071): the inverse frequencies and the attention factor cos and sin are scaled by.

    Dimensions that turn more than beta_fast times over the original context keep their frequency,
    those that turn fewer than beta_slow times are interpolated (divided by factor), a linear ramp between.
    """
    factor, original = yarn["factor"], yarn["original_max_position_embeddings"]
    attention_factor = yarn.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = yarn.get("mscale"), yarn.get("mscale_all_dim")
        attention_factor = (yarn_scale(factor, mscale) / yarn_scale(factor, mscale_all_dim) if mscale and mscale_all_dim
                            else yarn_scale(factor))

    def dimension(rotations):  # the dimension that turns `rotations` times over the original context
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dimension(yarn.get("beta_fast") or 32), dimension(yarn.get("beta_slow") or 1)
    if yarn.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a step rather than a division by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    theta_powers = base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    keep = 1 - ramp  # in transformers' order of operations, so that the table is bitwise the same
    return 1.0 / (factor * theta_powers) * (1 - keep) + 1.0 / theta_powers * keep, float(attention_factor)


def cos_sin_cache(head_dim: int, max_position: int, base: float, yarn: dict | None = None) -> torch.Tensor:
    """[max_position, head_dim] float32: cos in the first half, sin in the second, as HF computes them.

    With yarn (factor, original_max_position_embeddings and the optional keys of rope_parameters) both
    halves carry YaRN's attention factor, which so scales q and k and the attention logits by its square.
    """
    if yarn is None:
        inv_freq, scale = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim), 1.0
    else:
        inv_freq, scale = yarn_frequencies(head_dim, base, yarn)
    freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos() * scale, freqs.sin() * scale], dim=-1)


class RotaryEmbedding(nn.Module):
    """Holds the cos/sin table, shared by the layers (the rotation runs in the fused q/k prologue)."""

    def __init__(self, config, head_dim: int):
        super().__init__()
        params = rope_parameters(config)
        yarn = params if params["rope_type"] == "yarn" else None
        table = cos_sin_cache(head_dim, max_positions(config), float(params["rope_theta"]), yarn)
        self.register_buffer("cos_sin_cache", table, persistent=False)
