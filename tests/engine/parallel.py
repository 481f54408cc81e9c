"""Helpers of the tensor- and data-parallel engine tests: a skip mark where a machine has too few
GPUs (on CPU every rank runs under gloo), and whether a rank's process still runs."""
from pathlib import Path

import pytest
import torch


def ranks(n: int):
    return pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < n,
                              reason=f"{n} ranks on GPUs need {n} of them; on CPU they run under gloo")


def running(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
