"""The `tritonllm` command: generate, chat, serve, bench."""
import argparse
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from tritonllm.config import DEVICES, DTYPES, KERNEL_BACKENDS, KV_CACHE_DTYPES, EngineConfig
from tritonllm.models.presets import PRESETS
from tritonllm.server.reply import REASONING_PARSERS, TOOL_CALL_PARSERS
from tritonllm.tiny_tasks import BUNDLED_MODEL, EVAL_SEED, problems

REPO = Path(__file__).parents[1]
# Engine options only `serve` takes (None: the engine's default).
SERVE_ENGINE_OPTIONS = ("max_num_seqs", "max_num_batched_tokens", "num_kv_blocks", "kv_block_size",
                        "gpu_memory_utilization", "enforce_eager")


def number_in(kind: type, low, high=math.inf):
    """An argparse type: a `kind` (int or float) in [low, high], else argparse's usage error naming the option."""
    def parse(text: str):
        value = kind(text)  # not a number: argparse says "invalid int value"
        if not low <= value <= high:  # NaN fails too
            raise argparse.ArgumentTypeError(f"must be in [{low}, {high}], got {value}" if high < math.inf
                                             else f"must be >= {low}, got {value}")
        return value

    parse.__name__ = kind.__name__
    return parse


def int_at_least(low: int):
    """An argparse type: an int >= low."""
    return number_in(int, low)


def engine_options(args) -> dict:
    options = {"tensor_parallel_size": args.tp, "seed": args.seed, "kernels": args.kernels,
               "kv_cache_dtype": args.kv_cache_dtype}
    if getattr(args, "dp", None) is not None:  # generate: chat streams and serve runs through one replica
        options["data_parallel_size"] = args.dp
    for name in ("device", "dtype", "max_model_len", *SERVE_ENGINE_OPTIONS):  # the latter: serve only
        if getattr(args, name, None) is not None:
            options[name] = getattr(args, name)
    return options


def sampling(args, default_max_tokens: int):
    from tritonllm import SamplingParams

    max_tokens = default_max_tokens if args.max_tokens is None else args.max_tokens
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          max_tokens=max_tokens)


def run_task_set(llm, params, num_problems: int) -> None:
    """The bundled model's checked problems: prompts, answers, accuracy and tokens/s."""
    tasks = problems(num_problems, EVAL_SEED)
    start = time.perf_counter()
    outputs = llm.generate([prompt for prompt, _ in tasks], params)  # the bar shows progress: on CPU this takes minutes
    elapsed = time.perf_counter() - start
    correct = 0
    for (prompt, answer), out in zip(tasks, outputs):
        ok = out.text == answer
        correct += ok
        print(f"{'ok ' if ok else 'BAD'} {prompt}{out.text}" + ("" if ok else f"   (expected {answer})"))
    tokens = sum(len(o.token_ids) for o in outputs)
    print(f"\naccuracy {correct}/{len(tasks)} = {correct / len(tasks):.0%}; {tokens} tokens in {elapsed:.2f} s "
          f"= {tokens / elapsed:.1f} tok/s on {llm.config.device}")


def generate(args) -> None:
    from tritonllm import LLM
    from tritonllm.loader import has_tokenizer

    params = sampling(args, default_max_tokens=8)  # bad options and prompts fail before the model is loaded
    if not args.prompt and Path(args.model).resolve() != BUNDLED_MODEL.resolve():
        raise ValueError("--prompt is required with a model other than the bundled one")
    options = engine_options(args)
    EngineConfig.from_options(args.model, **options)  # a folder without weights, before its prompts
    prompts = args.prompt if has_tokenizer(args.model) else [token_ids(p) for p in args.prompt or []]
    llm = LLM(args.model, **options)
    if not args.prompt:
        run_task_set(llm, params, args.num_problems)
        return
    for prompt, out in zip(args.prompt, llm.generate(prompts, params, use_tqdm=False)):
        print(f"{prompt}{out.text if out.text is not None else ' ' + ' '.join(map(str, out.token_ids))}")


def token_ids(prompt: str) -> list[int]:
    """A --prompt for a model without a tokenizer: token ids separated by spaces."""
    try:
        return [int(t) for t in prompt.split()]
    except ValueError:
        raise ValueError(f"--prompt {prompt!r}: this model has no tokenizer, give token ids separated by spaces") from None


