"""Conversations as prompt text through the model's chat template, with vLLM's chat options."""
import json


class MessageError(ValueError):
    """A chat message the templates cannot take; `param` names it (messages[2], messages[2].content)."""

    def __init__(self, param: str, problem: str):
        super().__init__(f"{param} {problem}")
        self.param = param


def text_message(message, name: str = "message") -> dict:
    """A copy of an OpenAI-style message as the chat templates take it: content a string (text parts
    [{"type": "text", "text": ...}] joined by newlines, as vLLM joins them; None as ""), and vLLM's
    `reasoning` also as `reasoning_content`, which Qwen3's templates read; an assistant's tool calls
    with their arguments, a JSON string in OpenAI's messages, as the object templates render (vLLM's).
    MessageError naming `name` otherwise."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise MessageError(name, "must be an object with a string role")
    content = message.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise MessageError(f"{name}.content", "may hold only text parts ({'type': 'text', 'text': ...})")
        content = "\n".join(p["text"] for p in content)
    if content is not None and not isinstance(content, str):
        raise MessageError(f"{name}.content", "must be a string or a list of text parts")
    checked = {**message, "content": content or ""}
    if isinstance(message.get("reasoning"), str):
        checked.setdefault("reasoning_content", message["reasoning"])
    calls = message.get("tool_calls")
    if message["role"] == "assistant" and isinstance(calls, list):
        checked["tool_calls"] = [_parsed_call(call, f"{name}.tool_calls[{i}]") for i, call in enumerate(calls)]
        if not calls:
            del checked["tool_calls"]
    return checked


def _parsed_call(call, name: str):
    """A tool call whose function.arguments string (None or "": none) is parsed, as templates write
    it with tojson or iterate it; other calls as they are."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments") or "", str):
        return call
    try:
        arguments = json.loads(function.get("arguments") or "{}")
    except ValueError:
        raise MessageError(f"{name}.function.arguments", "must be a JSON string") from None
    return {**call, "function": {**function, "arguments": arguments}}


def has_chat_template(tokenizer, chat_template: str | None = None) -> bool:
    """Whether messages can be rendered: a tokenizer, and a template given or its own."""
    return tokenizer is not None and bool(chat_template or getattr(tokenizer, "chat_template", None))


def chat_prompt(tokenizer, messages: list[dict], *, add_generation_prompt: bool = True,
                continue_final_message: bool = False, chat_template: str | None = None,
                chat_template_kwargs: dict | None = None, tools: list[dict] | None = None) -> str:
    """The prompt text of `messages` ({"role", "content"} dicts) as the tokenizer's chat template (or
    the Jinja `chat_template` given) renders it. add_generation_prompt opens the assistant's turn;
    continue_final_message leaves the last message open for the model to go on with (the two
    exclude each other); chat_template_kwargs go to the template (Qwen3's: enable_thinking) and
    override the options above, as in vLLM; tools (OpenAI's function tools) are the template's `tools`."""
    for name, value in (("add_generation_prompt", add_generation_prompt),
                        ("continue_final_message", continue_final_message)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    if chat_template is not None and not isinstance(chat_template, str):
        raise TypeError(f"chat_template must be a string (Jinja), got {type(chat_template).__name__}")
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
        raise TypeError(f"chat_template_kwargs must be a dict, got {type(chat_template_kwargs).__name__}")
    if tokenizer is None:
        raise ValueError("this model has no tokenizer to render messages with: give prompts as token ids")
    if not has_chat_template(tokenizer, chat_template):
        raise ValueError("this model's tokenizer has no chat template: give chat_template")
    options = {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message,
               "tools": tools, **(chat_template_kwargs or {})}
    if options["add_generation_prompt"] and options["continue_final_message"]:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be true: continuing the "
                         "last message adds no new turn (set add_generation_prompt=False)")
    return tokenizer.apply_chat_template(messages, tokenize=False, chat_template=chat_template, **options)
