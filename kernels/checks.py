"""Argument checks that several public wrappers share.

A kernel checks no bounds, so an index tensor of floats, a per-row tensor shorter than the batch or
a strided one would make it read the wrong memory (on a GPU an illegal address that ends the
process's CUDA context). The wrappers refuse such arguments before any launch; each error names
the argument and what it must be. Shapes and dtypes only: nothing here reads GPU memory.
"""
import torch

from tritonllm.kernels.tuning import dtype_name

FLOATS = (torch.float32, torch.float16, torch.bfloat16)  # activations and logits
ROW_FLOATS = FLOATS + (torch.float64,)  # per-row parameters (temperature, penalties, ...)
INDICES = (torch.int32, torch.int64)


def check_dtype(name: str, tensor: torch.Tensor, dtypes) -> None:
    """TypeError naming `name` unless `tensor`'s dtype is one of `dtypes`."""
    if tensor.dtype not in dtypes:
        raise TypeError(f"{name} must be {'/'.join(map(dtype_name, dtypes))}, got {tensor.dtype}")


def check_writable(name: str, tensor: torch.Tensor | None) -> None:
    """ValueError naming `name` if elements of `tensor`, which a kernel writes, share memory (stride 0 in a
    dimension of size > 1, as after expand): each would keep only one of the values written to them. None
    (an optional output not given) passes."""
    if tensor is not None and any(stride == 0 and size > 1 for size, stride in zip(tensor.shape, tensor.stride())):
        raise ValueError(f"{name} is written, so its elements must not share memory: got shape {tuple(tensor.shape)} "
                         f"strides {tensor.stride()}")


def check_rows(length: int, dtypes, **tensors: torch.Tensor) -> None:
    """Each keyword tensor must be [length] with stride 1 (a kernel reads element b for row b) of one of dtypes."""
    for name, tensor in tensors.items():
        if tensor.dim() != 1 or tensor.shape[0] != length or (length > 1 and tensor.stride(0) != 1):
            raise ValueError(f"{name} must be a contiguous [{length}] tensor, got shape {tuple(tensor.shape)} "
                             f"strides {tensor.stride()}")
        check_dtype(name, tensor, dtypes)


def check_block_size(block_size: int) -> None:
    """A cache's block_size (k_cache.shape[1]) must be a power of two: tiles and copies divide it."""
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"k_cache block_size must be a power of two, got {block_size}")


def check_logits(logits: torch.Tensor) -> tuple[int, int]:
    """logits must be [B, V] float32/float16/bfloat16; returns (B, V)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
    check_dtype("logits", logits, FLOATS)
    if logits.shape[1] < 1:
        raise ValueError("logits must have a vocabulary of V >= 1 columns, got V = 0")
    return logits.shape
