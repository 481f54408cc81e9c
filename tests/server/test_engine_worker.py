"""The engine process's loop (server/engine_process.EngineWorker) on the offline engine, without a
server: a request that fails on its way in, or a step that fails, fails only the requests it held
and the engine serves the next one; a fault that fails every step stops the engine."""
import pytest

from tritonllm import LLM, BUNDLED_MODEL, SamplingParams
from tritonllm.server.engine_process import MAX_FAILED_STEPS, EngineWorker

GREEDY = SamplingParams(temperature=0, max_tokens=4)


class Pipe:
    """The worker's end of the pipe: what it sends."""

    def __init__(self):
        self.sent = []

    def send(self, message):
        self.sent.append(message)


def test_a_fault_while_adding_fails_that_request_alone(llm, monkeypatch):
    pipe = Pipe()
    worker = EngineWorker(llm, pipe, max_waiting=16)
    encode = llm.encode

    def faulty(prompt, add_special_tokens=True):
        if prompt == "9+9=":
            raise RuntimeError("injected")
        return encode(prompt, add_special_tokens)

    monkeypatch.setattr(llm, "encode", faulty)
    worker.add(0, ["1+1=", "9+9="], GREEDY, True, False)  # the first is queued, then taken back
    assert pipe.sent == [("added", 0, ("failed", "RuntimeError: injected"), None)] and not worker.keys
    worker.add(1, ["12+34="], GREEDY, True, False)
    while llm.has_unfinished():
        worker.step()
    outputs = [item for message in pipe.sent[2:] for item in message[1]]
    assert [(item[0], item[3], item[6][0]) for item in outputs] == [(1, "46", "stop")]
    assert llm.block_manager.num_free_blocks == llm.stats()["num_kv_blocks"]


@pytest.fixture(scope="module")
def one_seq():
    """An engine that runs one sequence at a time: the second request waits."""
    with LLM(BUNDLED_MODEL, device="cpu", kernels="reference", max_num_seqs=1) as engine:
        yield engine


def failing_launch(runner, monkeypatch):
    monkeypatch.setattr(runner, "launch", lambda *a: (_ for _ in ()).throw(RuntimeError("injected")))


def test_a_failed_step_fails_the_requests_it_held_alone(one_seq, monkeypatch):
    """The waiting request was never in the step that failed: it is served, not failed with it."""
    pipe = Pipe()
    worker = EngineWorker(one_seq, pipe, max_waiting=16)
    worker.add(0, ["1+1="], GREEDY, True, False)
    worker.add(1, ["12+34="], GREEDY, True, False)
    worker.step()  # request 0 launched; 1 waits
    failing_launch(one_seq.runner, monkeypatch)
    worker.step()
    monkeypatch.undo()
    assert pipe.sent[2] == ("error", [0], "RuntimeError: injected") and list(worker.keys) == [1]
    while one_seq.has_unfinished():
        worker.step()
    outputs = [item for message in pipe.sent[3:] for item in message[1]]
    assert [(item[0], item[3], item[6][0]) for item in outputs] == [(1, "46", "stop")]
    assert one_seq.block_manager.num_free_blocks == one_seq.stats()["num_kv_blocks"]


def test_steps_failing_in_a_row_stop_the_engine(one_seq, monkeypatch):
    """A fault that outlives a request (a broken device, a dead rank) fails each step: the third
    in a row exits, so the server reports the engine dead instead of answering 500 for ever. A
    step that succeeds in between starts the count again."""
    pipe = Pipe()
    worker = EngineWorker(one_seq, pipe, max_waiting=16)
    failing_launch(one_seq.runner, monkeypatch)
    for key in range(MAX_FAILED_STEPS - 1):
        worker.add(key, ["1+1="], GREEDY, True, False)
        worker.step()
    monkeypatch.undo()
    worker.add(10, ["12+34="], GREEDY, True, False)
    worker.step()  # succeeds
    failing_launch(one_seq.runner, monkeypatch)
    for key in range(11, 10 + MAX_FAILED_STEPS):
        worker.step()
        worker.add(key, ["1+1="], GREEDY, True, False)
    with pytest.raises(SystemExit):
        worker.step()
    monkeypatch.undo()
    errors = [message for message in pipe.sent if message[0] == "error"]
    assert [keys for _, keys, _ in errors] == [[key] for key in [*range(MAX_FAILED_STEPS - 1), *range(10, 10 + MAX_FAILED_STEPS)]]
    while one_seq.has_unfinished():  # what the process would have released on exit
        one_seq.step()
    assert one_seq.block_manager.num_free_blocks == one_seq.stats()["num_kv_blocks"]
