"""Data-parallel replicas, LLM(data_parallel_size=D): greedy outputs equal HF's, in input order, with
the replicas spawned by the engine or started by torchrun; under gloo on CPU."""
import json
import subprocess
import sys
import threading

import pytest
import torch
from parallel import ranks, running
from tiny_qwen3 import hf_greedy, hf_prompt_ids

from tritonllm import LLM, SamplingParams
from tritonllm.distributed import free_port

PROMPTS = ["hello world", "12 + 34 = 46, 100 + 7 =", [5], list(range(40, 80)), [7, 8, 9]]  # uneven shares
SMALL = {"max_num_seqs": 8, "num_kv_blocks": 64}


@pytest.fixture(scope="module")
def expected(tiny_qwen3):
    """Per-prompt greedy lengths 3..7, so an output in another prompt's place shows; HF's tokens."""
    params = [SamplingParams(temperature=0, max_tokens=3 + i, ignore_eos=True) for i in range(len(PROMPTS))]
    return params, [hf_greedy(tiny_qwen3, ids, p.max_tokens) for ids, p in zip(hf_prompt_ids(tiny_qwen3, PROMPTS), params)]


@ranks(2)
def test_two_replicas_equal_hf_in_input_order(tiny_qwen3, expected):
    params, tokens = expected
    with LLM(str(tiny_qwen3), **SMALL, data_parallel_size=2) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == tokens
        # n samples of a prompt stay together: greedy samples are the greedy tokens.
        n2 = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, n=2)
        outputs = llm.generate(PROMPTS[:3], n2, use_tqdm=False)
        assert [o.token_ids for o in outputs] == [t[:3] for t in tokens[:3] for _ in range(2)]
        # A bad prompt in replica 1's share is an error before any replica starts; both keep serving.
        with pytest.raises(ValueError, match="empty"):
            llm.generate(["hello world", ""], use_tqdm=False)
        assert [o.token_ids for o in llm.generate(PROMPTS[3:], params[3:], use_tqdm=False)] == tokens[3:]
        # Two threads at once: each deal and its gather stay paired (they interleaved and hung).
        results = [None, None]

        def work(k):
            results[k] = [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]

        threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert results == [tokens, tokens]
        workers = llm._workers
    assert len(workers) == 1 and not any(running(p.pid) for p in workers)
    assert not torch.distributed.is_initialized()


@ranks(4)
def test_two_replicas_of_two_tensor_parallel_ranks(tiny_qwen3, expected):
    params, tokens = expected
    with LLM(str(tiny_qwen3), **SMALL, data_parallel_size=2, tensor_parallel_size=2) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == tokens
        workers = llm._workers
    assert len(workers) == 3 and not any(running(p.pid) for p in workers)


UNDER_TORCHRUN = """
import json, os, sys
from tritonllm import LLM, SamplingParams
llm = LLM(sys.argv[1], max_num_seqs=8, num_kv_blocks=64, data_parallel_size=2)
if os.environ["RANK"] == "0":  # the other replica served rank 0 inside LLM(...) until it closed
    params = [SamplingParams(temperature=0, max_tokens=3 + i, ignore_eos=True) for i in range(5)]
    prompts = json.loads(sys.argv[2])
    print(json.dumps([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]))
    llm.close()
"""


@ranks(2)
def test_the_same_code_under_torchrun(tiny_qwen3, expected, tmp_path):
    script = tmp_path / "dp.py"
    script.write_text(UNDER_TORCHRUN)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           str(free_port()), str(script), str(tiny_qwen3), json.dumps(PROMPTS)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == expected[1]


def test_bad_data_parallel_size_is_an_error(tiny_qwen3):
    with pytest.raises(ValueError, match="data_parallel_size"):
        LLM(str(tiny_qwen3), **SMALL, data_parallel_size=0)