def fit_history(llm, history: list[dict], max_tokens: int) -> list[dict]:
    """The conversation to send: history without its oldest exchanges, so that it and a reply fit
    max_model_len (the last message stays; history itself is untouched, as the message may yet be refused)."""
    conversation = list(history)

    def too_long() -> bool:
        text = llm.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        return len(llm.tokenizer.encode(text, add_special_tokens=False)) + max_tokens > llm.config.max_model_len

    dropped = 0
    while len(conversation) > 2 and too_long():
        del conversation[:2]
        dropped += 1
    if dropped and not too_long():  # else the engine refuses the message itself, and nothing is dropped
        print(f"(the oldest {dropped} exchange(s) dropped to fit max_model_len={llm.config.max_model_len})",
              file=sys.stderr, flush=True)
    return conversation


def chat(args) -> None:
    from transformers import AutoTokenizer

    from tritonllm import LLM
    from tritonllm.chat import has_chat_template
    from tritonllm.loader import has_tokenizer

    params = sampling(args, default_max_tokens=64)
    if not has_tokenizer(args.model):
        raise ValueError(f"model {args.model!r} has no tokenizer to chat with")
    if not has_chat_template(AutoTokenizer.from_pretrained(args.model)):  # before the weights load
        raise ValueError(f"model {args.model!r} has no chat template (tokenizer_config.json's chat_template): "
                         "chat needs one; generate completes plain prompts")
    llm = LLM(args.model, **engine_options(args))
    if args.max_tokens is None:  # leave room for the prompt: 8 tokens on the bundled model's 64 positions
        params.max_tokens = min(params.max_tokens, max(1, llm.config.max_model_len // 8))
    elif args.max_tokens >= llm.config.max_model_len:  # no message could fit beside the reply
        raise ValueError(f"--max-tokens {args.max_tokens} leaves no room for a message: it must be below "
                         f"max_model_len={llm.config.max_model_len}")
    history = []
    print("type a message; an empty line or Ctrl-D ends the chat")
    for line in sys.stdin:
        if not line.strip():
            break
        conversation = fit_history(llm, [*history, {"role": "user", "content": line.rstrip("\n")}], params.max_tokens)
        reply = ""
        try:
            for event in llm.chat(conversation, params, stream=True):
                print(event.text_delta, end="", flush=True)
                reply += event.text_delta
        except ValueError as error:  # e.g. a character the tokenizer lacks: drop this message, keep chatting
            print(f"error: {error}", file=sys.stderr, flush=True)
            continue
        print()
        history = [*conversation, {"role": "assistant", "content": reply}]


def chat_template_text(value: str | None) -> str | None:
    """--chat-template: the Jinja template itself (it has a "{"), or the path of a file holding it."""
    if value is None or "{" in value:
        return value
    if not Path(value).is_file():
        raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")
    return Path(value).read_text()


def serve(args) -> None:
    from tritonllm.server.app import run_server

    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes for Qwen3)")
    run_server(args.model, engine_options(args), args.host, args.port, args.served_model_name, args.max_waiting,
               args.shutdown_timeout, args.log_level, args.reasoning_parser,
               args.tool_call_parser if args.enable_auto_tool_choice else None, chat_template_text(args.chat_template),
               args.trust_request_chat_template)


def bench(args) -> None:
    script = REPO / "bench" / f"{args.what}.py"
    if not script.exists():
        raise ValueError(f"{script} not found: `tritonllm bench` runs from a source checkout")
    sys.exit(subprocess.call([sys.executable, str(script), *args.rest]))


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="tritonllm", description="Qwen3 inference where every hot path is a Triton kernel.")
    commands = top.add_subparsers(dest="command", required=True)

    def add_model_options(p, max_tokens_help):
        p.add_argument("--max-tokens", type=int, help=f"tokens to generate per {max_tokens_help}")
        p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
        p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
        p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (1 = off)")
        p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p * p_max (0 = off)")
        add_engine_options(p)

    def add_engine_options(p):
        p.add_argument("--model", default=str(BUNDLED_MODEL),
                       help=f"checkpoint folder or preset ({', '.join(PRESETS)}: random weights); default: the "
                            "bundled tiny model")
        p.add_argument("--tp", type=int_at_least(1), default=1, help="tensor-parallel size (GPUs)")
        p.add_argument("--device", choices=DEVICES, help="default: cuda when available, else cpu (interpreter)")
        p.add_argument("--dtype", choices=list(DTYPES), help="default: the checkpoint's (float32 on the CPU)")
        p.add_argument("--max-model-len", type=int, help="longest prompt + completion (default: the model's)")
        p.add_argument("--kernels", choices=KERNEL_BACKENDS, default="triton",
                       help="Triton kernels, or their PyTorch references")
        p.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default="auto",
                       help="auto: the model's dtype; fp8 (vLLM: fp8_e4m3): e4m3 with a scale per token and KV head "
                            "(half the bytes)")
        p.add_argument("--seed", type=int, default=0)

    gen = commands.add_parser("generate", help="complete prompts (or run the bundled model's task set)",
                              description="Print completions. Without --prompt, the bundled model solves its "
                                          "checked problems and prints accuracy and tokens/s.")
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable); token ids separated by spaces for "
                                                       "models without a tokenizer")
    gen.add_argument("--num-problems", type=int_at_least(1), default=30, help="problems of the task set (default 30)")
    add_model_options(gen, "prompt (default 8)")
    gen.add_argument("--dp", type=int_at_least(1), default=1,
                     help="data-parallel replicas, each --tp GPUs wide (prompts are dealt out round-robin)")
    gen.set_defaults(run=generate)

    talk = commands.add_parser("chat", help="an interactive, streamed chat")
    add_model_options(talk, "reply (default 64, at most an eighth of max_model_len: 8 on the bundled model)")
    talk.set_defaults(run=chat)

    server = commands.add_parser("serve", help="an OpenAI-compatible HTTP server",
                                 description="Serve the model over the OpenAI API (/v1/completions, /v1/chat/completions, "
                                             "/v1/models; /tokenize, /detokenize, /health, /stats, /metrics) until "
                                             "SIGINT or SIGTERM.")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=number_in(int, 0, 65535), default=8000)
    server.add_argument("--served-model-name", help="the model's name in the API (default: the folder's or preset's name)")
    server.add_argument("--max-waiting", type=int_at_least(1), default=4096,
                        help="requests waiting for a batch slot before new ones get 503 (default 4096)")
    server.add_argument("--shutdown-timeout", type=number_in(float, 0.0), default=5.0,
                        help="seconds running requests get to finish after SIGTERM before they are aborted (default 5)")
    server.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    server.add_argument("--reasoning-parser", choices=REASONING_PARSERS,
                        help="split chat replies' <think> text into the message's `reasoning` (vLLM's)")
    server.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="serve tool_choice \"auto\": chat replies' tool calls become tool_calls (vLLM's)")
    server.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, help="the tool calls' format (Qwen3: hermes)")
    server.add_argument("--chat-template", help="a Jinja chat template, or its file, in place of the tokenizer's")
    server.add_argument("--trust-request-chat-template", action="store_true",
                        help="render a chat request's own chat_template (by default refused: a template runs as code)")
    add_engine_options(server)
    server.add_argument("--max-num-seqs", type=int, help="requests in one batch (default 256)")
    server.add_argument("--max-num-batched-tokens", type=int, help="tokens in one step (default 16384)")
    server.add_argument("--num-kv-blocks", type=int,
                        help="KV cache blocks (default: from --gpu-memory-utilization; 1 GiB on the CPU)")
    server.add_argument("--kv-block-size", type=int, help="tokens per KV block (default 16)")
    server.add_argument("--gpu-memory-utilization", type=float, help="share of GPU memory for weights and cache (default 0.9)")
    server.add_argument("--enforce-eager", action="store_true", default=None, help="no CUDA graphs")
    server.set_defaults(run=serve)

    perf = commands.add_parser("bench", help="run bench/kernels.py, throughput.py or serve.py (source checkout)")
    perf.add_argument("what", choices=["kernels", "throughput", "serve"])
    perf.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for the bench script")
    perf.set_defaults(run=bench)
    return top


def main(argv=None) -> None:
    top = parser()
    args = top.parse_args(argv)
    try:
        args.run(args)
    except ValueError as error:
        top.exit(2, f"tritonllm {args.command}: error: {error}\n")
    except KeyboardInterrupt:  # Ctrl-C: no traceback
        top.exit(130, "\n")
    except BrokenPipeError:  # the reader of stdout left (`| head`): no traceback, and none at exit's flush
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)


if __name__ == "__main__":
    main()
