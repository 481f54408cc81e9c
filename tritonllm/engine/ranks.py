"""The processes of a tensor- or data-parallel engine: rank 0 starts ranks 1..N-1, checks they live,
and stops them.

Of D replicas of TP ranks each, rank r is a replica leader when r % TP == 0: it runs the engine
class itself (an LLM, which serves rank 0's share of the prompts); every other rank runs a model
runner's worker loop for its leader. Ranks started by torchrun instead never come through here.
"""
import os
import signal

import torch
import torch.multiprocessing as mp

from tritonllm.config import EngineConfig
from tritonllm.distributed import close_distributed, free_port, release_replicas
from tritonllm.engine.model_runner import ModelRunner


def _run(errors, rank: int, target, *args) -> None:
    """A rank's process: target(*args), whose error goes to rank 0 through `errors` before the
    process ends (a notebook shows rank 0's exception, not the other ranks' stderr)."""
    try:
        target(*args)
    except Exception as error:
        errors.put((rank, f"{type(error).__name__}: {error}"[:2000]))  # a pipe holds 64 KB unread
        raise


def _worker(config: EngineConfig, hf_config, rank: int, init_method: str, started) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in a terminal reaches every rank: rank 0 handles it
    started.set()
    ModelRunner(config, hf_config, rank, init_method).worker_loop()


def _replica(engine_class, model: str, options: dict, rank: int, world_size: int, port: int, started,
             share_stop) -> None:
    """The leader of data-parallel replica rank // TP: joins the group as torchrun would start it,
    then runs engine_class(model, **options), which serves rank 0 (tritonllm/llm.py); share_stop (a
    shared byte) is 1 while rank 0 has left a generate, whose share this replica then drops."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    started.set()
    engine_class(model, share_stop=share_stop, **options)


def start_runner(engine_class, model: str, options: dict, config: EngineConfig, hf_config, share_stop):
    """This process's model runner. Rank 0 of a parallel engine started here (not by torchrun) first
    spawns the other ranks (start_ranks), and kills them if its own runner fails: they would wait for
    it forever. Returns the runner, the spawned processes, their error queue (None without any) and
    the replicas' shared stop byte (share_stop as given where nothing was spawned)."""
    world_size = config.tensor_parallel_size * config.data_parallel_size
    spawns = world_size > 1 and "RANK" not in os.environ
    if spawns and torch.distributed.is_initialized():
        raise RuntimeError("a process group is open in this process (another tensor- or data-parallel LLM): "
                           "close() it before making this one")
    processes, errors, init_method = [], None, None
    try:
        if spawns:
            port = free_port()
            init_method = f"tcp://127.0.0.1:{port}"
            share_stop, errors = start_ranks(processes, engine_class, model, options, config, hf_config,
                                             init_method, port)
        runner = ModelRunner(config, hf_config, int(os.environ.get("RANK", 0)), init_method)
    except BaseException:
        for process in processes:
            process.kill()
        if processes:  # the group made for them: a later engine makes its own
            close_distributed(peers_alive=False)
        raise
    return runner, processes, errors, share_stop


def start_ranks(processes: list, engine_class, model: str, options: dict, config: EngineConfig, hf_config,
                init_method: str, port: int):
    """Spawn ranks 1..N-1, appending each process to `processes` as it starts (the caller kills
    them if anything fails), and wait until each runs. A rank that dies while starting (as when the
    script lacks its main guard and the spawned rank re-runs it) is an error, not a hang. Returns
    the shared byte that tells the other replicas to drop their shares of a generate (None without any)
    and the queue of the ranks' errors (check_ranks reads it)."""
    context = mp.get_context("spawn")
    tp = config.tensor_parallel_size
    world_size = tp * config.data_parallel_size
    started = [context.Event() for _ in range(1, world_size)]
    # A lock-free shared byte, not an Event: a second Ctrl-C inside Event.set() can leave its lock held forever.
    share_stop = context.RawValue("b", 0) if config.data_parallel_size > 1 else None
    errors = context.SimpleQueue()
    for rank, event in enumerate(started, start=1):
        if rank % tp:
            target, args = _worker, (config, hf_config, rank, init_method, event)
        else:
            target, args = _replica, (engine_class, model, options, rank, world_size, port, event, share_stop)
        process = context.Process(target=_run, args=(errors, rank, target, *args), daemon=True)
        process.start()
        processes.append(process)
    for rank, (event, process) in enumerate(zip(started, processes), start=1):
        while not event.wait(0.05):
            if not process.is_alive():
                raise RuntimeError(
                    f"parallel worker rank {rank} exited while starting (exit code {process.exitcode}). "
                    "Workers are spawned and import the main module again: a script that makes a "
                    "tensor- or data-parallel LLM must do so under `if __name__ == \"__main__\":`.")
    return share_stop, errors


def check_ranks(processes: list, errors, wait: float = 0.0) -> None:
    """Raise if a rank has exited (within `wait` seconds each), naming it and the error it sent
    (start_ranks' queue, or None): a collective with a dead rank would wait forever."""
    for process in processes if wait else ():
        process.join(wait)
    dead = [(rank, p.exitcode) for rank, p in enumerate(processes, start=1) if not p.is_alive()]
    if dead:
        said = {}
        while errors is not None and not errors.empty():
            rank, text = errors.get()
            said[rank] = f": {text}"
        raise RuntimeError("parallel rank(s) exited: " + ", ".join(f"rank {r} (exit code {c}){said.get(r, '')}"
                                                                  for r, c in dead))


def shut_down(runner: ModelRunner, processes: list, replicas: bool) -> None:
    """Stop the data-parallel replicas and the workers (killed if they do not exit within 30 s),
    then leave the process group."""
    alive = all(p.is_alive() for p in processes)
    if replicas and alive:
        try:
            release_replicas()
        except RuntimeError:  # a replica died since
            alive = False
    runner.shutdown(peers_alive=alive)
    for process in processes:
        if alive:  # told to exit; where a rank died the others cannot be told
            process.join(timeout=30)
        if process.is_alive():
            process.kill()
            process.join()


def abandon(runner: ModelRunner, processes: list) -> None:
    """Kill the other ranks and leave the process group without a word to them: they wait in a
    collective that rank 0 left (runner.stranded), which nothing can finish."""
    for process in processes:
        process.kill()
        process.join()
    runner.shutdown(peers_alive=False)
