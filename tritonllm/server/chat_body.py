"""A chat body rendered into its prompt text (messages, tools and the template's options, through
the chat template), and vLLM's /tokenize and /detokenize."""
from tritonllm.chat import MessageError, chat_prompt, has_chat_template, text_message
from tritonllm.server.fields import add_special_tokens, bad, check_unsupported, typed
from tritonllm.validation import check_known_characters


def chat_tools(body: dict) -> list[dict] | None:
    """OpenAI's tools: function tools, each with a name; they reach the chat template as given."""
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) for t in tools):
        raise bad('tools must be an array of {"type": "function", "function": {"name", ...}} objects', "tools")
    return tools or None


def chat_text(body: dict, tokenizer, tools: list[dict] | None, trust_template: bool) -> str:
    """The body's messages (and tools) as the chat template renders them, with the body's chat options."""
    template = typed(body, "chat_template", str)
    extra = typed(body, "chat_template_kwargs", dict, {})
    # A template is code the server runs: one of a request's own could keep the server busy for hours.
    for name, given in (("chat_template", template), ("chat_template_kwargs", extra.get("chat_template"))):
        if given is not None and not trust_template:
            raise bad(f"{name} may not carry a chat template: this server renders its own (start it with "
                      "--trust-request-chat-template to accept a request's)", name)
    if not has_chat_template(tokenizer, template):
        raise bad("this model has no chat template: use /v1/completions or give chat_template", "messages")
    messages = _messages(body)
    options = {name: typed(body, name, bool, default)
               for name, default in (("add_generation_prompt", True), ("continue_final_message", False))}
    # vLLM's: request fields the template reads as its variables (chat_template_kwargs win over them).
    documents = typed(body, "documents", list)
    if documents is not None and not all(isinstance(document, dict) for document in documents):
        raise bad("documents must be an array of objects", "documents")
    effort = typed(body, "reasoning_effort", str)
    fields = {"documents": documents, "reasoning_effort": effort}
    extra = {**{name: value for name, value in fields.items() if value is not None}, **extra}
    try:
        text = chat_prompt(tokenizer, messages, chat_template=template, chat_template_kwargs=extra, tools=tools,
                           **options)
    except ValueError as error:  # both options true
        raise bad(str(error), "continue_final_message") from None
    except Exception as error:  # the template's own checks (roles, order), or bad chat_template_kwargs
        raise bad(f"the chat template refused these messages: {error}", "messages") from None
    return text


def tokenize(body: dict, tokenizer, max_model_len: int, trust_template: bool = False) -> dict:
    """vLLM's POST /tokenize: the token ids of a prompt (with the tokenizer's special tokens unless
    add_special_tokens is false) or of a chat's rendered messages (without, unless true), as the
    completions and chat routes encode them (characters the tokenizer does not know are refused)."""
    if tokenizer is None:
        raise bad("this model has no tokenizer", "prompt")
    chat = "messages" in body
    if chat:
        check_unsupported(body)  # what would change the rendered text
        prompt = chat_text(body, tokenizer, chat_tools(body), trust_template)
    elif not isinstance(prompt := body.get("prompt"), str):
        raise bad(f"prompt must be a string, got {prompt!r:.60}", "prompt")
    ids = tokenizer.encode(prompt, add_special_tokens=add_special_tokens(body, chat))
    try:
        check_known_characters(tokenizer, prompt, ids)
    except ValueError as error:
        raise bad(str(error), "messages" if chat else "prompt") from None
    strs = tokenizer.convert_ids_to_tokens(ids) if typed(body, "return_token_strs", bool, False) else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(body: dict, tokenizer) -> dict:
    """vLLM's POST /detokenize: token ids back to text."""
    if tokenizer is None:
        raise bad("this model has no tokenizer", "tokens")
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < len(tokenizer) for t in tokens):
        raise bad(f"tokens must be an array of token ids in [0, {len(tokenizer)}), got {tokens!r:.60}", "tokens")
    return {"prompt": tokenizer.decode(tokens)}


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty array of {role, content} objects", "messages")
    try:
        return [text_message(message, f"messages[{i}]") for i, message in enumerate(messages)]
    except MessageError as e:
        raise bad(str(e), e.param) from None
