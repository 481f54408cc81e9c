"""tritonllm: an offline inference engine for Qwen3 whose hot paths are Triton kernels."""
import importlib
import importlib.metadata
import os
import sys

import torch

# Without a GPU the kernels run through Triton's interpreter. The variable is read when a kernel
# is decorated, so it must be set before any module of tritonllm.kernels is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Triton 3.9 warns in every process that leaves FMA contraction to its default (3.10 turns it off);
# the kernels' speed and test tolerances were measured with it on.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")


def _import_hub_kernels() -> None:
    """Import the PyPI package `kernels`, where installed, before transformers imports it.

    transformers imports it with its model code (and depends on it from 5.25). This repository's
    kernels/ folder (installed as tritonllm.kernels) and bench/kernels.py share the name, and would
    be imported in its place wherever their folder leads sys.path: `python -m pytest` or `python -m
    tritonllm` from the repository's root, any script in bench/.
    """
    if "kernels" in sys.modules:
        return
    try:
        site = str(importlib.metadata.distribution("kernels").locate_file(""))
    except importlib.metadata.PackageNotFoundError:
        return
    path = sys.path[:]
    sys.path.insert(0, site)
    try:
        importlib.import_module("kernels")
    finally:
        sys.path[:] = path


_import_hub_kernels()

from tritonllm.engine.engine import LLMEngine  # noqa: E402
from tritonllm.engine.output import GenerationOutput, RequestOutput  # noqa: E402
from tritonllm.llm import LLM, StreamOutput  # noqa: E402
from tritonllm.sampling_params import SamplingParams  # noqa: E402
from tritonllm.tiny_tasks import BUNDLED_MODEL  # noqa: E402

__all__ = ["LLM", "LLMEngine", "SamplingParams", "GenerationOutput", "RequestOutput", "StreamOutput", "BUNDLED_MODEL"]
__version__ = "0.1.0"
