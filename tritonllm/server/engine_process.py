"""The engine's process: load the model, then take the server's commands between steps and send
each step's outputs as one message (the messages: engine_loop.py)."""
import gc
import os
import signal
import sys
import time
import traceback

DRAIN_S = 0.02  # while requests run, at most this long on commands between two steps
MAX_FAILED_STEPS = 3  # a fault that outlives this many steps in a row is the engine's, not a request's


def engine_main(conn, model: str, options: dict, max_waiting: int) -> None:
    """The child process: load the model, report ready, then serve commands and step until stopped
    or until the server's end of the pipe closes."""
    # Out of the terminal's process group (with the tensor-parallel workers it spawns): Ctrl-C
    # reaches the server only, which stops the engine in order.
    os.setpgrp()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from tritonllm.engine.engine import LLMEngine

    try:
        engine = LLMEngine(model, **options)
    except Exception as error:
        conn.send(("failed", f"{type(error).__name__}: {error}"))
        return
    gc.freeze()  # the model's objects stay: a full collection would otherwise walk them all (~0.4 s)
    try:
        stats = engine.stats()
        conn.send(("ready", {"model": engine.config.model, "max_model_len": engine.config.max_model_len,
                             "vocab_size": engine.hf_config.vocab_size, "has_tokenizer": engine.tokenizer is not None,
                             "kv_block_size": engine.config.kv_block_size, "num_kv_blocks": stats["num_kv_blocks"],
                             "sampling_defaults": engine.sampling_defaults}))
        EngineWorker(engine, conn, max_waiting).run()
    except (EOFError, BrokenPipeError, ConnectionResetError):  # the server is gone
        pass
    finally:
        engine.close()


class EngineWorker:
    """The child's loop; requests are known by the server's key, each of one or more engine requests."""

    def __init__(self, engine, conn, max_waiting: int):
        self.engine, self.conn, self.max_waiting = engine, conn, max_waiting
        self.keys: dict[int, list[int]] = {}  # server key -> its engine request ids
        self.requests: dict[int, list] = {}  # engine request id -> [key, first choice index, samples left, stream]
        self.failed_steps = 0  # in a row

    def run(self) -> None:
        """Take the commands that came (all of them, or DRAIN_S worth while requests run), then step;
        with nothing to run, sleep until a command comes."""
        while True:
            busy = self.engine.has_unfinished()
            if self.conn.poll(0 if busy else None):
                until = time.perf_counter() + DRAIN_S
                while True:
                    if not self.handle(self.conn.recv()):
                        return
                    if not self.conn.poll(0) or (busy and time.perf_counter() > until):
                        break
            if self.engine.has_unfinished():
                self.step()

    def handle(self, command: tuple) -> bool:
        kind = command[0]
        if kind == "add":
            self.add(*command[1:])
        elif kind == "abort":
            self.abort(command[1])
        elif kind == "stats":
            self.conn.send(("stats", command[1], self.engine.stats()))
        elif kind == "stop":
            for key in list(self.keys):
                self.abort(key)
            return False
        return True

    def add(self, key: int, prompts: list, params, add_special_tokens: bool, stream: bool) -> None:
        """Queue every prompt of one API request, or none of them: a bad one is reported for all."""
        samples = len(prompts) * params.n
        if samples > self.max_waiting:  # never fits, however long the client waits: not a 503
            queues = f"more than this server queues (--max-waiting {self.max_waiting})"
            message = (f"SamplingParams.n={params.n} is invalid: with {len(prompts)} prompt(s) it asks for {samples} "
                       f"samples, {queues}" if params.n > 1 else f"the request's {samples} prompts are {queues}")
            self.conn.send(("added", key, ("invalid", message), None))
            return
        waiting = self.engine.stats()["num_waiting_seqs"]
        if waiting + samples > self.max_waiting:
            self.conn.send(("added", key, ("queue_full", f"the server's queue is full ({waiting} requests waiting): "
                                                         "retry later"), None))
            return
        self.keys[key], prompt_ids = [], []
        try:
            for i, prompt in enumerate(prompts):
                seq = self.engine.make_sequence(self.engine.encode(prompt, add_special_tokens), params,
                                                strict_length=True)
                prompt_ids.append(seq.token_ids[:])  # as the engine runs it (truncate_prompt_tokens)
                request_id = self.engine.queue(seq, stream)
                self.keys[key].append(request_id)
                self.requests[request_id] = [key, i * params.n, params.n, stream]
        except (ValueError, TypeError) as error:
            self.abort(key)
            self.conn.send(("added", key, ("invalid", str(error)), None))
            return
        except Exception as error:  # a fault on this request's way in: it fails alone, the engine serves on
            self.abort(key)
            print(f"tritonllm serve: adding a request failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            self.conn.send(("added", key, ("failed", f"{type(error).__name__}: {error}"), None))
            return
        self.conn.send(("added", key, None, prompt_ids))

    def abort(self, key: int) -> None:
        for request_id in self.keys.pop(key, []):
            if self.requests.pop(request_id, None) is not None:
                self.engine.abort(request_id)

    def step(self) -> None:
        """One engine step, its outputs sent. A step that raises fails the requests it held (the engine
        recomputes the others; all of them if it held none); after MAX_FAILED_STEPS in a row the
        process exits, so that the server reports the engine dead and stops (a supervisor can start
        a new one) instead of failing every request while /health says ok."""
        try:
            outputs = self.engine.step()
        except Exception:
            self.failed_steps += 1
            text = traceback.format_exc()
            held = {self.requests[r][0] for r in self.engine.failed_request_ids if r in self.requests}
            keys = sorted(held) if held else list(self.keys)  # the culprit unknown: every request
            print(f"tritonllm serve: a step failed; its requests are aborted:\n{text}", file=sys.stderr, flush=True)
            for key in keys:
                self.abort(key)
            self.conn.send(("error", keys, text.strip().splitlines()[-1]))
            if self.failed_steps >= MAX_FAILED_STEPS:
                print(f"tritonllm serve: {self.failed_steps} steps in a row failed; the engine stops", file=sys.stderr,
                      flush=True)
                raise SystemExit(1)
            return
        self.failed_steps = 0
        items = []
        for out in outputs:
            entry = self.requests.get(out.request_id)
            if entry is None:  # aborted
                continue
            final, text = None, out.text_delta
            if out.finished:
                final = (out.output.finish_reason, out.output.num_cached_tokens, out.output.stop_reason)
                if not entry[3]:  # not streamed: the whole completion in this one output
                    text = out.output.text or ""
                entry[2] -= 1
                if entry[2] == 0:
                    del self.requests[out.request_id]
                    ids = self.keys[entry[0]]
                    ids.remove(out.request_id)
                    if not ids:
                        del self.keys[entry[0]]
            prompt = None if out.prompt_logprobs is None else (out.prompt_logprobs, out.prompt_top_logprobs,
                                                                out.prompt_ranks)
            items.append((entry[0], entry[1] + out.index, out.new_token_ids, text, out.new_logprobs,
                          out.new_top_logprobs, final, prompt))
        if items:
            self.conn.send(("out", items))
