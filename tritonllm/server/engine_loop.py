"""The engine in a process of its own, and the server's handle on it.

In one process, the HTTP event loop and the thread stepping the engine would share one GIL, which
every torch call of the step releases and takes back: a busy event loop then delays each step's
host work, and the GPU waits. So the engine runs in a child process that does nothing but step:
between steps it takes the server's commands (add, abort, stats, stop) and after each step sends
that step's outputs as one message.

In the server, a reader thread receives each message and hands it to the event loop with one
call_soon_threadsafe; the loop appends every output to its request's RequestStream and wakes the
stream's reader. A reader that fell behind takes all its stream holds at once, so a busy loop
sends fewer, larger chunks and never slows the engine. Commands go out through a sender thread,
so the loop never blocks on a full pipe.

The messages are tuples. Server to engine: ("add", key, prompts, params, chat, fill_max_tokens, stream),
("abort", key), ("stats", key), ("stop",). Engine to server: ("ready", info) or ("failed", text)
once; ("added", key, error, prompt_lengths), ("stats", key, dict), ("out", items) with items
(key, choice, token_ids, text, logprobs, top_logprobs, final), final None or (finish_reason,
cached_tokens); ("error", keys, text) when a step failed (those requests are aborted). A request
not streamed gives one item per choice, when it finishes, with all its tokens and text.
"""
import asyncio
import dataclasses
import gc
import itertools
import multiprocessing as mp
import queue
import signal
import sys
import threading
import traceback
from collections import deque

from tritonllm.server.protocol import ApiError

STOP_TIMEOUT_S = 30  # how long the engine process gets to exit before it is killed


# ---- the engine process

def engine_main(conn, model: str, options: dict, max_waiting: int) -> None:
    """The child process: load the model, report ready, then serve commands and step until stopped
    or until the server's end of the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the server, which stops us in order
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
                             "kv_block_size": engine.config.kv_block_size, "num_kv_blocks": stats["num_kv_blocks"]}))
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

    def run(self) -> None:
        while True:
            busy = self.engine.has_unfinished()
            if self.conn.poll(0 if busy else None):  # idle: sleep until a command comes
                while True:
                    if not self.handle(self.conn.recv()):
                        return
                    if not self.conn.poll(0):
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

    def add(self, key: int, prompts: list, params, chat: bool, fill_max_tokens: bool, stream: bool) -> None:
        """Queue every prompt of one API request, or none of them: a bad one is reported for all."""
        waiting = self.engine.stats()["num_waiting_seqs"]
        if waiting + len(prompts) * params.n > self.max_waiting:
            self.conn.send(("added", key, ("queue_full", f"the server's queue is full ({waiting} requests waiting): "
                                                         "retry later"), None))
            return
        self.keys[key], lengths = [], []
        try:
            for i, prompt in enumerate(prompts):
                token_ids = self.encode(prompt, chat)
                if fill_max_tokens:  # chat without max_tokens: as far as the model's length allows
                    config = self.engine.config
                    room = min(config.max_model_len, self.engine.stats()["num_kv_blocks"] * config.kv_block_size)
                    params = dataclasses.replace(params, max_tokens=max(1, room - len(token_ids)))
                request_id = self.engine.add_request(token_ids, params, stream=stream)
                self.keys[key].append(request_id)
                self.requests[request_id] = [key, i * params.n, params.n, stream]
                lengths.append(len(token_ids))
        except (ValueError, TypeError) as error:
            self.abort(key)
            self.conn.send(("added", key, ("invalid", str(error)), None))
            return
        self.conn.send(("added", key, None, lengths))

    def encode(self, prompt, chat: bool) -> list[int]:
        """Token ids as LLM.generate (a string or ids) or LLM.chat (a templated text) makes them;
        ids are checked when the request is added."""
        if isinstance(prompt, list):
            return prompt
        if not chat:
            return self.engine.encode(prompt)
        token_ids = self.engine.tokenizer.encode(prompt, add_special_tokens=False)
        self.engine.check_known_characters(prompt, token_ids)
        return token_ids

    def abort(self, key: int) -> None:
        for request_id in self.keys.pop(key, []):
            if self.requests.pop(request_id, None) is not None:
                self.engine.abort(request_id)

    def step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception:  # fail the requests, keep serving (the engine recomputes what was in flight)
            text = traceback.format_exc()
            print(f"tritonllm serve: a step failed; its requests are aborted:\n{text}", file=sys.stderr, flush=True)
            keys = list(self.keys)
            for key in keys:
                self.abort(key)
            self.conn.send(("error", keys, text.strip().splitlines()[-1]))
            return
        items = []
        for out in outputs:
            entry = self.requests.get(out.request_id)
            if entry is None:  # aborted
                continue
            final, text = None, out.text_delta
            if out.finished:
                final = (out.output.finish_reason, out.output.num_cached_tokens)
                if not entry[3]:  # not streamed: the whole completion in this one output
                    text = out.output.text or ""
                entry[2] -= 1
                if entry[2] == 0:
                    del self.requests[out.request_id]
                    ids = self.keys[entry[0]]
                    ids.remove(out.request_id)
                    if not ids:
                        del self.keys[entry[0]]
            items.append((entry[0], entry[1] + out.index, out.new_token_ids, text, out.new_logprobs,
                          out.new_top_logprobs, final))
        if items:
            self.conn.send(("out", items))


# ---- the server's side

class RequestStream:
    """One API request's outputs as they come; read by one coroutine (its response)."""

    def __init__(self, key: int, num_choices: int):
        self.key = key
        self.items: deque = deque()
        self.ready = asyncio.Event()
        self.choices_left = num_choices
        self.prompt_tokens = 0
        self.error: ApiError | None = None

    @property
    def finished(self) -> bool:
        return self.choices_left == 0 or self.error is not None

    def put(self, item: tuple) -> None:
        self.items.append(item)
        if item[6] is not None:
            self.choices_left -= 1
        self.ready.set()

    def fail(self, error: ApiError) -> None:
        self.error = error
        self.ready.set()

    async def get(self) -> list[tuple]:
        """Every output that came since the last call (waiting for one); raises the stream's error."""
        while not self.items and self.error is None:
            self.ready.clear()
            await self.ready.wait()
        if self.error is not None:
            raise self.error
        items = list(self.items)
        self.items.clear()
        return items


