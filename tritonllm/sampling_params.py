import math
from dataclasses import dataclass
from functools import partial

from tritonllm.kernels.logprobs import MAX_TOP_LOGPROBS
from tritonllm.validation import as_int, check, check_field, check_list

TEMPERATURE_FLOOR = 0.01  # a temperature in (0, TEMPERATURE_FLOOR) is taken as TEMPERATURE_FLOOR


@dataclass
class SamplingParams:
    """How to sample one request's completion; validated on construction.

    temperature 0 is greedy; one in (0, 0.01) is taken as 0.01 (vLLM's). top_k 0 (or vLLM's -1) and top_p 1 and
    min_p 0 turn those filters off (applied in that order, as vLLM's V0 sampler: V1 applies min_p first).
    Generation stops at max_tokens, at any EOS id of the model (unless ignore_eos), at stop_token_ids or at a
    stop string (cut from the text); none of these before min_tokens (EOS and the stop tokens are not drawn,
    their logits masked; a stop string counts past their text). seed makes the request's draws reproducible
    whatever else runs beside it, up to the last-bit float differences its batch makes in the logits (None, or
    vLLM's -1: drawn afresh). logprobs returns each chosen token's
    log-probability under the model's raw distribution; as an int k (vLLM's form, where None is off) it also
    returns the k most likely tokens a step, as top_logprobs = k does (num_top_logprobs). The text leaves out special tokens unless skip_special_tokens is false, and
    the stop string or stop token that ended it unless include_stop_str_in_output (vLLM's two flags; the text of
    a special token, such as EOS, stays only where skip_special_tokens is false too). logit_bias (OpenAI's) adds a bias in [-100, 100] to a token id's logit before the penalties and
    every filter (logprobs stay those of the raw distribution); allowed_token_ids (vLLM's) are the only tokens
    that may be drawn (the others' logits -inf; logprobs again raw). prompt_logprobs k (vLLM's) returns each
    prompt token's log-probability given the tokens before it and its rank there (none for the first), and with
    k > 0 the k likeliest tokens at each prompt position; such a prompt is computed in full, never served from
    the prefix cache. truncate_prompt_tokens k (vLLM's) keeps a prompt's last k tokens (k at most
    max_model_len, checked when the request is added; -1: as many as max_model_len).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    max_tokens: int | None = 16  # None: as many as the model's length and the KV cache leave (vLLM's None)
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    logprobs: bool | int | None = False
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    top_logprobs: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    prompt_logprobs: int | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Check every field and normalize in place (numbers to float or int, stop to a list). The engine
        runs it again when a request is added, as fields may change after construction; idempotent."""
        field = partial(check_field, self, prefix="SamplingParams.")
        # The sampler scales float32 logits by 1 / t: past 2**126 that is no normal float32 (at inf, 0 x -inf = NaN).
        field("temperature", float, lambda t: 0 <= t <= 2.0**126, "in [0, 8.5e37] (0 = greedy)")
        if 0 < self.temperature < TEMPERATURE_FLOOR:  # vLLM's floor: a request ported from vLLM samples the same
            self.temperature = TEMPERATURE_FLOOR
        field("top_k", int, lambda k: k >= -1, ">= 0 (0 = off; vLLM's -1 too)")
        self.top_k = max(self.top_k, 0)
        field("top_p", float, lambda p: 0 < p <= 1, "in (0, 1] (1 = off)")
        field("min_p", float, lambda p: 0 <= p <= 1, "in [0, 1] (0 = off)")
        field("max_tokens", int, lambda n: n >= 1, ">= 1", optional=True)
        most = math.inf if self.max_tokens is None else self.max_tokens
        field("min_tokens", int, lambda n: 0 <= n <= most, f"in [0, max_tokens={self.max_tokens}]")
        field("ignore_eos", bool)
        field("seed", int, optional=True)  # any int: the engine mixes it into 62 bits
        if self.seed == -1:  # vLLM's "no seed"
            self.seed = None
        field("top_logprobs", int, lambda k: 0 <= k <= MAX_TOP_LOGPROBS, f"in [0, {MAX_TOP_LOGPROBS}] (0 = off)")
        # vLLM's logprobs: None (off) or k, the chosen token's logprob and the k most likely; kept as given,
        # so that changing it later (p.logprobs = False) means what it says.
        if self.logprobs is None:
            self.logprobs = False
        if as_int(self.logprobs) is not None:
            self.logprobs = check("SamplingParams.logprobs", self.logprobs, int, lambda k: 0 <= k <= MAX_TOP_LOGPROBS,
                                  f"a bool, None, or an int k in [0, {MAX_TOP_LOGPROBS}] (vLLM's: top_logprobs = k)")
            if self.top_logprobs not in (0, self.logprobs):
                raise ValueError(f"SamplingParams.logprobs={self.logprobs} and top_logprobs={self.top_logprobs} "
                                 "disagree: give one")
        else:
            try:
                field("logprobs", bool)
            except TypeError:
                raise TypeError(f"SamplingParams.logprobs must be a bool, None, or an int k in [0, {MAX_TOP_LOGPROBS}]; "
                                f"got {type(self.logprobs).__name__} {self.logprobs!r}") from None
        field("n", int, lambda n: 1 <= n <= 128, "in [1, 128]")
        field("presence_penalty", float, lambda p: -2 <= p <= 2, "in [-2, 2] (0 = off)")
        field("frequency_penalty", float, lambda p: -2 <= p <= 2, "in [-2, 2] (0 = off)")
        # The kernels scale float32 logits by it: outside float32's normal range it would be 0 or inf.
        field("repetition_penalty", float, lambda p: 2.0**-126 <= p <= 3.4e38, "> 0 and a normal float32, in "
              "[1.2e-38, 3.4e38] (1 = off)")
        field("prompt_logprobs", int, lambda k: 0 <= k <= MAX_TOP_LOGPROBS,
              f"in [0, {MAX_TOP_LOGPROBS}] (None = off; 0 = the prompt tokens' own)", optional=True)
        field("truncate_prompt_tokens", int, lambda k: k >= 1 or k == -1, ">= 1, or -1 (max_model_len)",
              optional=True)
        field("skip_special_tokens", bool)
        field("include_stop_str_in_output", bool)
        self.logit_bias = _checked_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = check_list("SamplingParams.allowed_token_ids", self.allowed_token_ids, int,
                                                lambda t: t >= 0, ">= 0")
            if not self.allowed_token_ids:
                raise ValueError("SamplingParams.allowed_token_ids=[] is invalid: must hold a token id (None = all)")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = check_list("SamplingParams.stop", self.stop, str, bool, "a non-empty string")
        # Token ids of numpy or torch (e.g. from a tokenizer's tensors) become ints.
        self.stop_token_ids = check_list("SamplingParams.stop_token_ids", self.stop_token_ids, int, lambda t: t >= 0, ">= 0")

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def num_top_logprobs(self) -> int:
        """The likeliest tokens returned a step: top_logprobs, or vLLM's int logprobs."""
        return self.top_logprobs or (0 if isinstance(self.logprobs, bool) else self.logprobs)

    @property
    def wants_logprobs(self) -> bool:
        """Whether the chosen tokens' logprobs are returned (logprobs True or an int, or top_logprobs > 0)."""
        return self.logprobs is not False or self.top_logprobs > 0


GENERATION_CONFIG_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_defaults(generation_config) -> dict:
    """The sampling fields a checkpoint's generation_config sets apart from HF's defaults (None: no
    generation_config.json). vLLM samples with them where a request leaves the field out (Qwen3's:
    temperature 0.6, top_k 20, top_p 0.95); checked here as SamplingParams would check them."""
    if generation_config is None:
        return {}
    diff = generation_config.to_diff_dict()
    defaults = {name: diff[name] for name in GENERATION_CONFIG_FIELDS if diff.get(name) is not None}
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as error:
        raise ValueError(f"generation_config.json: {error}") from None
    return defaults


def _checked_bias(bias) -> dict[int, float] | None:
    """logit_bias as {token id: float bias} (None when empty); token ids checked against the
    vocabulary when the request is added."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise TypeError(f"SamplingParams.logit_bias must be a dict of token id -> bias, got {type(bias).__name__}")
    return {check("SamplingParams.logit_bias (a token id)", token, int, lambda t: t >= 0, ">= 0"):
            check(f"SamplingParams.logit_bias[{token!r}]", value, float, lambda b: -100 <= b <= 100, "in [-100, 100]")
            for token, value in bias.items()} or None
