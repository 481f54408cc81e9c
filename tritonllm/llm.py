"""The offline API: LLM(model).generate / stream / chat, thin loops over the engine's steps."""
import threading
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import torch
from tqdm.auto import tqdm

from tritonllm.chat import chat_prompt, text_message
from tritonllm.distributed import collect, hand_out, interrupt_after
from tritonllm.engine.engine import LLMEngine
from tritonllm.engine.output import GenerationOutput, RequestOutput
from tritonllm.engine.sequence import Sequence
from tritonllm.sampling_params import SamplingParams
from tritonllm.validation import as_int


@dataclass
class StreamOutput:
    index: int  # position of the output in generate's list: the prompt's, or with n samples, prompt-major
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    output: GenerationOutput | None = field(default=None)  # set when finished
    new_logprobs: list[float] | None = None  # aligned with new_token_ids (params.logprobs or top_logprobs)
    new_top_logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[float | None] | None = None  # with params.prompt_logprobs: in a sample's first output
    prompt_top_logprobs: list[dict[int, float] | None] | None = None
    prompt_ranks: list[int | None] | None = None


class LLM(LLMEngine):
    """An offline engine for one model. `model`: a checkpoint folder or a preset name (random weights).

    Options (all named; see EngineConfig): tensor_parallel_size, data_parallel_size, dtype, device,
    max_model_len, max_num_seqs, max_num_batched_tokens, kv_block_size, num_kv_blocks,
    gpu_memory_utilization, enforce_eager, load_format, seed, kernels, kv_cache_dtype.

    With data_parallel_size D > 1 the engine runs D replicas, each tensor_parallel_size ranks wide:
    generate (and chat) deal the prompts out round-robin and return the outputs in input order;
    stream and the step API run on replica 0. The other replicas' leaders serve rank 0 inside
    LLM(...) until it closes (under torchrun too).

    generate, stream and chat may be nested (a generate inside a stream loop) and called from
    several threads: each loop gets its own requests' outputs. A loop left early (a break, an
    exception, Ctrl-C, a closed stream) aborts its unfinished requests. The step API works beside
    them: step() returns the outputs of requests no loop follows, those made inside a loop included.
    """

    SERVES_REPLICAS = True

    def __init__(self, model: str, **options):
        super().__init__(model, **options)
        self._owners: dict[int, deque] = {}  # request id -> the output queue of the loop that follows it
        self._unowned: list[RequestOutput] = []  # outputs no loop follows, for the next step() call
        self._dealing = threading.Lock()  # one data-parallel generate at a time: its scatter and gather pair up
        if getattr(self, "dp_rank", 0) > 0:
            self._serve_replica()
        elif getattr(self, "dp_size", 1) > 1:
            try:  # every replica built: one that failed to load is an error here, not at the first generate
                collect(None)
            except BaseException:
                try:
                    self._check_workers(wait=1.0)  # names the rank that died
                finally:
                    self.close()
                raise

    def _serve_replica(self) -> None:
        """A replica leader other than rank 0: generate the prompts rank 0 hands out, send back the
        outputs (or the error), until it says stop; then close."""
        collect(True)  # built
        while (work := hand_out()) is not None:
            try:
                result = self._generate(self._sequences(*work), use_tqdm=False)
            except Exception as error:  # rank 0 raises it; this replica keeps serving
                result = error
            collect(result)
        self.close()

    def _sequences(self, prompts, sampling_params) -> list[Sequence]:
        """Every prompt with its params, checked (make_sequence), not yet queued. The prompts given one
        SamplingParams share one checked copy: with its two lists, three objects less each for Python's
        full garbage collections to walk."""
        prompts = _prompt_list(prompts)
        params = _params_list(sampling_params, len(prompts))
        copies, seqs = {}, []
        for prompt, p in zip(prompts, params):
            if id(p) not in copies:
                copies[id(p)] = self._checked_params(p)
            seqs.append(self._sequence(prompt, copies[id(p)]))
        return seqs

    def _add(self, seqs: list[Sequence], stream: bool) -> tuple[dict[int, tuple[int, int]], deque]:
        """Queue the sequences from _sequences. Returns request id -> (the position of its sample 0 in
        the flat, prompt-major list of every prompt's n outputs, n), and the queue that gets their outputs."""
        requests, queue, total = {}, deque(), 0
        with self._lock:  # owned before any step (of another thread) can make an output
            for seq in seqs:
                request_id = self.queue(seq, stream)
                self._owners[request_id] = queue
                requests[request_id] = (total, seq.params.n)
                total += seq.params.n
        return requests, queue

    def step(self) -> list[RequestOutput]:
        """LLMEngine.step beside the loops: outputs of requests a loop follows go to that loop; the
        rest are returned, with those of earlier steps that loops made."""
        with self._lock:
            self._step_and_route()
            outputs, self._unowned = self._unowned, []
            return outputs

    def has_unfinished(self) -> bool:
        return super().has_unfinished() or (bool(self._unowned) and self._finalizer.alive)

    def _step_and_route(self) -> None:
        with self._step_scope():  # a loop left during the step lets go of its requests after the routing
            for output in super().step():
                self._owners.get(output.request_id, self._unowned).append(output)

    def _follow(self, requests: dict[int, tuple[int, int]], queue: deque,
                after_each_step: Callable[[], None] | None = None) -> Iterator[RequestOutput]:
        """Outputs of `requests` (from _add) as the engine makes them, stepping it while none are
        queued (after_each_step runs after each step). However the loop ends, its unfinished
        requests are aborted and forgotten."""
        live = {request_id: n for request_id, (_, n) in requests.items()}
        try:
            while live:
                if not queue:
                    if self.dp_rank > 0 and self.share_stop is not None and self.share_stop.value:
                        raise RuntimeError("rank 0 left this generate: the replica dropped its share")
                    self._step_and_route()
                    if after_each_step is not None:
                        after_each_step()
                    continue
                output = queue.popleft()
                if output.finished:
                    live[output.request_id] -= 1
                    if not live[output.request_id]:
                        del live[output.request_id]
                yield output
        finally:
            self.after_step(lambda: self._let_go(requests, live))

    def _let_go(self, requests: dict[int, tuple[int, int]], live: dict[int, int]) -> None:
        """A loop's end (an after_step work): its requests unowned, the unfinished ones aborted, their
        abort outputs dropped."""
        for request_id in requests:
            self._owners.pop(request_id, None)
        self._abort([request_id for request_id in requests if request_id in live])
        self._pending = [output for output in self._pending if output.request_id not in requests]

    def stream(self, prompts, sampling_params=None) -> Iterator[StreamOutput]:
        """Yield each request's new tokens and text as they are generated; the last yield has the output.
        Bad prompts or params raise at the call; the requests are queued when the iteration starts."""
        return self._stream(self._sequences(prompts, sampling_params))

    def _stream(self, seqs: list[Sequence]) -> Iterator[StreamOutput]:
        requests, queue = self._add(seqs, stream=True)
        for out in self._follow(requests, queue):
            yield StreamOutput(requests[out.request_id][0] + out.index, out.new_token_ids, out.text_delta, out.finished,
                               out.output, out.new_logprobs, out.new_top_logprobs, out.prompt_logprobs,
                               out.prompt_top_logprobs, out.prompt_ranks)

    def generate(self, prompts, sampling_params=None, use_tqdm: bool | Callable = True) -> list[GenerationOutput]:
        """Complete every prompt (strings or token-id lists); outputs in the order of the prompts, a
        prompt's n samples (SamplingParams.n) one after another, in the order of their index. With
        data parallelism prompt i goes to replica i % D; the bar follows replica 0's share. use_tqdm:
        whether to show a progress bar, or a callable that makes it (tqdm's arguments; vLLM's)."""
        if not (isinstance(use_tqdm, bool) or callable(use_tqdm)):
            raise TypeError("use_tqdm must be a bool or a callable that makes a tqdm bar, got "
                            f"{type(use_tqdm).__name__}")
        if self.dp_size == 1:
            return self._generate(self._sequences(prompts, sampling_params), use_tqdm)
        prompts = _prompt_list(prompts)
        params = _params_list(sampling_params, len(prompts))
        seqs = self._sequences(prompts, params)  # every error here, before any replica starts
        dealt = self.dp_size
        # Each hand_out pairs with one collect, which the replicas wait in: Ctrl-C (twice, even) is held
        # where it could come between them.
        with self._dealing:
            try:
                with interrupt_after():
                    hand_out([None] + [(prompts[r::dealt], params[r::dealt]) for r in range(1, dealt)])
                mine = self._generate(seqs[::dealt], use_tqdm)
            except BaseException:
                if self.share_stop is not None:  # the others drop their shares rather than finish them
                    self.share_stop.value = 1
                raise
            finally:
                with interrupt_after():
                    results = collect(None)
                    if self.share_stop is not None:
                        self.share_stop.value = 0
        results[0] = mine
        for result in results:
            if isinstance(result, Exception):
                raise result
        queues = [deque(result) for result in results]
        return [queues[i % dealt].popleft() for i, seq in enumerate(seqs) for _ in range(seq.params.n)]

    def _generate(self, seqs: list[Sequence], use_tqdm: bool | Callable) -> list[GenerationOutput]:
        """generate on this replica alone, of the sequences from _sequences."""
        requests, queue = self._add(seqs, stream=False)
        outputs: dict[int, GenerationOutput] = {}
        rates = {True: 0.0, False: 0.0}
        total = sum(n for _, n in requests.values())
        make_bar = use_tqdm if callable(use_tqdm) else tqdm
        with make_bar(total=total, desc="Generating", dynamic_ncols=True, disable=not use_tqdm) as bar:
            def show_rates():  # every step's rate: a step that finishes a request has launched the next one
                if self.last_step is not None:
                    num_tokens, is_prefill, seconds = self.last_step
                    rates[is_prefill] = num_tokens / max(seconds, 1e-9)
                    bar.set_postfix(prefill=f"{rates[True]:.0f}tok/s", decode=f"{rates[False]:.0f}tok/s",
                                    refresh=False)
                    bar.update(0)  # redrawn at most every bar.mininterval
            for out in self._follow(requests, queue, show_rates if use_tqdm else None):
                outputs[requests[out.request_id][0] + out.index] = out.output
                bar.update(1)
        return [outputs[i] for i in range(total)]

    def get_tokenizer(self):
        """The model's tokenizer (None for a model without one), as vLLM's LLM.get_tokenizer() returns it."""
        return self.tokenizer

    def chat(self, messages, sampling_params=None, use_tqdm: bool | Callable = True, stream: bool = False, *,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
             tools: list[dict] | None = None):
        """Replies to one conversation (a list of {"role", "content"}, content a string or OpenAI text
        parts) or a list of them, through the
        tokenizer's chat template: GenerationOutputs, or with stream=True the StreamOutputs of stream().
        The keywords are vLLM's (tritonllm.chat.chat_prompt), e.g. chat_template_kwargs={"enable_thinking": False};
        tools (OpenAI's function tools) go to the template, the replies stay text."""
        one = isinstance(messages, list) and bool(messages) and isinstance(messages[0], dict)
        conversations = [messages] if one else messages
        if not isinstance(conversations, list) or not all(isinstance(c, list) for c in conversations):
            raise TypeError("messages must be a list of {'role', 'content'} dicts or a list of such lists, "
                            f"got {type(messages).__name__}")
        conversations = [[text_message(m, f"messages[{i}]" if one else f"messages[{j}][{i}]") for i, m in enumerate(c)]
                         for j, c in enumerate(conversations)]
        prompts = [chat_prompt(self.tokenizer, c, add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message, chat_template=chat_template,
                               chat_template_kwargs=chat_template_kwargs, tools=tools) for c in conversations]
        encoded = [self.encode(p, add_special_tokens=False) for p in prompts]  # the template holds the special tokens
        if stream:
            return self.stream(encoded, sampling_params)
        return self.generate(encoded, sampling_params, use_tqdm)


def _params_list(sampling_params, count: int) -> list:
    """sampling_params as one entry (SamplingParams or None) per prompt, checked."""
    params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * count
    if len(params) != count:
        raise ValueError(f"sampling_params has {len(params)} entries for {count} prompts")
    for p in params:
        if p is not None and not isinstance(p, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(p).__name__}")
    return params


def _prompt_list(prompts) -> list:
    """prompts as a list of prompts: one string, one token-id list or one prompt dict counts as a single prompt."""
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    if not isinstance(prompts, (list, tuple, np.ndarray, torch.Tensor)) or getattr(prompts, "ndim", 1) == 0:
        raise TypeError(f"prompts must be a string, a list of token ids, a prompt dict or a list of those; "
                        f"got {type(prompts).__name__}")
    if len(prompts) and as_int(prompts[0]) is not None:  # one prompt of token ids
        return [prompts]
    return list(prompts)
