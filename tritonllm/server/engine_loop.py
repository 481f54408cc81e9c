"""The server's handle on the engine's process (engine_process.py): requests in, streams of outputs back.

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

The messages are tuples. Server to engine: ("add", key, prompts, params, add_special_tokens, stream),
("abort", key), ("stats", key), ("stop",). Engine to server: ("ready", info) or ("failed", text)
once; ("added", key, error, prompt_token_ids) with error None or (kind, text), kind "invalid",
"queue_full" or "failed"; ("stats", key, dict); ("out", items) with items
(key, choice, token_ids, text, logprobs, top_logprobs, final, prompt), final None or (finish_reason,
cached_tokens, stop_reason), prompt None or the request's (prompt_logprobs, prompt_top_logprobs,
prompt_ranks) in a choice's first item; ("error", keys, text) when a step failed (those requests are aborted). A request
not streamed gives one item per choice, when it finishes, with all its tokens and text.
"""

import asyncio
import itertools
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
from collections import deque

from tritonllm.server.engine_process import engine_main
from tritonllm.server.fields import ApiError
from tritonllm.server.protocol import GenerateRequest, refused

STOP_TIMEOUT_S = 30  # how long the engine process gets to exit before it is killed


class RequestStream:
    """One API request's outputs as they come; read by one coroutine (its response)."""

    def __init__(self, key: int, num_choices: int):
        self.key = key
        self.items: deque = deque()
        self.ready = asyncio.Event()
        self.choices_left = num_choices
        self.prompt_token_ids: list[list[int]] = []  # each prompt's, as the engine encoded it
        self.error: ApiError | None = None

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompt_token_ids))

    @property
    def finished(self) -> bool:
        """Every output has come, or the stream failed: nothing to abort."""
        return self.choices_left == 0 or self.error is not None

    def put(self, item: tuple) -> None:
        self.items.append(item)
        if item[6] is not None:
            self.choices_left -= 1
        self.ready.set()

    def fail(self, error: ApiError) -> None:
        """End the stream with `error` (its reader gets it from batches()), unless every output has come."""
        if self.choices_left:
            self.error = error
            self.ready.set()

    async def batches(self):
        """Every output, in batches of those that came since the last one (waiting for one), until the
        last output is taken, however early they all came; raises the stream's error instead."""
        while self.choices_left or self.items or self.error is not None:
            while not self.items and self.error is None:
                self.ready.clear()
                await self.ready.wait()
            if self.error is not None:
                raise self.error
            items = list(self.items)
            self.items.clear()
            yield items


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
        self.stopping = False
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
        """The engine's end of the pipe closed: fail what is open, and unless the server is stopping
        it anyway, stop the server (SIGTERM to itself: a supervisor can start a new one)."""
        self.process.join(1)
        self.dead = self.dead or f"the engine process exited (exit code {self.process.exitcode})"
        if not self.stopping:
            print(f"tritonllm serve: {self.dead}; stopping the server", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
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

    async def submit(self, request: GenerateRequest, prompts: list) -> RequestStream:
        """Queue an API request's prompts (n samples each; `prompts` as the engine takes them: token ids
        where the server encoded them); errors are ApiErrors (400 naming the body's field, 503). Not
        streamed, each choice comes as one output when it finishes."""
        key = next(self.keys)
        outputs = self.streams[key] = RequestStream(key, request.num_choices)
        try:
            _, _, error, prompt_ids = await self._ask(("add", key, prompts, request.params, request.add_special_tokens,
                                                    request.stream))
        except BaseException:  # cancelled: the client left while the engine was adding it
            self.release(outputs)
            raise
        if error is not None:
            del self.streams[key]
            kind, message = error
            if kind == "queue_full":
                raise ApiError(503, message, code="queue_full")
            if kind == "failed":
                raise ApiError(500, f"the engine failed to add this request: {message}")
            raise refused(message, request.names)
        outputs.prompt_token_ids = prompt_ids
        return outputs

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
        self.stopping = True
        if self.process.is_alive():
            self.outbox.put(("stop",))
            self.process.join(STOP_TIMEOUT_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
