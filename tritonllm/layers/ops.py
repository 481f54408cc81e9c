"""The kernel backend the layers call: the Triton kernels, or their PyTorch references.

The references have the same signatures, so one switch runs the same engine on either, for
side-by-side checks and benchmarks (`bench/throughput.py --kernels reference`).
"""
from types import ModuleType

from tritonllm import kernels
from tritonllm.kernels import reference

BACKENDS = {"triton": kernels, "reference": reference}
_backend: ModuleType = kernels


def use_kernels(name: str) -> None:
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"kernels must be one of {sorted(BACKENDS)}, got {name!r}")
    _backend = BACKENDS[name]


def ops() -> ModuleType:
    return _backend
