"""Tensor-parallel process group and collectives: NCCL on GPUs, gloo on CPU.

Ranks are processes; the engine spawns ranks 1..N-1 itself or they come from torchrun (the
RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR variables), so the same code runs on one node or many.
"""
import os
import socket

import torch
import torch.distributed as dist


_control_group = None  # gloo group over the same ranks, for host objects (each step's inputs)


def tp_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def tp_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def free_port() -> int:
    """A free TCP port on the loopback interface, for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(rank: int, world_size: int, device: str, init_method: str | None = None) -> torch.device:
    """Join the tensor-parallel group (nothing to do for one rank); returns this rank's device."""
    if device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"
    if dist.is_initialized() and dist.get_world_size() != world_size:
        raise RuntimeError(f"a process group of {dist.get_world_size()} ranks is still open: close() the "
                           f"tensor-parallel LLM before making one with tensor_parallel_size={world_size}")
    if world_size > 1 and not dist.is_initialized():
        global _control_group
        backend = "gloo" if device == "cpu" else "nccl"
        dist.init_process_group(backend, init_method=init_method or "env://", rank=rank, world_size=world_size)
        # Objects broadcast over NCCL go through GPU tensors and a stream sync: rank 0 would wait for
        # the running step, and forever if a peer died. Over gloo they stay on the host.
        _control_group = dist.new_group(backend="gloo") if backend == "nccl" else dist.group.WORLD
    return torch.device(device)


def broadcast_object(obj=None):
    """Rank 0's `obj` on every rank, sent over the host (gloo); a dead peer makes it raise."""
    message = [obj]
    dist.broadcast_object_list(message, src=0, group=_control_group)
    return message[0]


def close_distributed(peers_alive: bool = True) -> None:
    """Leave the process groups. Collectives with a dead peer never finish on NCCL and destroying the
    group would wait on them, so then the groups are aborted (a private torch API, NCCL only)."""
    global _control_group
    if not dist.is_initialized():
        return
    if not peers_alive and dist.get_backend() == "nccl":
        dist.distributed_c10d._abort_process_group()
    else:
        dist.destroy_process_group()
    _control_group = None


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum x over the ranks in place (a no-op on one rank)."""
    if tp_size() > 1:
        dist.all_reduce(x)
    return x


def gather_last_dim(x: torch.Tensor) -> torch.Tensor | None:
    """Concatenate every rank's x along the last dim on rank 0; other ranks get None."""
    if tp_size() == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp_size())] if tp_rank() == 0 else None
    dist.gather(x, parts, dst=0)
    return torch.cat(parts, dim=-1) if parts is not None else None
