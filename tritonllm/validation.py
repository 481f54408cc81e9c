"""check(): the one validation helper of the engine options and sampling parameters (check_field
and check_list apply it to an attribute and to each item of a list).

A bad value is a TypeError (wrong type) or a ValueError (out of range) that names its field,
before anything deeper turns it into a confusing error. check_known_characters does the same for
the characters of a text prompt.
"""
import math
import numbers
import operator

NAMES = {int: "an int", float: "a number", bool: "a bool (True or False)", str: "a string"}


def _convert(value, kind: type):
    """`value` as `kind`, or None if it is not one. Integer scalars of numpy and torch count as ints
    (through __index__), their float scalars as floats; bools count only as bools, never as numbers."""
    if kind is bool and str(getattr(value, "dtype", "")) in ("bool", "torch.bool") and not getattr(value, "ndim", 1):
        return bool(value)  # numpy's and torch's scalar bools
    if kind is bool or kind is str:
        return value if isinstance(value, kind) else None
    if isinstance(value, bool) or str(getattr(value, "dtype", "")) == "torch.bool":  # numpy's bool has no __index__
        return None
    if getattr(value, "ndim", 0):  # a one-element tensor has __index__ too, but is not a scalar
        return None
    try:
        return operator.index(value)
    except TypeError:
        if kind is float and getattr(value, "is_floating_point", lambda: False)():  # a 0-d float tensor
            return value.item()
        return value if kind is float and isinstance(value, numbers.Real) else None


def as_int(value) -> int | None:
    """value as an int if it is one (numpy and torch integer scalars included, bools not), else None."""
    return _convert(value, int)


def check(name: str, value, kind: type, rule=None, allowed: str = "", optional: bool = False):
    """Return `value` converted to `kind` (int, float, bool or str) if it is one and `rule` holds for
    it; floats must also be finite. optional: None passes as None."""
    if value is None and optional:
        return None
    converted = _convert(value, kind)
    if converted is None:
        raise TypeError(f"{name} must be {NAMES[kind]}{' or None' if optional else ''}, got {type(value).__name__} {value!r}")
    if kind is float:
        try:
            converted = float(converted)
        except OverflowError:
            raise ValueError(f"{name} is invalid: an int of {converted.bit_length()} bits is past a float's range") from None
        if not math.isfinite(converted):
            raise ValueError(f"{name}={value!r} is invalid: must be finite")
    if rule is not None and not rule(converted):
        raise ValueError(f"{name}={value!r} is invalid: must be {allowed}")
    return converted


def check_field(obj, name: str, kind: type, rule=None, allowed: str = "", optional: bool = False,
                prefix: str = "") -> None:
    """check() the attribute `name` of `obj` (`prefix + name` in errors) and store the converted value."""
    setattr(obj, name, check(prefix + name, getattr(obj, name), kind, rule, allowed, optional))


def check_list(name: str, value, kind: type, rule=None, allowed: str = "") -> list:
    """A list (or other iterable, not a string or a mapping) of `kind`, each item checked; None is the empty list."""
    items = None
    if value is None:
        items = []
    elif not isinstance(value, (str, bytes, dict)):
        try:
            items = list(value)
        except TypeError:  # not iterable, e.g. one int (or a 0-d array or tensor)
            pass
    if items is None:
        raise TypeError(f"{name} must be a list, each item {NAMES[kind]}; got {type(value).__name__} {value!r}")
    return [check(f"{name}[{i}]", item, kind, rule, allowed) for i, item in enumerate(items)]


def check_known_characters(tokenizer, prompt: str, token_ids: list[int]) -> None:
    """Reject characters the tokenizer can only map to its unknown token (small vocabularies)."""
    model = getattr(getattr(tokenizer, "backend_tokenizer", None), "model", None)
    unk = getattr(model, "unk_token", None) or tokenizer.unk_token
    unk_id = tokenizer.convert_tokens_to_ids(unk) if unk else None
    if unk_id is None or unk_id not in token_ids or unk in prompt:
        return
    unknown = sorted({c for c in prompt if unk_id in tokenizer.encode(c, add_special_tokens=False)})
    vocab = sorted(t for t in tokenizer.get_vocab() if len(t) == 1)
    raise ValueError(f"prompt has characters this model's tokenizer does not know: {''.join(unknown)!r}; "
                     f"it knows {''.join(vocab)!r}")
