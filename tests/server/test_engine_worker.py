"""The engine process's loop (server/engine_process.EngineWorker) on the offline engine, without a
server: a request that fails on its way in fails alone, and the engine serves the next one."""
from tritonllm import SamplingParams
from tritonllm.server.engine_process import EngineWorker

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
