import torch
from torch import nn


def cos_sin_cache(head_dim: int, max_position: int, base: float) -> torch.Tensor:
    """[max_position, head_dim] float32: cos in the first half, sin in the second, as HF computes them."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


class RotaryEmbedding(nn.Module):
    """Holds the cos/sin table, shared by the layers (the rotation runs in the fused q/k prologue)."""

    def __init__(self, head_dim: int, max_position: int, base: float):
        super().__init__()
        self.register_buffer("cos_sin_cache", cos_sin_cache(head_dim, max_position, base), persistent=False)
