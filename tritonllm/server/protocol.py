"""OpenAI completions and chat request bodies parsed into checked GenerateRequests (their sampling
fields into SamplingParams), and the engine's refusals named as the body names the field."""
import re
from dataclasses import dataclass

from tritonllm.sampling_params import MAX_TOP_LOGPROBS, SamplingParams
from tritonllm.server.chat_body import chat_text, chat_tools
from tritonllm.server.fields import ApiError, add_special_tokens, bad, check_unsupported, is_neutral, typed


@dataclass
class GenerateRequest:
    """One completions or chat request, checked: what the engine process and the renderer need."""
    chat: bool
    prompts: list  # completions: strings or token-id lists; chat: the one chat-templated text
    params: SamplingParams
    stream: bool
    include_usage: bool  # a stream ends with a chunk of the usage
    logprobs: int | None  # None: no logprobs; else how many top alternatives per token (0..20)
    return_token_ids: bool  # each choice (and stream delta) also carries its token ids
    tokens_as_ids: bool  # logprob tokens as "token_id:N" instead of their text
    names: dict[str, str]  # engine field -> the body's field for it, where they differ (refused)
    add_special_tokens: bool  # a text prompt gets the tokenizer's special tokens (vLLM's: completions yes, chat no)
    echo: bool = False  # a completion choice starts with its prompt (text, and logprobs if asked)
    generates: bool = True  # false for OpenAI's echo with max_tokens 0: the one token drawn is left out
    continuous_usage: bool = False  # vLLM's continuous_usage_stats: each stream chunk has its choice's usage so far
    parse_tools: bool = False  # a chat with tools and tool_choice "auto": replies' tool calls become tool_calls
    parallel_tool_calls: bool = True  # false: a reply's first tool call only (OpenAI's)

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.params.n


def _stop(body: dict):
    stop = body.get("stop")
    if stop is None or isinstance(stop, str):
        return stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad(f"stop must be a string or an array of strings, got {stop!r:.60}", "stop")
    return stop


def _logit_bias(body: dict) -> dict[int, float] | None:
    """OpenAI's logit_bias: token ids as JSON object keys (strings) -> numbers; ranges are SamplingParams'."""
    bias = typed(body, "logit_bias", dict)
    if bias is None:
        return None
    bad_keys = [key for key in bias if not (key.isascii() and key.isdigit() and len(key) <= 18)]
    if bad_keys:
        raise bad(f"logit_bias keys must be token ids, got {bad_keys[0]!r:.40}", "logit_bias")
    return {int(key): value for key, value in bias.items()}


def field_names(body: dict, chat: bool) -> dict[str, str]:
    """The body's names of the engine's fields where they differ: the prompt of a chat is its
    messages, a chat's max_tokens may come as max_completion_tokens (a chat-only field), a
    completion's top_logprobs is logprobs."""
    completion_tokens = chat and body.get("max_completion_tokens") is not None
    return {"prompt": "messages" if chat else "prompt", "top_logprobs": "top_logprobs" if chat else "logprobs",
            "max_tokens": "max_completion_tokens" if completion_tokens else "max_tokens"}


def refused(message: str, names: dict[str, str]) -> ApiError:
    """The 400 for a value the engine refused, named as the body names it: the SamplingParams field
    the message names, else max_tokens where it is about the length, else the prompt."""
    found = re.search(r"SamplingParams\.(\w+)", message)
    field = found.group(1) if found else "max_tokens" if "max_tokens" in message else "prompt"
    message = message.replace("SamplingParams.", "")
    name = names.get(field, field)
    if field != "prompt":  # "prompt" stays in the text: a chat's prompt is its rendered messages
        message = message.replace(field, name, 1)
    if "maximum context length" in message:  # OpenAI's code for it
        return ApiError(400, message, name, "context_length_exceeded")
    return bad(message, name)


def sampling_params(body: dict, chat: bool, default_max_tokens: int | None, top_logprobs: int | None,
                    defaults: dict | None = None, echo: bool = False) -> SamplingParams:
    """The body's sampling fields as checked SamplingParams; a bad one is a 400 naming its field.
    A field the body leaves out takes the model's default (`defaults`, from its generation_config,
    as vLLM's), else OpenAI's. An echo scores the prompt as the completion's tokens (vLLM's)."""
    names = field_names(body, chat)
    max_name = names["max_tokens"]
    fields = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "min_tokens": 0, "n": 1,
              "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
              "seed": None, "ignore_eos": False, "stop_token_ids": None, "skip_special_tokens": True,
              "include_stop_str_in_output": False, "allowed_token_ids": None, "truncate_prompt_tokens": None,
              **(defaults or {})}
    kwargs = {name: default if body.get(name) is None else body[name] for name, default in fields.items()}
    # Without one: completions 16 (OpenAI's default), chat None (the engine fills the room the prompt leaves).
    kwargs["max_tokens"] = default_max_tokens if body.get(max_name) is None else body[max_name]
    kwargs["stop"] = _stop(body)
    kwargs["logit_bias"] = _logit_bias(body)
    kwargs["logprobs"] = top_logprobs is not None
    kwargs["top_logprobs"] = top_logprobs or 0
    kwargs["prompt_logprobs"] = body.get("prompt_logprobs")
    if echo:
        if kwargs["prompt_logprobs"] is None:
            kwargs["prompt_logprobs"] = top_logprobs
        if _without_generation(body):
            kwargs["max_tokens"] = 1
    try:
        return SamplingParams(**kwargs)
    except (TypeError, ValueError) as error:
        raise refused(str(error), names) from None


