"""tritonllm: an offline inference engine for Qwen3 whose hot paths are Triton kernels."""
import os

import torch

# Without a GPU the kernels run through Triton's interpreter. The variable is read when a kernel
# is decorated, so it must be set before any module of tritonllm.kernels is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tritonllm.engine.engine import LLMEngine  # noqa: E402
from tritonllm.engine.output import GenerationOutput, RequestOutput  # noqa: E402
from tritonllm.llm import LLM, StreamOutput  # noqa: E402
from tritonllm.sampling_params import SamplingParams  # noqa: E402
from tritonllm.tiny_tasks import BUNDLED_MODEL  # noqa: E402

__all__ = ["LLM", "LLMEngine", "SamplingParams", "GenerationOutput", "RequestOutput", "StreamOutput", "BUNDLED_MODEL"]
__version__ = "0.1.0"
