"""Tensor- and data-parallel engines when something goes wrong (under gloo on CPU): a step that fails
on rank 0 alone, Ctrl-C in the middle of a step or of a data-parallel generate, a replica that
cannot load, a second parallel LLM in one process; and unseeded samples across replicas."""
import os
import signal
import subprocess
import sys

import pytest
import torch
from parallel import ranks, running

from tritonllm import LLM, SamplingParams
from tritonllm.engine.engine import LLMEngine

SMALL = {"max_num_seqs": 8, "num_kv_blocks": 64}
PROMPTS = ["hello world", [5, 6, 7, 8], "12 + 34 ="]
GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


def tokens(llm, prompts=PROMPTS, params=GREEDY):
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def expected(tiny_qwen3):
    with LLM(str(tiny_qwen3), **SMALL) as llm:
        return tokens(llm)


@pytest.fixture
def ctrl_c():
    """Ctrl-C raising KeyboardInterrupt, as in a terminal: a job a script starts in the background
    has SIGINT ignored, and Python keeps it so."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@ranks(2)
def test_a_step_that_fails_on_rank_0_alone_ends_the_engine_not_in_a_hang(tiny_qwen3, expected):
    # Rank 0 raises after telling rank 1 to run the step: rank 1 waits in a collective that never
    # comes. The error reaches the caller, later calls say why the LLM cannot serve, rank 1 is gone.
    llm = LLM(str(tiny_qwen3), **SMALL, tensor_parallel_size=2)

    def out_of_memory(*args):
        raise RuntimeError("CUDA out of memory (injected)")

    llm.runner.execute = out_of_memory
    with pytest.raises(RuntimeError, match="injected"):
        tokens(llm)
    with pytest.raises(RuntimeError, match="can no longer serve"):
        tokens(llm)
    assert not any(running(p.pid) for p in llm._workers) and not torch.distributed.is_initialized()
    llm.close()
    with LLM(str(tiny_qwen3), **SMALL, tensor_parallel_size=2) as llm:
        assert tokens(llm) == expected


@ranks(2)
def test_ctrl_c_during_a_tensor_parallel_step_lands_after_it(tiny_qwen3, expected, ctrl_c):
    with LLM(str(tiny_qwen3), **SMALL, tensor_parallel_size=2) as llm:
        execute = llm.runner.execute

        def interrupted(*args):
            os.kill(os.getpid(), signal.SIGINT)  # as Jupyter's "interrupt kernel" does, mid-step
            return execute(*args)

        llm.runner.execute = interrupted
        with pytest.raises(KeyboardInterrupt):
            tokens(llm)
        llm.runner.execute = execute
        assert tokens(llm) == expected
        assert not llm.has_unfinished()


@ranks(2)
def test_a_second_parallel_llm_in_one_process_is_an_error(tiny_qwen3, expected):
    with LLM(str(tiny_qwen3), **SMALL, tensor_parallel_size=2) as llm:
        with pytest.raises(RuntimeError, match="process group is open"):
            LLM(str(tiny_qwen3), **SMALL, tensor_parallel_size=2)
        assert tokens(llm) == expected


def test_the_step_api_runs_one_replica(tiny_qwen3):
    # On the CPU, so that a one-GPU machine does not refuse the size before the class does.
    with pytest.raises(ValueError, match="data_parallel_size=2 needs tritonllm.LLM"):
        LLMEngine(str(tiny_qwen3), **SMALL, data_parallel_size=2, device="cpu")


@ranks(2)
def test_replicas_draw_unseeded_samples_of_their_own(tiny_qwen3):
    # Prompt i goes to replica i % 2: with one seed for both, prompts 0 and 1 drew the same tokens.
    with LLM(str(tiny_qwen3), **SMALL, data_parallel_size=2) as llm:
        drawn = tokens(llm, ["hello world"] * 4, SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True))
    assert drawn[0] != drawn[1] and drawn[2] != drawn[3]


@ranks(2)
def test_ctrl_c_in_a_data_parallel_generate_drops_every_share(tiny_qwen3, expected, ctrl_c):
    with LLM(str(tiny_qwen3), **SMALL, data_parallel_size=2) as llm:
        step, steps = llm._step_and_route, []

        def interrupted():
            steps.append(1)
            if len(steps) == 3:
                os.kill(os.getpid(), signal.SIGINT)
            step()

        llm._step_and_route = interrupted
        with pytest.raises(KeyboardInterrupt):
            tokens(llm, PROMPTS * 2, SamplingParams(temperature=0, max_tokens=500, ignore_eos=True))
        llm._step_and_route = step
        assert llm.share_stop.value == 0
        assert tokens(llm) == expected  # the replica dropped its share and serves the next deal


FAILS_TO_LOAD = """
import os, sys
import tritonllm.engine.model_runner as runner

load = runner.load_weights


def load_or_fail(model, path):  # module level: the spawned replica imports this file again
    if os.environ.get("RANK") == "1":
        raise ValueError("replica 1 cannot load (injected)")
    return load(model, path)


runner.load_weights = load_or_fail
from tritonllm import LLM

if __name__ == "__main__":
    try:
        LLM(sys.argv[1], max_num_seqs=8, num_kv_blocks=64, data_parallel_size=2)
    except RuntimeError as error:
        print("raised:", error)
"""


@ranks(2)
def test_a_replica_that_cannot_load_fails_llm_itself(tiny_qwen3, tmp_path):
    # It used to go unnoticed until the first generate, which failed with a bare gloo error.
    script = tmp_path / "fails_to_load.py"
    script.write_text(FAILS_TO_LOAD)
    done = subprocess.run([sys.executable, str(script), str(tiny_qwen3)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    # The rank's own error comes with it: a notebook shows rank 0's exception, not rank 1's stderr.
    assert "raised: parallel rank(s) exited: rank 1 (exit code 1): ValueError: replica 1 cannot load (injected)" \
        in done.stdout, done.stdout
