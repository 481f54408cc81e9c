"""A `tritonllm serve` subprocess per test module (the bundled model on the CPU, or with ON_TINY the
tiny random checkpoint), and the offline LLM its answers are compared with. A module's SERVER_ARGS
are added to the server's command line.

The server and the LLM run the PyTorch reference kernels: on the CPU Triton's interpreter is about
ten times slower, and these tests check the server, not the kernels (tests/kernels, tests/engine).
"""
import pytest
from server_process import ServerProcess

from tritonllm import LLM, BUNDLED_MODEL


@pytest.fixture(scope="module")
def server(request, tmp_path_factory):
    args = getattr(request.module, "SERVER_ARGS", [])
    if getattr(request.module, "ON_TINY", False):  # the tiny random checkpoint, served as "tiny"
        args = ["--model", str(request.getfixturevalue("tiny_qwen3")), "--served-model-name", "tiny", *args]
    process = ServerProcess(args, tmp_path_factory.mktemp("server") / "log.txt")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def llm():
    """The offline engine on the same model and kernels as the server."""
    engine = LLM(BUNDLED_MODEL, device="cpu", kernels="reference")
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def tiny_llm(tiny_qwen3):
    """The offline engine on the tiny checkpoint and the server's kernels (modules with ON_TINY)."""
    with LLM(str(tiny_qwen3), device="cpu", kernels="reference") as engine:
        yield engine
