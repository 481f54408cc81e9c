"""Process groups and collectives: NCCL on GPUs, gloo on CPU.

Ranks are processes; the engine spawns ranks 1..N-1 itself or they come from torchrun (the
RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR variables), so the same code runs on one node or many.
With data parallelism the N = D x TP ranks form D replicas of TP consecutive ranks: each replica
has its own tensor-parallel group (the collectives below run in it), and the replicas' first ranks
(their leaders) share a gloo group over which rank 0 hands out prompts and collects outputs.
"""
import os
import signal
import socket
import threading
from contextlib import contextmanager

import torch
import torch.distributed as dist


_tp_group = None  # this rank's tensor-parallel group; None: every rank (no data parallelism)
_control_group = None  # gloo group over the same ranks, for host objects (each step's inputs)
_leader = 0  # global rank of this replica's tensor-parallel rank 0
_dp_group = None  # gloo group of the replica leaders (set on leaders only, with data parallelism)


def tp_rank() -> int:
    return dist.get_rank(_tp_group) if dist.is_initialized() else 0


def tp_size() -> int:
    return dist.get_world_size(_tp_group) if dist.is_initialized() else 1


def dp_group():
    """The replica leaders' gloo group (None without data parallelism, or on a non-leader rank)."""
    return _dp_group


def free_port() -> int:
    """A free TCP port on the loopback interface, for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(rank: int, world_size: int, device: str, init_method: str | None = None,
                     tp: int | None = None) -> torch.device:
    """Join the process group of world_size ranks, in replicas of `tp` ranks (default: one replica);
    nothing to do for one rank. Returns this rank's device."""
    if device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"
    if dist.is_initialized() and dist.get_world_size() != world_size:
        raise RuntimeError(f"a process group of {dist.get_world_size()} ranks is still open: close() the "
                           f"parallel LLM before making one of {world_size} ranks")
    if world_size > 1 and not dist.is_initialized():
        global _tp_group, _control_group, _leader, _dp_group
        tp = tp or world_size
        backend = "gloo" if device == "cpu" else "nccl"
        dist.init_process_group(backend, init_method=init_method or "env://", rank=rank, world_size=world_size)
        _leader = rank - rank % tp
        if tp < world_size:
            # Every rank creates every group, in the same order (torch.distributed's rule).
            for first in range(0, world_size, tp):
                ranks = list(range(first, first + tp))
                group, control = dist.new_group(ranks), dist.new_group(ranks, backend="gloo")
                if first == _leader:
                    _tp_group, _control_group = group, control
            leaders = dist.new_group(list(range(0, world_size, tp)), backend="gloo")
            _dp_group = leaders if rank == _leader else None
        else:
            # Objects broadcast over NCCL go through GPU tensors and a stream sync: rank 0 would wait
            # for the running step, and forever if a peer died. Over gloo they stay on the host.
            _control_group = dist.new_group(backend="gloo") if backend == "nccl" else dist.group.WORLD
    return torch.device(device)


@contextmanager
def interrupt_after():
    """Hold Ctrl-C (SIGINT, in the main thread) until the block ends, then raise KeyboardInterrupt:
    a rank that left a step midway would leave its peers waiting in a collective forever."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda *_: caught.append(1))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt


def broadcast_object(obj=None):
    """The replica leader's `obj` on every rank of its tensor-parallel group, sent over the host
    (gloo); a dead peer makes it raise."""
    message = [obj]
    dist.broadcast_object_list(message, src=_leader, group=_control_group)
    return message[0]


def hand_out(items: list | None = None):
    """Rank 0: send items[r] to replica leader r (item 0 stays here); every leader returns its item."""
    box = [None]
    dist.scatter_object_list(box, items, src=0, group=_dp_group)
    return box[0]


def collect(item) -> list | None:
    """Every replica leader's item, in replica order, on rank 0 (None on the other leaders)."""
    items = [None] * dist.get_world_size(_dp_group) if dist.get_rank() == 0 else None
    dist.gather_object(item, items, dst=0, group=_dp_group)
    return items


def release_replicas() -> None:
    """Rank 0: tell the other replica leaders to leave (they are waiting in hand_out)."""
    hand_out([None] * dist.get_world_size(_dp_group))


def broadcast(x: torch.Tensor) -> torch.Tensor:
    """The replica leader's x on every rank of its tensor-parallel group, in place."""
    dist.broadcast(x, src=_leader, group=_tp_group)
    return x


def close_distributed(peers_alive: bool = True) -> None:
    """Leave the process groups. Collectives with a dead peer never finish on NCCL and destroying the
    group would wait on them, so then the groups are aborted (a private torch API, NCCL only)."""
    global _tp_group, _control_group, _leader, _dp_group
    if not dist.is_initialized():
        return
    if not peers_alive and dist.get_backend() == "nccl":
        dist.distributed_c10d._abort_process_group()
    else:
        dist.destroy_process_group()
    _tp_group = _control_group = _dp_group = None
    _leader = 0


def all_reduce(x: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """Reduce x (a sum by default) over the tensor-parallel ranks in place (a no-op on one rank)."""
    if tp_size() > 1:
        dist.all_reduce(x, op=op, group=_tp_group)
    return x


def gather_last_dim(x: torch.Tensor) -> torch.Tensor | None:
    """Concatenate every tensor-parallel rank's x along the last dim on the replica leader; other
    ranks get None."""
    if tp_size() == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp_size())] if tp_rank() == 0 else None
    dist.gather(x, parts, dst=_leader, group=_tp_group)
    return torch.cat(parts, dim=-1) if parts is not None else None
