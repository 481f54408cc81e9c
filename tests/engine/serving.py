"""The module-wide engine of the failure-path tests (test_engine.py, test_interrupts.py) and the
checks that it still serves: the next request is right and no block leaked."""
import sys

import pytest
from tiny_qwen3 import hf_greedy

from tritonllm import LLM, SamplingParams
from tritonllm.engine.engine import LLMEngine

NUM_BLOCKS = 32
OPTIONS = {"max_num_seqs": 4, "num_kv_blocks": NUM_BLOCKS, "max_num_batched_tokens": 24}  # 24: prompts go in chunks
PROMPTS = [[5, 6, 7], list(range(40, 75)), [9] * 20, list(range(100, 117))]  # 3, 35, 20, 17 tokens
PARAMS = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def expected(tiny_qwen3):
    return [hf_greedy(tiny_qwen3, p, PARAMS.max_tokens) for p in PROMPTS]


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    with LLM(str(tiny_qwen3), **OPTIONS) as engine:
        yield engine


def resolving() -> bool:
    """Whether the caller runs inside LLMEngine._resolve (a step's tokens brought in). A prefill's
    blocks are registered at its launch too, so a failure meant for _resolve checks where it is."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not LLMEngine._resolve.__code__:
        frame = frame.f_back
    return frame is not None


def assert_clean(llm):
    assert not llm.has_unfinished() and llm.scheduler.is_finished()
    assert llm.block_manager.num_free_blocks == NUM_BLOCKS
    assert all(block.ref_count == 0 for block in llm.block_manager.blocks)


def assert_serving(llm, expected):
    """The next generate returns what HF does, and nothing leaked."""
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)] == expected
    assert_clean(llm)


def run_to_end_outputs(llm) -> list:
    """Step until the engine has nothing to do or report; every output, each final one with its output."""
    outputs = []
    while llm.has_unfinished():
        outputs += llm.step()
    assert all(out.finished == (out.output is not None) for out in outputs)
    return outputs


def run_to_end(llm) -> dict[int, list[int]]:
    tokens = {}
    for out in run_to_end_outputs(llm):
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens
