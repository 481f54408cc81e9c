"""The HTTP server: FastAPI routes of the OpenAI API over the engine process (engine_loop.py).

    GET  /v1/models            the served model (/v1/models/{name}: the one, under any name it answers to)
    POST /v1/completions       prompt: text, texts, token ids or lists of them
    POST /v1/chat/completions  messages, through the tokenizer's chat template
    POST /tokenize, /detokenize  vLLM's: a prompt's or a chat's token ids, and token ids back to text
    GET  /health               200 while the engine runs
    GET  /stats, /metrics      running / waiting requests, KV blocks, token counters (JSON, Prometheus)
"""
import asyncio
import gc
import json
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from tritonllm.config import EngineConfig
from tritonllm.engine.requests import encode_prompt
from tritonllm.loader import has_tokenizer
from tritonllm.server.chat_body import detokenize, tokenize
from tritonllm.server.engine_loop import EngineClient, RequestStream
from tritonllm.server.fields import ApiError, check_model
from tritonllm.server.protocol import GenerateRequest, parse_chat, parse_completion, refused
from tritonllm.server.reply import REASONING_PARSERS, TOOL_CALL_PARSERS
from tritonllm.server.render import Renderer


class ServerState:
    """What the routes share: the engine, the tokenizer and its thread, the model's names, which parts
    chat replies are split into (reasoning, tool calls), whether a request may bring its own chat
    template, and the server's counters."""

    def __init__(self, engine: EngineClient, names: tuple[str, ...], tokenizer, reasoning: bool = False,
                 tool_calls: bool = False, trust_template: bool = False):
        self.engine, self.names, self.tokenizer = engine, names, tokenizer
        self.reasoning, self.tool_calls, self.trust_template = reasoning, tool_calls, trust_template
        # One thread, as a tokenizer is not safe to share between threads.
        self.tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tritonllm-tokenizer")
        self.created = int(time.time())
        self.token_cache: dict[int, str] = {}
        self.counters = {"requests": 0, "requests_finished": 0, "requests_aborted": 0, "errors": 0}

    async def off_loop(self, fn, *args):
        """fn(*args) on the tokenizer's thread: while a long prompt is encoded or a chat template
        renders, the event loop serves the other requests' streams."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_thread, partial(fn, *args))


def encode_prompts(parsed: GenerateRequest, tokenizer, vocab_size: int) -> list[list[int]]:
    """The request's prompts as the engine's checked token ids. Encoded here rather than in the
    engine's process, where a long prompt would hold up every running request's next step."""
    try:
        return [encode_prompt(prompt, tokenizer, vocab_size, parsed.add_special_tokens) for prompt in parsed.prompts]
    except (ValueError, TypeError) as error:
        raise refused(str(error), parsed.names) from None


def error_response(error: ApiError, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


async def read_json(request: Request) -> dict:
    try:
        body = json.loads(await request.body())
        # A lone surrogate ("\ud800") parses, but no reply naming it could be encoded: UnicodeEncodeError.
        json.dumps(body, ensure_ascii=False).encode()
    except (ValueError, RecursionError) as error:  # JSONDecodeError, Unicode*Error, an int over 4300 digits
        raise ApiError(400, f"the body is not valid JSON: {error}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    return body


async def until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def release(state: ServerState, stream: RequestStream) -> None:
    """The response is done with its request: one not finished (its client left) is aborted."""
    if not stream.finished:
        state.counters["requests_aborted"] += 1
    state.engine.release(stream)


async def collect(state: ServerState, stream: RequestStream, request: Request) -> list[tuple] | None:
    """Every output of a request not streamed; None if the client left first (that aborts it)."""
    async def outputs() -> list[tuple]:
        return [item async for batch in stream.batches() for item in batch]

    done = asyncio.ensure_future(outputs())
    gone = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait((done, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not done.done():
            done.cancel()
        release(state, stream)
    return done.result() if done.done() and not done.cancelled() else None


async def events(state: ServerState, stream: RequestStream, renderer: Renderer, include_usage: bool):
    """The stream's server-sent events; an error (the engine failed, the server is stopping) is the
    last event before [DONE]."""
    yield renderer.stream_start()
    try:
        async for batch in stream.batches():
            chunk = renderer.stream_chunks(batch)
            if chunk:
                yield chunk
    except ApiError as error:
        state.counters["errors"] += 1
        yield "data: " + json.dumps(error.body()) + "\n\n"
    else:
        if include_usage:
            yield renderer.stream_usage(stream.prompt_tokens)
        state.counters["requests_finished"] += 1
    yield "data: [DONE]\n\n"


class EventStream(StreamingResponse):
    """Server-sent events whose request is released however the response ends: finished, or cut
    short when the client disconnects (Starlette listens for it and cancels the stream, maybe
    before its generator started) or the server stops."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


async def generate(state: ServerState, request: Request, parsed: GenerateRequest):
    state.counters["requests"] += 1
    prompts = parsed.prompts
    if state.tokenizer is not None and any(isinstance(prompt, str) for prompt in prompts):
        prompts = await state.off_loop(encode_prompts, parsed, state.tokenizer, state.engine.info["vocab_size"])
    try:
        stream = await state.engine.submit(parsed, prompts)
    except asyncio.CancelledError:  # the client left while the engine was adding it (the engine aborts it)
        state.counters["requests_aborted"] += 1
        raise
    renderer = Renderer(parsed, state.names[0], state.tokenizer, state.token_cache, stream.prompt_token_ids,
                        state.reasoning)
    if parsed.stream:
        return EventStream(events(state, stream, renderer, parsed.include_usage), lambda: release(state, stream))
    items = await collect(state, stream, request)
    if items is None:
        return Response(status_code=499)  # nobody is there to read it
    state.counters["requests_finished"] += 1
    return JSONResponse(renderer.response(items, stream.prompt_tokens))


def prometheus(stats: dict) -> str:
    lines = []
    for name, value in stats.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            kind = "counter" if name.endswith("_total") else "gauge"
            lines += [f"# TYPE tritonllm_{name} {kind}", f"tritonllm_{name} {value}"]
    return "\n".join(lines) + "\n"


def create_app(engine: EngineClient, names: tuple[str, ...], tokenizer=None, reasoning_parser: str | None = None,
               tool_call_parser: str | None = None, trust_request_chat_template: bool = False) -> FastAPI:
    """The app over a started engine; `names[0]` is the model's name in responses, any of `names`
    is accepted as the request's model. reasoning_parser "qwen3" splits chat replies' thinking out,
    tool_call_parser "hermes" their tool calls, which serves tool_choice "auto" (server/reply.py).
    trust_request_chat_template: a chat request's own chat_template is rendered, not refused."""
    for name, value, allowed in (("reasoning_parser", reasoning_parser, REASONING_PARSERS),
                                 ("tool_call_parser", tool_call_parser, TOOL_CALL_PARSERS)):
        if value not in (None, *allowed):
            raise ValueError(f"{name}={value!r} is invalid: must be one of {allowed} or None")
    state = ServerState(engine, names, tokenizer, reasoning_parser is not None, tool_call_parser is not None,
                        trust_request_chat_template)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.attach(asyncio.get_running_loop())
        # Everything loaded by now lives as long as the server: out of the collector's way, a full
        # collection takes ~0.1 ms instead of ~0.4 s over torch's and transformers' objects.
        gc.freeze()
        yield
        state.tokenizer_thread.shutdown(wait=False, cancel_futures=True)
        await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="tritonllm", lifespan=lifespan)
    app.state.server = state
    # As vLLM's server by default: browser clients of other origins may call it.
    app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"])

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError):
        state.counters["errors"] += 1
        return error_response(error, {"Retry-After": "1"} if error.code == "queue_full" else None)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException):  # unknown route, wrong method
        state.counters["errors"] += 1
        return error_response(ApiError(error.status_code, str(error.detail), code=None), error.headers)  # 405: Allow

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception):
        state.counters["errors"] += 1
        return error_response(ApiError(500, f"internal error: {type(error).__name__}: {error}"))

    @app.get("/health")
    async def health():
        if engine.dead:
            raise ApiError(503, engine.dead, code="engine_dead")
        return {"status": "ok"}

    def model_card() -> dict:
        return {"id": names[0], "object": "model", "created": state.created, "owned_by": "tritonllm",
                "root": engine.info["model"], "max_model_len": engine.info["max_model_len"]}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        check_model({"model": model}, names)
        return model_card()

    async def all_stats() -> dict:
        return {**await engine.stats(), **state.counters}

    @app.get("/stats")
    async def stats():
        return await all_stats()

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus(await all_stats()))

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_json(request)
        check_model(body, names)
        return await generate(state, request, parse_completion(body, engine.info["has_tokenizer"],
                                                               engine.info["sampling_defaults"]))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_json(request)
        check_model(body, names)
        parsed = await state.off_loop(parse_chat, body, tokenizer, engine.info["sampling_defaults"], state.tool_calls,
                                      state.trust_template)
        return await generate(state, request, parsed)

    @app.post("/tokenize")
    async def tokenize_route(request: Request):
        body = await read_json(request)
        check_model(body, names)
        return await state.off_loop(tokenize, body, tokenizer, engine.info["max_model_len"], state.trust_template)

    @app.post("/detokenize")
    async def detokenize_route(request: Request):
        body = await read_json(request)
        check_model(body, names)
        return detokenize(body, tokenizer)

    return app


def served_names(model: str, served_model_name: str | None) -> tuple[str, ...]:
    """The name responses carry, then the other names a request may use: a folder's name (the
    bundled model is "bundled") or a preset's, and the --model argument as given."""
    folder = Path(model).resolve() if Path(model).is_dir() else None  # resolved: "." has a name too
    name = served_model_name or (folder.name if folder else Path(model).name)
    return tuple(dict.fromkeys([name, model, str(folder) if folder else model]))


def bound_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound (port 0: a free one) but not yet listening: until the model has
    loaded, a client's connection is refused rather than left waiting."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port whose last server just exited
    try:
        sock.bind((host, port))
    except OSError as error:  # in use, not this machine's address, or a host name that does not resolve
        sock.close()
        raise ValueError(f"cannot serve on {host}:{port} (--host, --port): {error.strerror or error}") from None
    return sock


class Server(uvicorn.Server):
    """uvicorn's server; on SIGINT or SIGTERM it stops accepting, and the requests still open after
    the grace period are aborted and answered (a stream gets an error event and [DONE])."""

    def __init__(self, config: uvicorn.Config, engine: EngineClient, grace: float):
        super().__init__(config)
        self.engine, self.grace = engine, grace

    def handle_exit(self, sig, frame) -> None:
        loop = self.engine.loop
        if not self.should_exit and loop is not None:  # a signal handler: hand the timer to the loop
            loop.call_soon_threadsafe(loop.call_later, self.grace, self.engine.abort_all, "the server is shutting down")
        super().handle_exit(sig, frame)


def run_server(model: str, options: dict, host: str = "127.0.0.1", port: int = 8000, served_model_name: str | None = None,
               max_waiting: int = 4096, shutdown_timeout: float = 5.0, log_level: str = "info",
               reasoning_parser: str | None = None, tool_call_parser: str | None = None, chat_template: str | None = None,
               trust_request_chat_template: bool = False) -> None:
    """Load the model in the engine process, then serve until SIGINT or SIGTERM: the server stops
    accepting, lets running requests finish for up to shutdown_timeout seconds, aborts the rest
    and stops the engine. chat_template (Jinja text) replaces the tokenizer's."""
    from transformers import AutoTokenizer

    config = EngineConfig.from_options(model, **options)  # the options' own checks, before any process starts
    if chat_template is not None and not has_tokenizer(config.model):
        raise ValueError(f"chat_template is given, but model {model!r} has no tokenizer to render chats with")
    with bound_socket(host, port) as sock:  # a busy port or an unknown host fails before the model loads
        engine = EngineClient(model, options, max_waiting)
        try:
            tokenizer = AutoTokenizer.from_pretrained(engine.info["model"]) if engine.info["has_tokenizer"] else None
            if chat_template is not None:
                tokenizer.chat_template = chat_template
            names = served_names(model, served_model_name)
            app = create_app(engine, names, tokenizer, reasoning_parser, tool_call_parser, trust_request_chat_template)
            info = engine.info
            address = f"[{host}]" if ":" in host else host
            print(f"tritonllm serve: {names[0]} (max_model_len {info['max_model_len']}, {info['num_kv_blocks']} KV "
                  f"blocks of {info['kv_block_size']}) on http://{address}:{sock.getsockname()[1]}/v1", file=sys.stderr,
                  flush=True)
            # uvicorn's own timeout is a backstop: by then the streams have ended themselves.
            config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                                    timeout_graceful_shutdown=shutdown_timeout + 5)
            Server(config, engine, shutdown_timeout).run(sockets=[sock])
        finally:
            engine.shutdown()
