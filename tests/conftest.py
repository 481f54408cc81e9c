import tritonllm  # noqa: F401  (sets TRITON_INTERPRET before any kernel module is imported)

import random  # noqa: E402
import zlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from tiny_qwen3 import build_tiny_qwen3, build_tiny_qwen3_moe  # noqa: E402


@pytest.fixture(autouse=True)
def _seed(request):
    """Each test its own random inputs, the same on every run whatever ran before it: a failure
    found once is found again."""
    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    random.seed(seed)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    """Path of a tiny random float32 Qwen3 checkpoint with tied embeddings and a tokenizer."""
    return build_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="session")
def hf(tiny_qwen3):
    """HF transformers' float32 model of tiny_qwen3, the reference of the engine tests."""
    return AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32)


@pytest.fixture(scope="session")
def tiny_qwen3_untied(tmp_path_factory):
    """The same with untied embeddings (a separate lm_head.weight)."""
    return build_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3-untied"), tie_word_embeddings=False, seed=1)


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tmp_path_factory):
    """Path of a tiny random float32 Qwen3-MoE checkpoint (8 experts of width 48, top 2, renormalized,
    a dense layer between two sparse ones) with a tokenizer."""
    return build_tiny_qwen3_moe(tmp_path_factory.mktemp("tiny-qwen3-moe"))