class EngineClient:
    """Starts the engine process and talks to it: submit, abort, stats, shutdown."""

    def __init__(self, model: str, options: dict, max_waiting: int):
        context = mp.get_context("spawn")
        self.conn, child = context.Pipe()
        # Not a daemon: the engine spawns its own tensor-parallel workers.
        self.process = context.Process(target=engine_main, args=(child, model, options, max_waiting),
                                       name="tritonllm-engine")
        self.process.start()
        child.close()
        try:
            reply = self.conn.recv()
        except EOFError:
            self.process.join()
            reply = ("failed", f"the engine process exited while loading (exit code {self.process.exitcode})")
        if reply[0] == "failed":
            self.process.join()
            raise ValueError(reply[1])
        self.info: dict = reply[1]
        self.streams: dict[int, RequestStream] = {}
        self.replies: dict[int, asyncio.Future] = {}  # add and stats replies by key
        self.keys = itertools.count()
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.dead: str | None = None  # why the engine process is gone, once it is
        self.loop: asyncio.AbstractEventLoop | None = None

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the reader and sender threads; outputs are dispatched on `loop`."""
        self.loop = loop
        threading.Thread(target=self._read, name="engine-reader", daemon=True).start()
        threading.Thread(target=self._send, name="engine-sender", daemon=True).start()

    def _send(self) -> None:
        while True:
            command = self.outbox.get()
            try:
                self.conn.send(command)
            except OSError:
                return
            if command[0] == "stop":
                return

    def _read(self) -> None:
        try:
            while True:
                self.loop.call_soon_threadsafe(self._dispatch, self.conn.recv())
        except (EOFError, OSError):
            self.loop.call_soon_threadsafe(self._engine_gone)

    def _dispatch(self, message: tuple) -> None:
        kind = message[0]
        if kind == "out":
            streams = self.streams
            for item in message[1]:
                stream = streams.get(item[0])
                if stream is not None:
                    stream.put(item)
        elif kind in ("added", "stats"):
            future = self.replies.pop(message[1], None)
            if future is not None and not future.done():
                future.set_result(message)
        elif kind == "error":
            for key in message[1]:
                stream = self.streams.pop(key, None)
                if stream is not None:
                    stream.fail(ApiError(500, f"the engine failed on this request: {message[2]}"))

    def _engine_gone(self) -> None:
        self.dead = self.dead or f"the engine process exited (exit code {self.process.exitcode})"
        error = ApiError(503, self.dead, code="engine_dead")
        for stream in self.streams.values():
            stream.fail(error)
        self.streams.clear()
        for future in self.replies.values():
            if not future.done():
                future.set_exception(error)
        self.replies.clear()

    async def _ask(self, command: tuple) -> tuple:
        if self.dead:
            raise ApiError(503, self.dead, code="engine_dead")
        future = self.loop.create_future()
        self.replies[command[1]] = future
        self.outbox.put(command)
        return await future

    async def submit(self, prompts: list, params, chat: bool = False, fill_max_tokens: bool = False,
                     stream: bool = True) -> RequestStream:
        """Queue an API request's prompts (n samples each); errors are ApiErrors (400, 503). Not
        streamed, each choice comes as one output when it finishes."""
        key = next(self.keys)
        stream = self.streams[key] = RequestStream(key, len(prompts) * params.n)
        try:
            _, _, error, lengths = await self._ask(("add", key, prompts, params, chat, fill_max_tokens, stream))
        except BaseException:  # cancelled: the client left while the engine was adding it
            self.release(stream)
            raise
        if error is not None:
            del self.streams[key]
            kind, message = error
            if kind == "queue_full":
                raise ApiError(503, message, code="queue_full")
            raise ApiError(400, message, "max_tokens" if "max_tokens" in message else "prompt", "invalid_value")
        stream.prompt_tokens = sum(lengths)
        return stream

    def release(self, stream: RequestStream) -> None:
        """Forget a stream whose reader is done with it or gone. One not finished is aborted: the
        engine frees its blocks before its next step."""
        if self.streams.pop(stream.key, None) is not None and not stream.finished and not self.dead:
            self.outbox.put(("abort", stream.key))

    def abort_all(self, message: str) -> None:
        """End every open request with a 503 (streams get it as their last event)."""
        error = ApiError(503, message, code="shutting_down")
        for stream in list(self.streams.values()):
            self.release(stream)
            stream.fail(error)

    async def stats(self) -> dict:
        return (await self._ask(("stats", next(self.keys))))[2]

    def shutdown(self) -> None:
        """Stop the engine (aborting what runs) and wait for its process; killed if it hangs."""
        if self.process.is_alive():
            self.outbox.put(("stop",))
            self.process.join(STOP_TIMEOUT_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
