"""What a request gives back: per-step outputs, the final output, and its text with stop strings."""
import math
from dataclasses import dataclass, fields


@dataclass
class GenerationOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]  # the completion (through the token that completed a stop string, if any)
    text: str | None  # None without a tokenizer (preset models); cut before a stop string
    finish_reason: str  # "stop" (EOS, a stop token or string), "length" (max_tokens) or "abort"
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    logprobs: list[float] | None = None  # the chosen tokens' (with params.logprobs or top_logprobs > 0)
    top_logprobs: list[dict[int, float]] | None = None  # per token, the top_logprobs likeliest: id -> logprob
    index: int = 0  # which of the request's n samples
    stop_reason: int | str | None = None  # the stop_token_ids entry or stop string that ended it; None for EOS
    # With params.prompt_logprobs (vLLM's), led by None, as the first prompt token has none: each prompt
    # token's logprob, and with prompt_logprobs > 0 the likeliest tokens at its position: id -> logprob;
    # each prompt token's rank there (the tokens at least as likely, itself included: vLLM v1's Logprob.rank).
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[dict[int, float] | None] | None = None
    prompt_ranks: list[int | None] | None = None

    @property
    def cumulative_logprob(self) -> float | None:
        """vLLM's: the sum of the chosen tokens' logprobs (None where logprobs were not asked for)."""
        return None if self.logprobs is None else math.fsum(self.logprobs)

    # out["text"], out["token_ids"]: the dict access of nano-vllm's outputs, whose keys are the fields.
    def keys(self) -> list[str]:
        return [f.name for f in fields(self)]

    def __getitem__(self, key: str):
        if key not in self.keys():
            raise KeyError(key)
        return getattr(self, key)

    def __contains__(self, key) -> bool:
        return key in self.keys()

    def get(self, key: str, default=None):
        return self[key] if key in self else default


@dataclass
class RequestOutput:
    """One sample's progress in one engine step (a request of n samples gives up to n per step)."""
    request_id: int
    new_token_ids: list[int]
    text_delta: str  # "" without a tokenizer, or while the new text could still start a stop string
    finished: bool  # this sample; the request is done when all of its samples are
    output: GenerationOutput | None = None  # set when finished
    index: int = 0  # which of the request's n samples
    new_logprobs: list[float] | None = None  # aligned with new_token_ids, when the output has logprobs
    new_top_logprobs: list[dict[int, float]] | None = None  # likewise, with params.top_logprobs > 0
    prompt_logprobs: list[float | None] | None = None  # as GenerationOutput's, in a sample's first output
    prompt_top_logprobs: list[dict[int, float] | None] | None = None
    prompt_ranks: list[int | None] | None = None


def tail_that_could_begin(text: str, strings: list[str], start: int = 0) -> int:
    """The length of the longest tail of `text` that begins one of `strings` and is shorter than it:
    what a stream holds back until the next piece shows whether that string follows. Only tails
    from `start` on are tried: where the longest such tail of a shorter text began, no longer one
    can begin earlier (so a long stop string costs its length once, not at every token)."""
    for k in range(min(len(text) - start, max(map(len, strings), default=1) - 1), 0, -1):
        tail = text[-k:]
        if any(s.startswith(tail) for s in strings):
            return k
    return 0


def silent_ids(tokenizer) -> frozenset[int]:
    """The tokenizer's special tokens that decode to no text when skipped (IncrementalText's silent_ids)."""
    return frozenset(i for i in tokenizer.all_special_ids if tokenizer.decode([i], skip_special_tokens=True) == "")


class IncrementalText:
    """A completion's text, decoded a few tokens at a time, and its stop strings.

    Each update decodes only the tokens since the last clean cut (a full decode each step would
    cost the whole length per token); a piece ending in a partial UTF-8 character waits for the
    next token, and is left out if none completes it (as vLLM leaves it). A stop string counts
    where it ends in text of tokens past the first `min_tokens` (earlier text is never checked, as
    in vLLM); `include_stop` keeps the stop string at the end of the text instead of cutting it.
    """

    def __init__(self, tokenizer, stop: list[str], min_tokens: int, include_stop: bool = False,
                 skip_special_tokens: bool = True, silent_ids: frozenset[int] = frozenset()):
        self.tokenizer, self.stop = tokenizer, stop
        self.include_stop, self.skip_special_tokens = include_stop, skip_special_tokens
        # Tokens that add no text wherever they stand (special ones, skipped): a run of them (EOS
        # under ignore_eos) is not decoded again at every token, only with the next other token.
        self.silent_ids = silent_ids if skip_special_tokens else frozenset()
        self.text = ""
        self.prefix = self.read = 0  # ids[prefix:read] decode to the tail of `text`
        self.silent_to = 0  # ids[read:silent_to] are all silent
        self.min_tokens = min_tokens
        self.stop_from = 0 if min_tokens == 0 else None  # where stop strings may end past
        self.searched = 0  # text before this has been searched for stop strings
        self.emitted = 0  # characters handed out as deltas

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, ids: list[int], final: bool = False, start: int = 0, end: int | None = None) -> str | None:
        """Decode the completion ids[start:end] (a sequence's tokens past its prompt, read in place:
        copying them each token would cost the whole length) past what is decoded already (all of
        it when final). Returns the stop string found, if any; the text is then cut before it (after
        it with include_stop)."""
        count = (len(ids) if end is None else end) - start
        new = range(start + max(self.read, self.silent_to), start + count)
        if not final and all(ids[i] in self.silent_ids for i in new):
            self.silent_to = count
        else:
            before = self._decode(ids[start + self.prefix:start + self.read])
            after = self._decode(ids[start + self.prefix:start + count])
            if final:
                after = after.rstrip("\ufffd")
            if len(after) > len(before) and (final or not after.endswith("\ufffd")):
                self.text += after[len(before):]
                self.prefix, self.read = self.read, count
        if self.stop_from is None and count >= self.min_tokens:
            self.stop_from = len(self.text)
        if self.stop_from is None or not self.stop:
            return None
        cut, matched = -1, None
        for stop in self.stop:  # the stop that ends first: as a stream of one character a token would find it
            i = self.text.find(stop, max(0, max(self.stop_from, self.searched) - len(stop) + 1))
            if i >= 0 and i + len(stop) > self.stop_from and (cut < 0 or (i + len(stop), i) < (cut + len(matched), cut)):
                cut, matched = i, stop
        self.searched = len(self.text)
        if cut >= 0:
            self.text = self.text[:cut + len(matched) if self.include_stop else cut]
        return matched

    def delta(self, finished: bool) -> str:
        """The text not handed out yet; until finished it stops short of any tail that could still be
        the start of a stop string, so that the deltas always add up to the final text."""
        end = len(self.text)
        if not finished:
            end -= self._held()
        piece = self.text[self.emitted:end]
        self.emitted = max(self.emitted, end)
        return piece

    def _held(self) -> int:
        """The tail that could still begin a stop string (none is held when the stop string stays in
        the text)."""
        return 0 if self.include_stop else tail_that_could_begin(self.text, self.stop, self.emitted)
