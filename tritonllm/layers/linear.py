"""Tensor-parallel linear layers. Weights are loaded straight into this rank's shard.

Each layer computes through its kernel backend's `linear` (ops: the Triton kernels or their
references, layers/ops.py), handing it the layer's own split counters (kernels/linear.py), which
the kernel leaves zeroed: a decode step's projections then take one launch each.

`loaded` in the weight loaders is a torch tensor or a safetensors slice (read lazily, so each
rank reads only its part of the checkpoint).
"""
from types import ModuleType

import torch
from torch import nn

from tritonllm.distributed import all_reduce, tp_rank, tp_size
from tritonllm.kernels.linear import linear_counts


def narrow(loaded, dim: int, start: int, size: int) -> torch.Tensor:
    """Rows or columns [start, start + size) of a tensor or safetensors slice, as a tensor."""
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, size)
    index = (slice(None),) * dim + (slice(start, start + size),)
    return loaded[index]


def full(loaded) -> torch.Tensor:
    return loaded if isinstance(loaded, torch.Tensor) else loaded[:]


def check_shape(loaded, shape) -> None:
    """A checkpoint tensor must have the whole (unsharded) shape its parameter takes: a loader that
    narrows or broadcasts a wrong one would load garbage without a word."""
    got = tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else tuple(loaded.get_shape())
    if got != tuple(shape):
        raise ValueError(f"its shape {got} is not the {tuple(shape)} the model takes")


def copy_weight(param: nn.Parameter, loaded) -> None:
    """The default loader: the whole tensor, replicated on every rank."""
    check_shape(loaded, param.shape)
    param.data.copy_(full(loaded))


class LinearBase(nn.Module):
    shard_ids = (None,)  # the checkpoint tensors a parameter is packed from (the loader checks all came)

    def __init__(self, input_size: int, output_size: int, bias: bool, ops: ModuleType):
        super().__init__()
        self.ops = ops
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.register_buffer("split_counts", linear_counts(output_size), persistent=False)
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
        for param in (self.weight, self.bias) if bias else (self.weight,):
            param.weight_loader, param.shard_ids = self.weight_loader, self.shard_ids

    def project(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.ops.linear(x, self.weight, bias, counts=self.split_counts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x, self.bias)


class ReplicatedLinear(LinearBase):
    """y = x W^T with the whole W on every rank (Qwen3-MoE's router)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, *, ops: ModuleType):
        super().__init__(input_size, output_size, bias, ops)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None):
        copy_weight(param, loaded)


class ColumnParallelLinear(LinearBase):
    """y = x W^T with W's output rows split over the ranks; y stays split."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, *, ops: ModuleType):
        if output_size % tp_size():
            raise ValueError(f"output size {output_size} is not divisible by tensor_parallel_size {tp_size()}")
        super().__init__(input_size, output_size // tp_size(), bias, ops)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None):
        size = param.shape[0]
        check_shape(loaded, (size * self.tp_size, *param.shape[1:]))
        param.data.copy_(narrow(loaded, 0, self.tp_rank * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one GEMM (gate and up): shard i sits after shards < i."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, *, ops: ModuleType):
        self.output_sizes = output_sizes
        self.shard_ids = tuple(range(len(output_sizes)))
        super().__init__(input_size, sum(output_sizes), bias, ops=ops)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: int):
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        check_shape(loaded, (self.output_sizes[shard_id], *param.shape[1:]))
        param.data.narrow(0, offset, size).copy_(narrow(loaded, 0, self.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """Packed q, k, v projections; each rank holds its query heads and its KV heads."""

    shard_ids = ("q", "k", "v")

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False, *,
                 ops: ModuleType):
        for name, heads in (("num_attention_heads", num_heads), ("num_key_value_heads", num_kv_heads)):
            if heads % tp_size():
                raise ValueError(f"{name}={heads} is not divisible by tensor_parallel_size {tp_size()}")
        self.head_dim = head_dim
        self.num_heads, self.num_kv_heads = num_heads // tp_size(), num_kv_heads // tp_size()
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias, ops=ops)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: str):
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[shard_id]
        check_shape(loaded, (size * self.tp_size, *param.shape[1:]))
        param.data.narrow(0, offset, size).copy_(narrow(loaded, 0, self.tp_rank * size, size))


class RowParallelLinear(LinearBase):
    """y = x W^T with W's input columns split over the ranks; partial sums all-reduced."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, *, ops: ModuleType):
        if input_size % tp_size():
            raise ValueError(f"input size {input_size} is not divisible by tensor_parallel_size {tp_size()}")
        super().__init__(input_size // tp_size(), output_size, bias, ops)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None):
        if param.dim() == 1:  # the bias is added once, on rank 0
            copy_weight(param, loaded)
            return
        size = param.shape[1]
        check_shape(loaded, (param.shape[0], size * self.tp_size))
        param.data.copy_(narrow(loaded, 1, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp_rank == 0 else None
        return all_reduce(self.project(x, bias))
