"""A client that leaves mid-request, streamed or not: the request is aborted, its blocks are freed,
and the server goes on answering.

The server runs a tiny random checkpoint given 4096 positions, so that a request can last
thousands of steps: on the bundled model (64 positions, about 4 ms a step on a CPU) a whole request
took a quarter of a second, and a loaded machine could finish it before the server saw the client go."""
import json
import shutil
import time

import pytest
from server_process import ServerProcess

MODEL = "tiny"
MAX_TOKENS = 4000
PROMPT = [5, 6, 7]  # token ids: the random model has no task to answer


@pytest.fixture(scope="module")
def server(tiny_qwen3, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-long")
    shutil.copytree(tiny_qwen3, folder, dirs_exist_ok=True)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 4096}))  # rotary has no bound
    process = ServerProcess(["--model", str(folder), "--served-model-name", MODEL, "--max-model-len", "4096"],
                            tmp_path_factory.mktemp("server") / "log.txt")
    yield process
    process.stop()


def check_aborted_early(server, client, before: dict) -> None:
    """After the client left: its request aborted long before its end, every block free, and the
    server still answering."""
    after = server.wait_idle()
    assert after["num_free_kv_blocks"] == after["num_kv_blocks"] and after["num_running_seqs"] == 0
    assert after["requests_aborted"] == before["requests_aborted"] + 1
    generated = after["generation_tokens_total"] - before["generation_tokens_total"]
    assert generated < MAX_TOKENS // 2, generated
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, extra_body={"ignore_eos": True})
    assert response.usage.completion_tokens == 4 and response.choices[0].finish_reason == "length"


def test_dropped_stream_is_aborted_and_frees_its_blocks(server, client):
    before = server.wait_idle()
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks), next(chunks)
    running = server.stats()
    assert running["num_running_seqs"] == 1 and running["num_free_kv_blocks"] < running["num_kv_blocks"]
    stream.close()  # the client goes away mid-stream
    check_aborted_early(server, client, before)


def test_a_client_leaving_a_request_not_streamed_aborts_it(server, client):
    before = server.wait_idle()
    sock = server.send_only("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                                                "ignore_eos": True})
    deadline = time.monotonic() + 120
    while server.stats()["generation_tokens_total"] < before["generation_tokens_total"] + 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    sock.close()
    check_aborted_early(server, client, before)
