"""A step's samples on their way to the host."""
import time

import torch


def agreeing_top(top: tuple, ids: torch.Tensor, logprobs: torch.Tensor) -> tuple:
    """Top logprobs (values [N, k], ids [N, k]) with each row's chosen token ids[N], where it is among
    them, valued at its logprobs[N]: two kernels sum a row in their own orders, and one token should
    show one logprob (vLLM reads both from one tensor)."""
    values, top_ids = top
    return torch.where(top_ids == ids[:, None], logprobs[:, None], values), top_ids


class SampledTokens:
    """A step's sampled ids [N] (and logprobs [N], top logprobs' values and ids [N, k], or None) on
    the device, copied to the host in the background; `result()` waits for the copy. A step's scored
    prompt positions come the same way, with the prompt tokens' ranks where the ids go."""

    def __init__(self, ids: torch.Tensor, logprobs: torch.Tensor | None, top: tuple | None = None):
        self.ids = ids
        self._host = [t.to("cpu", non_blocking=True) for t in (ids, logprobs, *(top or ())) if t is not None]
        self._copied = None
        if ids.is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()
        self.has_logprobs, self.has_top = logprobs is not None, top is not None

    def result(self, check=None) -> tuple[list[int], list[float] | None, tuple[list, list] | None]:
        """The ids, logprobs and top logprobs (values, ids) as lists. While the copy is not done,
        `check()` (if given) runs every 0.1 ms: it raises when a tensor-parallel worker died, whose
        collectives would never finish."""
        if self._copied is not None and check is None:
            self._copied.synchronize()
        elif self._copied is not None:
            while not self._copied.query():
                check()
                time.sleep(1e-4)
        values = [t.tolist() for t in self._host]
        logprobs = values[1] if self.has_logprobs else None
        return values[0], logprobs, tuple(values[-2:]) if self.has_top else None