def _prompts(body: dict) -> list:
    """prompt: a string, an array of strings, an array of token ids, or an array of those arrays."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:  # JSON's integers are ints (and true is a bool, not an int)
        if all(type(t) is int for t in prompt):
            return [prompt]
        if all(isinstance(p, str) for p in prompt):
            return prompt
        if all(isinstance(p, list) and p and all(type(t) is int for t in p) for p in prompt):
            return prompt
    raise bad("prompt must be a string, an array of strings, an array of token ids or an array of "
              f"token-id arrays (none empty), got {prompt!r:.60}", "prompt")


def _usage_options(body: dict, stream: bool) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats), the second only with the first (vLLM's)."""
    options = typed(body, "stream_options", dict)
    if options is not None and not stream:  # OpenAI's rule, an empty object too
        raise bad("stream_options is only allowed with stream=true", "stream_options")
    options = options or {}
    try:
        include = typed(options, "include_usage", bool, False)
        return include, include and typed(options, "continuous_usage_stats", bool, False)
    except ApiError as error:  # named as the body nests it
        raise bad(error.message, f"stream_options.{error.param}") from None


def _without_generation(body: dict) -> bool:
    """OpenAI's echo with max_tokens 0: the prompt comes back (scored with logprobs), no completion."""
    return type(body.get("max_tokens")) is int and body["max_tokens"] == 0


def parse_completion(body: dict, has_tokenizer: bool, defaults: dict | None = None) -> GenerateRequest:
    check_unsupported(body)
    prompts = _prompts(body)
    logprobs = typed(body, "logprobs", int)
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise bad(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {logprobs}", "logprobs")
    echo = typed(body, "echo", bool, False)
    if echo and not has_tokenizer:
        raise bad("echo needs a tokenizer, and this model has none", "echo")
    params = sampling_params(body, False, 16, logprobs, defaults, echo)
    request = _request(body, False, prompts, params, logprobs, has_tokenizer)
    request.echo, request.generates = echo, not (echo and _without_generation(body))
    return request


def parse_chat(body: dict, tokenizer, defaults: dict | None = None, auto_tools: bool = False,
               trust_template: bool = False) -> GenerateRequest:
    """A chat request; `tokenizer` renders its messages (and tools) through the model's chat template
    (the request's own only where trust_template); `defaults` as sampling_params takes them; auto_tools:
    the server parses tool calls, so it serves tool_choice "auto" (OpenAI's default with tools)."""
    check_unsupported(body)
    if not is_neutral(body.get("echo"), (None, False)):
        raise bad(f"echo={body['echo']!r:.60} is not supported by this server's chat", "echo")
    tools = chat_tools(body)
    choice = body.get("tool_choice")
    if choice is None:  # OpenAI's default
        choice = "auto" if tools else "none"
    if choice not in ("none", "auto"):
        raise bad(f"tool_choice={choice!r:.60} is not supported: \"none\" or \"auto\" (required and named "
                  "choices need guided decoding)", "tool_choice")
    if choice == "auto" and not tools:
        raise bad('tool_choice "auto" needs tools', "tool_choice")
    if choice == "auto" and not auto_tools:
        raise bad('tool_choice "auto" needs a server started with --enable-auto-tool-choice --tool-call-parser '
                  'hermes (or give tool_choice "none")', "tool_choice")
    text = chat_text(body, tokenizer, tools, trust_template)
    wants = typed(body, "logprobs", bool, False)
    top = typed(body, "top_logprobs", int)
    if top and not wants:  # 0 is the default: it asks for nothing
        raise bad("top_logprobs requires logprobs=true", "top_logprobs")
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise bad(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top}", "top_logprobs")
    logprobs = (top or 0) if wants else None
    if body.get("max_completion_tokens") is not None:  # it wins (vLLM's), but a max_tokens beside it is still checked
        beside = typed(body, "max_tokens", int)
        if beside is not None and beside < 1:
            raise bad(f"max_tokens must be >= 1, got {beside}", "max_tokens")
    request = _request(body, True, [text], sampling_params(body, True, None, logprobs, defaults), logprobs, True)
    request.parse_tools = bool(tools) and choice == "auto"
    request.parallel_tool_calls = typed(body, "parallel_tool_calls", bool, True)
    return request


def _request(body: dict, chat: bool, prompts: list, params: SamplingParams, logprobs, has_tokenizer: bool) -> GenerateRequest:
    if params.stop and not has_tokenizer:
        raise bad("stop strings need a tokenizer, and this model has none: use stop_token_ids", "stop")
    stream = typed(body, "stream", bool, False)
    if stream and body.get("prompt_logprobs") is not None and params.prompt_logprobs:  # vLLM's rule: 0 passes
        raise bad("prompt_logprobs > 0 is not available with stream=true", "prompt_logprobs")
    include_usage, continuous_usage = _usage_options(body, stream)
    return GenerateRequest(chat, prompts, params, stream, include_usage, logprobs,
                           typed(body, "return_token_ids", bool, False) or not has_tokenizer,
                           typed(body, "return_tokens_as_token_ids", bool, False) or not has_tokenizer,
                           field_names(body, chat), add_special_tokens(body, chat), continuous_usage=continuous_usage)
