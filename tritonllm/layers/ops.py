"""The kernel backends a model can be built on: the Triton kernels, or their PyTorch references.

The references have the same signatures, so the same engine runs on either, for side-by-side
checks and benchmarks (`bench/throughput.py --kernels reference`). Each model holds its own.
"""
from types import ModuleType

from tritonllm import kernels
from tritonllm.kernels import reference

BACKENDS = {"triton": kernels, "reference": reference}


def backend(name: str) -> ModuleType:
    if name not in BACKENDS:
        raise ValueError(f"kernels={name!r} is invalid: must be one of {', '.join(BACKENDS)}")
    return BACKENDS[name]
