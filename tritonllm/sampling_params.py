from dataclasses import dataclass


@dataclass
class SamplingParams:
    """How to sample one request's completion; validated on construction.

    temperature 0 is greedy. top_k 0 and top_p 1 and min_p 0 turn those filters off. Generation
    stops at max_tokens, at any EOS id of the model (unless ignore_eos), at stop_token_ids or at a
    stop string (cut from the text); none of these before min_tokens. seed makes the request's
    draws reproducible whatever else runs beside it. logprobs returns each chosen token's
    log-probability under the model's raw distribution.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    logprobs: bool = False

    def __post_init__(self):
        def check(ok: bool, field: str, allowed: str):
            if not ok:
                raise ValueError(f"SamplingParams.{field}={getattr(self, field)!r} is invalid: {allowed}")

        for field in ("temperature", "top_p", "min_p"):
            if isinstance(getattr(self, field), bool) or not isinstance(getattr(self, field), (int, float)):
                raise TypeError(f"SamplingParams.{field} must be a number, got {type(getattr(self, field)).__name__}")
        for field in ("top_k", "max_tokens", "min_tokens"):
            if isinstance(getattr(self, field), bool) or not isinstance(getattr(self, field), int):
                raise TypeError(f"SamplingParams.{field} must be an int, got {type(getattr(self, field)).__name__}")
        check(self.temperature >= 0, "temperature", "must be >= 0 (0 = greedy)")
        check(self.top_k >= 0, "top_k", "must be >= 0 (0 = off)")
        check(0 < self.top_p <= 1, "top_p", "must be in (0, 1] (1 = off)")
        check(0 <= self.min_p <= 1, "min_p", "must be in [0, 1] (0 = off)")
        check(self.max_tokens >= 1, "max_tokens", "must be >= 1")
        check(0 <= self.min_tokens <= self.max_tokens, "min_tokens", f"must be in [0, max_tokens={self.max_tokens}]")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        self.stop_token_ids = list(self.stop_token_ids or [])
        check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be token ids >= 0")
        check(self.seed is None or isinstance(self.seed, int), "seed", "must be an int or None")
