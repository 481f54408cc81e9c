"""The API's error shape and the checks of single request-body fields.

Fields that change nothing in the output (user, metadata, store, ...) and fields nobody defined
are accepted and ignored; a field that would change the output and that this server does not
implement (response_format, a chat's echo, ...) is an error unless it holds its neutral value.
"""


# Field -> the values that leave the output as it is (anything else is refused by name).
NEUTRAL = {
    "suffix": (None, ""), "best_of": (None, 1),
    "functions": (None, []),
    "function_call": (None, "none", "auto"), "response_format": (None, {"type": "text"}),
    "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,), "web_search_options": (None,),
    # vLLM's extras
    "use_beam_search": (None, False), "bad_words": (None, []), "logits_processors": (None, []),
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "structured_outputs": (None,), "include_reasoning": (None, True),
}

# Fields that change nothing here, but whose type OpenAI checks.
IGNORED_TYPES = {"user": str, "metadata": dict, "service_tier": str, "store": bool}

JSON_NAMES = {bool: "a boolean", int: "an integer", str: "a string", dict: "an object", list: "an array"}
ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
               422: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}


class ApiError(Exception):
    """An error the client gets as {"error": {"message", "type", "param", "code"}} with its status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param, "invalid_value" if param else None)


def typed(body: dict, name: str, kind: type, default=None):
    """body[name] if it is of `kind` (None or absent: default)."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise bad(f"{name} must be {JSON_NAMES[kind]}, got {type(value).__name__} {value!r:.60}", name)
    return value


def check_model(body: dict, names: tuple[str, ...]) -> None:
    model = typed(body, "model", str)
    if model is not None and model not in names:
        raise ApiError(404, f"The model `{model}` does not exist; this server serves {names[0]!r}", "model",
                       "model_not_found")


def is_neutral(value, neutral: tuple) -> bool:
    """Whether value is one of the neutral values, with its JSON type (true is not 1, 0 is not false)."""
    return any(value == v and type(value) is type(v) for v in neutral)


def check_unsupported(body: dict) -> None:
    for name, neutral in NEUTRAL.items():
        if name in body and not is_neutral(body[name], neutral):
            raise bad(f"{name}={body[name]!r:.60} is not supported by this server", name)
    for name, kind in IGNORED_TYPES.items():
        typed(body, name, kind)


def add_special_tokens(body: dict, chat: bool) -> bool:
    """vLLM's add_special_tokens: by default a completion's prompt gets them, a chat's rendered text not."""
    return typed(body, "add_special_tokens", bool, not chat)
