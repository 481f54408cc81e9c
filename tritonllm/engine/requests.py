"""A request's bookkeeping: its n samples (one Sequence each), their text, and what each reported."""
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import xxhash

from tritonllm.engine.output import GenerationOutput, IncrementalText, RequestOutput
from tritonllm.engine.sequence import Sequence
from tritonllm.sampling_params import SamplingParams
from tritonllm.validation import as_int, check_known_characters


def request_id_list(request_id) -> list[int]:
    """abort's argument (one id from add_request, or an iterable of them, as vLLM's abort_request
    takes) as a list of ints; anything else is a TypeError rather than an id no request has."""
    one = as_int(request_id)
    if one is not None:
        return [one]
    ids = [as_int(i) for i in request_id] if isinstance(request_id, (list, tuple, set, frozenset, range)) else [None]
    if None in ids:
        raise TypeError(f"request_id must be an int from add_request or a list of them, got {request_id!r}")
    return ids


@dataclass
class Sample:
    request_id: int  # its Request's, by id: a reference back would make a cycle only the collector frees
    seq: Sequence
    index: int  # among the request's n samples
    text: IncrementalText | None  # decoded as tokens arrive (streamed, or checked for stop strings)
    num_emitted: int = 0  # completion tokens reported so far
    stopped_by_token: bool = False  # ended by EOS or a stop token (set by the engine where it finishes)

    def save(self) -> tuple:
        """What taking a sampled token changes, for restore() to put back if taking it fails midway."""
        seq = self.seq
        return (len(seq.token_ids), len(seq.logprobs), len(seq.top_logprobs), seq.finish_reason, seq.stop_reason,
                self.num_emitted, self.stopped_by_token, None if self.text is None else dict(vars(self.text)))

    def restore(self, saved: tuple) -> None:
        seq, (num_tokens, num_logprobs, num_top, *rest, text) = self.seq, saved
        seq.finish_reason, seq.stop_reason, self.num_emitted, self.stopped_by_token = rest
        seq.num_pending += len(seq.token_ids) - num_tokens
        del seq.token_ids[num_tokens:]
        for values, keep in ((seq.logprobs, num_logprobs), (seq.top_logprobs, num_top),
                             (seq.block_hashes, num_tokens // seq.block_size)):
            if len(values) > keep:  # else it may be a tuple (Sequence), with nothing to cut
                del values[keep:]
        if text is not None:
            vars(self.text).update(text)


@dataclass
class Request:
    """One prompt and its n samples. Sample 0 is queued first; the others wait until its prompt is
    computed and in the prefix cache (`num_queued`), so the prompt is prefilled once."""
    request_id: int
    samples: list[Sample]
    stream: bool  # report every step's tokens and text, or only the final outputs
    num_queued: int = 1
    num_finished: int = 0

    @property
    def unqueued(self) -> list[Sample]:
        return self.samples[self.num_queued:]


MORE_CACHE = "raise num_kv_blocks or gpu_memory_utilization"  # what mends a KV cache too small


def fit_length(params: SamplingParams, prompt_len: int, max_model_len: int, num_blocks: int, block_size: int,
               strict: bool) -> SamplingParams:
    """params for a prompt of prompt_len tokens (LLMEngine.make_sequence): params itself, or a copy where
    max_tokens is set or capped (params may be shared by other prompts).

    max_tokens None: as many as max_model_len and the KV cache leave (the last token's K/V is never
    computed). Past max_model_len, max_tokens is capped there, and a prompt of max_model_len tokens
    still gets one (vLLM's LLM); strict: a ValueError instead (the OpenAI servers'). A sequence the
    cache can never hold is a ValueError either way.
    """
    model_room = max_model_len - prompt_len
    if not strict and prompt_len == max_model_len:
        model_room = 1
    # OpenAI's words, which clients match to tell a prompt too long from other errors.
    limit = f"This model's maximum context length is {max_model_len} tokens (max_model_len)"
    if model_room < 1:
        raise ValueError(f"{limit}. However, the prompt has {prompt_len} tokens, which leaves no room for a completion")
    cache_room = num_blocks * block_size + 1 - prompt_len
    if cache_room < 1:  # the prompt's own K/V: no max_tokens would mend it, so none is named
        raise ValueError(f"prompt ({prompt_len} tokens) leaves no room for a completion in the KV cache of "
                         f"{num_blocks} blocks of {block_size} ({MORE_CACHE})")
    if params.max_tokens is None:
        room = min(model_room, cache_room)
        if strict and params.min_tokens > model_room:
            raise ValueError(f"{limit}. However, the prompt ({prompt_len} tokens) + SamplingParams.min_tokens "
                             f"({params.min_tokens}) = {prompt_len + params.min_tokens} exceed it")  # a server names the field
        if min(params.min_tokens, model_room) > cache_room:  # past max_model_len it is capped, as max_tokens is
            raise ValueError(f"prompt ({prompt_len} tokens) + SamplingParams.min_tokens ({params.min_tokens}) can never "
                             f"fit the KV cache of {num_blocks} blocks of {block_size} (lower min_tokens, or {MORE_CACHE})")
        params = dataclasses.replace(params, max_tokens=room, min_tokens=min(params.min_tokens, room))
    elif params.max_tokens > model_room:
        if strict:
            raise ValueError(f"{limit}. However, the prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) "
                             f"= {prompt_len + params.max_tokens} exceed it")
        params = dataclasses.replace(params, max_tokens=model_room, min_tokens=min(params.min_tokens, model_room))
    total = prompt_len + params.max_tokens
    if -(-(total - 1) // block_size) > num_blocks:
        raise ValueError(f"prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) can never fit the "
                         f"KV cache of {num_blocks} blocks of {block_size} ({total - 1} tokens' K/V; lower max_tokens, "
                         f"or {MORE_CACHE})")
    return params


PROMPT_KEYS = ("prompt", "prompt_token_ids")  # vLLM's TextPrompt and TokensPrompt dicts


def encode_prompt(prompt, tokenizer, vocab: int, add_special_tokens: bool = True) -> list[int]:
    """A prompt (a string, a sequence of token ids, or vLLM's {"prompt": text} or {"prompt_token_ids":
    ids}) as checked token ids (LLMEngine.encode)."""
    if isinstance(prompt, Mapping):
        if len(prompt) != 1 or next(iter(prompt)) not in PROMPT_KEYS:
            raise TypeError(f"a prompt dict holds one of the keys {PROMPT_KEYS}, got {sorted(map(str, prompt))}")
        text = prompt.get("prompt")
        if "prompt" in prompt and not isinstance(text, str):
            raise TypeError(f"a prompt dict's 'prompt' must be a string, got {type(text).__name__}")
        if text is None and isinstance(prompt["prompt_token_ids"], (str, Mapping)):  # text under the ids' key
            raise TypeError("a prompt dict's 'prompt_token_ids' must be a sequence of int token ids, got "
                            f"{type(prompt['prompt_token_ids']).__name__}")
        return encode_prompt(text if text is not None else prompt["prompt_token_ids"], tokenizer, vocab,
                             add_special_tokens)
    if isinstance(prompt, (bytes, bytearray, set, frozenset)):  # iterable, but not token ids
        raise TypeError(f"a prompt must be a string or a sequence of int token ids, got {type(prompt).__name__}")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("this model has no tokenizer: give prompts as lists of token ids")
        token_ids = tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        check_known_characters(tokenizer, prompt, token_ids)
    else:
        try:
            token_ids = [as_int(t) for t in prompt]
        except TypeError:  # not a sequence at all
            token_ids = [None]
        if None in token_ids:
            raise TypeError("a prompt must be a string or a sequence of int token ids, got "
                            f"{type(prompt).__name__} {prompt!r:.60}")
    if not token_ids:
        raise ValueError("prompt is empty: give at least one token")
    bad = [t for t in token_ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt token ids must be in [0, {vocab}), got {bad[:5]}")
    return token_ids


def checked_params(params: SamplingParams | None, defaults: dict, tokenizer, vocab: int, eos_ids: set[int],
                   max_model_len: int) -> SamplingParams:
    """A validated copy of params (fields may change after construction; None: SamplingParams(**defaults),
    vLLM's use of the checkpoint's generation_config), checked for what SamplingParams cannot check
    alone: stop strings need a tokenizer, token ids the vocabulary (min_tokens bans the stop ids by
    index), truncate_prompt_tokens max_model_len (vLLM refuses more), and min_tokens some token it
    lets be drawn."""
    if params is None:
        params = SamplingParams(**defaults)
    if not isinstance(params, SamplingParams):
        raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__} (add_request takes "
                        "(prompt, params, stream) and returns the request id it assigns)")
    params = dataclasses.replace(params)
    if params.stop and tokenizer is None:
        raise ValueError("SamplingParams.stop needs a tokenizer, and this model has none: use stop_token_ids")
    for name, ids in (("logit_bias", params.logit_bias), ("allowed_token_ids", params.allowed_token_ids),
                      ("stop_token_ids", params.stop_token_ids)):
        if ids and max(ids) >= vocab:
            raise ValueError(f"SamplingParams.{name} has token id {max(ids)}: must be in [0, {vocab})")
    if (params.truncate_prompt_tokens or 0) > max_model_len:
        raise ValueError(f"SamplingParams.truncate_prompt_tokens={params.truncate_prompt_tokens} is invalid: must be "
                         f"<= max_model_len ({max_model_len}), or -1 (max_model_len)")
    if not params.min_tokens:
        return params
    never_drawn = eos_ids | set(params.stop_token_ids)  # both in [0, vocab): checked above, eos_token_ids
    if params.allowed_token_ids and set(params.allowed_token_ids) <= never_drawn:
        raise ValueError(f"SamplingParams.allowed_token_ids={params.allowed_token_ids} holds only EOS and stop tokens, "
                         f"which min_tokens={params.min_tokens} keeps from being drawn")
    if len(never_drawn) >= vocab:
        raise ValueError(f"SamplingParams.stop_token_ids and EOS cover the whole vocabulary ({vocab} tokens), "
                         f"which min_tokens={params.min_tokens} keeps from being drawn")
    return params


def sample_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sample `index`'s params: a seed stream of its own, derived from (seed, index). Sample 0 keeps
    the seed, so it draws what the same request with n = 1 does."""
    if index == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=xxhash.xxh64_intdigest(f"{params.seed}/{index}".encode()) >> 2)


def make_request(seq: Sequence, stream: bool, tokenizer, silent: frozenset[int] = frozenset()) -> Request:
    """The request of a new sequence (sample 0): params.n samples of its prompt. `silent`: the
    tokenizer's silent_ids (output.py)."""
    params = seq.params
    seqs = [seq] + [Sequence(seq.token_ids, sample_params(params, i), seq.block_size) for i in range(1, params.n)]
    for other in seqs[1:]:
        other.prompt_logprobs = None  # the first sample scores the prompt for all
    with_text = tokenizer is not None and (stream or params.stop)
    samples = [Sample(seq.seq_id, s, i, IncrementalText(tokenizer, params.stop, params.min_tokens,
                                                        params.include_stop_str_in_output, params.skip_special_tokens,
                                                        silent) if with_text else None)
               for i, s in enumerate(seqs)]
    return Request(seq.seq_id, samples, stream)


def text_span(sample: Sample) -> tuple[int, int]:
    """Where in seq.token_ids the tokens its text is decoded from lie: the completion, less the EOS or
    stop token that ended it (as vLLM, it stays in token_ids but not in the text) unless
    include_stop_str_in_output."""
    seq = sample.seq
    dropped = sample.stopped_by_token and not seq.params.include_stop_str_in_output
    return seq.num_prompt_tokens, len(seq.token_ids) - dropped


def flush_text(sample: Sample) -> Sample:
    """An aborted sample's text decoded through its last complete character, as a finished one's
    last update decodes it (else a streamed sample, or one with stop strings, would end with the text
    of its last clean cut only: none while every token ends in part of a character)."""
    if sample.text is not None:
        start, end = text_span(sample)
        sample.text.update(sample.seq.token_ids, final=True, start=start, end=end)
    return sample


NO_SCORES = (None, None, None)


def prompt_scores(request: Request) -> tuple[list | None, list | None, list | None]:
    """The request's prompt_logprobs, prompt_top_logprobs and prompt_ranks (GenerationOutput's); None
    where not asked for, or while not all scored (an abort)."""
    seq = request.samples[0].seq
    if seq.prompt_logprobs is None or len(seq.prompt_logprobs) < seq.num_prompt_tokens - 1:
        return NO_SCORES
    top = [None] + seq.prompt_top_logprobs if seq.params.prompt_logprobs else None
    return [None] + seq.prompt_logprobs, top, [None] + seq.prompt_ranks


def min_tokens_bans(seqs: list[Sequence], eos_ids: set[int]) -> list[tuple[int, int]]:
    """The (row, token) pairs a step may not draw: a row short of its min_tokens draws neither EOS
    (even with ignore_eos) nor its stop tokens, whose logits are masked (vLLM's min_tokens)."""
    return [(row, token) for row, seq in enumerate(seqs)
            if seq.params.min_tokens and seq.num_completion_tokens < seq.params.min_tokens
            for token in seq.params.stop_token_ids + sorted(eos_ids)]


def finish_reason(sample: Sample, eos_ids: set[int], eos_id: int | None) -> str | None:
    """Whether the sample's last token finishes it (EOS or a stop token, a stop string, max_tokens),
    and why; sets what the final output reports with it (the model's EOS `eos_id` is no stop_reason)."""
    seq, params = sample.seq, sample.seq.params
    num_completion, token = seq.num_known_completion_tokens, seq.token_ids[-1]
    is_eos = not params.ignore_eos and token in eos_ids
    by_token = num_completion > params.min_tokens and (is_eos or token in params.stop_token_ids)
    reason = "stop" if by_token else None
    if by_token and not (is_eos and token == eos_id):  # vLLM checks the model's EOS first
        seq.stop_reason = token
    sample.stopped_by_token = by_token
    last = by_token or num_completion >= params.max_tokens
    matched = None
    if sample.text is not None:
        start, end = text_span(sample)
        matched = sample.text.update(seq.token_ids, final=last, start=start, end=end)
    if matched is not None:
        reason, seq.stop_reason = "stop", matched
    if reason is None and last:
        reason = "length"
    seq.finish_reason = reason
    return reason


def final_output(sample: Sample, tokenizer, prompt: tuple) -> GenerationOutput:
    seq, params = sample.seq, sample.seq.params
    if sample.text is not None:
        text = sample.text.text
    elif tokenizer is not None:
        start, end = text_span(sample)
        text = tokenizer.decode(seq.token_ids[start:end], skip_special_tokens=params.skip_special_tokens).rstrip("\ufffd")
    else:
        text = None
    return GenerationOutput(seq.token_ids[:seq.num_prompt_tokens], seq.completion_token_ids, text, seq.finish_reason,
                            seq.num_cached_tokens or 0, seq.logprobs if params.wants_logprobs else None,
                            seq.top_logprobs if params.num_top_logprobs else None, sample.index, seq.stop_reason, *prompt)


def step_output(request: Request, sample: Sample, finished: bool, tokenizer) -> RequestOutput:
    """The sample's tokens, text and logprobs since its last output; the final output if finished."""
    seq, params = sample.seq, sample.seq.params
    start = sample.num_emitted
    sample.num_emitted = seq.num_known_completion_tokens
    delta = sample.text.delta(finished) if request.stream and sample.text is not None else ""
    prompt = prompt_scores(request) if start == 0 or finished else NO_SCORES
    return RequestOutput(request.request_id, seq.token_ids[seq.num_prompt_tokens + start:], delta, finished,
                         final_output(sample, tokenizer, prompt) if finished else None, sample.index,
                         seq.logprobs[start:] if params.wants_logprobs else None,
                         seq.top_logprobs[start:] if params.num_top_logprobs else None,
                         *(prompt if start == 0 else NO_SCORES))
