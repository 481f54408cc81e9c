import torch
from torch import nn

from tritonllm.layers.ops import ops


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops().silu_and_mul(x)
