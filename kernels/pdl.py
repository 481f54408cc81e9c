"""Programmatic dependent launch (PDL): a kernel's programs start while the previous kernel drains.

In a decode step most kernels run a few microseconds, so the gap between two of them (the next
launch's setup and its first programs' start) is a real share of the step. Launched with PDL on
Hopper or later, a kernel's programs are placed on the SMs as soon as every program of the
previous kernel has started, and wait in `pdl_wait` until that kernel has finished and its writes
are visible. Every kernel launched with PDL calls `pdl_wait` before it touches memory, so the order
of reads and writes is the same as without PDL; a kernel that follows one launched without PDL
(a cuBLAS GEMM, a copy) simply starts when it would have.
"""
import torch
import triton
import triton.language as tl

from tritonllm.kernels.tuning import INTERPRET, has_tma


def pdl_launch(x: torch.Tensor) -> dict:
    """The launch keywords of a kernel taking `PDL: tl.constexpr` whose operands live where `x` does:
    PDL on a CUDA GPU of sm_90 or later (where griddepcontrol exists), off elsewhere and under the
    interpreter."""
    if x.is_cuda and not INTERPRET and has_tma(x.device.index):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait until the previous kernel's writes are visible, then let the next kernel's programs start."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
