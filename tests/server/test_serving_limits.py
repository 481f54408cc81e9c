"""The server's limits: a full waiting queue answers 503; SIGTERM lets running requests finish within
the grace period, aborts the rest and ends the server within seconds; a dead engine stops it."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
from server_process import ServerProcess

from tritonllm import BUNDLED_MODEL, LLM, SamplingParams

MODEL = "bundled"
# One request runs at a time and one may wait; SIGTERM aborts the streams at once (no grace period).
SERVER_ARGS = ["--max-num-seqs", "1", "--max-waiting", "1", "--shutdown-timeout", "0"]


def long_stream(client, max_tokens: int = 60):
    """A stream that runs for many steps; returned once its first chunk came (so it is running)."""
    stream = client.completions.create(model=MODEL, prompt="1", max_tokens=max_tokens, stream=True,
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
    chunks = iter(stream)
    next(chunks)
    return stream, chunks


def children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def test_full_queue_is_503(server, client):
    running, _ = long_stream(client)
    waiting = client.completions.create(model=MODEL, prompt="1+1=", max_tokens=2, stream=True)  # queued: it answered
    with pytest.raises(openai.APIStatusError) as raised:
        client.completions.create(model=MODEL, prompt="2+2=", max_tokens=2)
    assert raised.value.status_code == 503 and raised.value.code == "queue_full"
    assert raised.value.response.headers["retry-after"] == "1"  # clients that retry wait this long
    assert server.stats()["num_waiting_seqs"] == 1
    running.close()
    assert "".join(c.choices[0].text for c in waiting) == "2"  # it ran once the first left
    assert client.completions.create(model=MODEL, prompt="2+2=", max_tokens=2, temperature=0).choices[0].text == "4"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process tree from /proc")
def test_sigterm_aborts_what_runs_and_exits(server, client):
    engine = children(server.process.pid)
    assert engine  # the engine's process (and multiprocessing's resource tracker)
    _, chunks = long_stream(client)  # 59 tokens to go, and no grace period
    server.process.send_signal(signal.SIGTERM)
    with pytest.raises(openai.APIError, match="shutting down"):  # the stream ends with an error event
        for _ in chunks:
            pass
    # uvicorn re-raises the signal once it has shut down, so the exit is that of SIGTERM.
    assert server.process.wait(timeout=60) in (0, -signal.SIGTERM)
    assert server.request("GET", "/health", timeout=2)[0] == 0  # nothing listens
    deadline = time.monotonic() + 10  # the engine is gone; multiprocessing's resource tracker follows
    while any(Path(f"/proc/{pid}").exists() for pid in engine) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(Path(f"/proc/{pid}").exists() for pid in engine)
    assert "Traceback" not in server.log_text()


def test_a_model_that_does_not_load_is_a_clean_error():
    result = subprocess.run([sys.executable, "-m", "tritonllm", "serve", "--model", "Qwen3-0.6B", "--device", "cpu"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "does not exist" in result.stderr and "Traceback" not in result.stderr


def test_the_server_stops_when_its_engine_dies(tmp_path):
    server = ServerProcess([], tmp_path / "log.txt")
    try:
        engine = [pid for pid in children(server.process.pid) if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(engine) == 1
        os.kill(engine[0], signal.SIGKILL)
        assert server.process.wait(timeout=60) in (0, -signal.SIGTERM)
        assert "the engine process exited (exit code -9); stopping the server" in server.log_text()
    finally:
        server.stop()


def test_sigterm_lets_running_requests_finish(tmp_path):
    server = ServerProcess(["--shutdown-timeout", "120"], tmp_path / "log.txt")
    try:
        chunks = iter(server.client().completions.create(model=MODEL, prompt="1", max_tokens=30, stream=True,
                                                         extra_body={"ignore_eos": True, "return_token_ids": True}))
        first = next(chunks)
        server.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while server.request("GET", "/health", timeout=2)[0] != 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.request("GET", "/health", timeout=2)[0] == 0  # no new connections
        rest = list(chunks)  # while the running stream goes on to its end
        assert rest[-1].choices[0].finish_reason == "length"
        assert sum(len(c.choices[0].model_extra["token_ids"]) for c in [first, *rest]) == 30
        assert server.process.wait(timeout=60) in (0, -signal.SIGTERM)
        assert "Traceback" not in server.log_text()
    finally:
        server.stop()


def test_the_models_generation_config_sets_the_sampling_defaults(tmp_path):
    """vLLM's defaults: the checkpoint's generation_config sampling fields where a request leaves them
    out (here a temperature of 50, which scrambles the bundled model's answers), offline and served."""
    model = tmp_path / "model"
    shutil.copytree(BUNDLED_MODEL, model)
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, "temperature": 50.0}))
    with LLM(str(model), device="cpu", kernels="reference") as llm:
        assert llm.sampling_defaults == {"temperature": 50.0}
        hot = llm.generate(["rev abcd="] * 4, use_tqdm=False)
        assert [out.text for out in llm.generate(["rev abcd="] * 4, SamplingParams(), use_tqdm=False)] == ["dcba"] * 4
    assert sum(out.text != "dcba" for out in hot) >= 3
    server = ServerProcess(["--model", str(model)], tmp_path / "log.txt")
    try:
        client = server.client()
        texts = [client.completions.create(model="model", prompt="rev abcd=", seed=seed).choices[0].text for seed in range(4)]
        assert sum(text != "dcba" for text in texts) >= 3
        for seed in range(4):  # the request's own temperature wins
            assert client.completions.create(model="model", prompt="rev abcd=", seed=seed, temperature=1.0).choices[0].text == "dcba"
    finally:
        server.stop()
