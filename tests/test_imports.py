"""The PyPI package `kernels`, which transformers imports, is never shadowed by this repository's
kernels/ folder or bench/kernels.py once tritonllm is imported (tritonllm/__init__.py)."""
import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# As `python -m pytest` and `python bench/*.py` run: the folder holding a `kernels` leads sys.path.
CHECK = """
import sys
sys.path.insert(0, {folder!r})
import tritonllm
import kernels
from transformers.models.qwen3 import modeling_qwen3
print(kernels.__file__)
"""


@pytest.mark.parametrize("folder", [ROOT, ROOT / "bench"], ids=["repository-root", "bench"])
def test_hub_kernels_package_is_imported_not_ours(folder):
    try:
        site = Path(importlib.metadata.distribution("kernels").locate_file("")).resolve()
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the PyPI package `kernels` is not installed: nothing can shadow it")
    result = subprocess.run([sys.executable, "-c", CHECK.format(folder=str(folder))], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()).resolve().is_relative_to(site / "kernels"), result.stdout
