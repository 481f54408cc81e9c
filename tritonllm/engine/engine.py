"""The engine: requests in, one step at a time, outputs out (add_request / step / abort).

Each step launches the next batch on the device and then brings in the previous step's sampled
tokens while the device runs, so the device does not wait on Python between steps. That
launched-but-unresolved step is the engine's one piece of in-flight state (`InFlight`).
"""
import random
import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import AutoTokenizer

from tritonllm.config import EngineConfig
from tritonllm.distributed import dp_group
from tritonllm.engine.block_manager import BlockManager
from tritonllm.engine.output import RequestOutput, silent_ids
from tritonllm.engine.prompt_logprobs import PromptSpan, add_prompt_logprobs, prompt_logprob_spans
from tritonllm.engine.ranks import abandon, check_ranks, shut_down, start_runner
from tritonllm.engine.requests import (Request, Sample, checked_params, encode_prompt, finish_reason, fit_length,
                                      flush_text, make_request, min_tokens_bans, request_id_list, step_output)
from tritonllm.engine.sampled_tokens import SampledTokens
from tritonllm.engine.scheduler import ScheduledBatch, Scheduler
from tritonllm.engine.sequence import Sequence, SequenceStatus
from tritonllm.engine.step_inputs import build_step_inputs
from tritonllm.loader import eos_token_ids, has_tokenizer, load_config, load_generation_config
from tritonllm.sampling_params import SamplingParams, generation_defaults
from tritonllm.validation import check


@dataclass
class InFlight:
    """A launched step whose results are not on the host yet: a sampled row per sampling sequence
    (samples None if none samples), and the prompt positions it scored, if any."""
    seqs: list[Sequence]
    samples: SampledTokens | None
    prompt_spans: list[PromptSpan]
    prompt_scores: SampledTokens | None

    def rows(self) -> dict[int, int]:
        return {seq.seq_id: row for row, seq in enumerate(self.seqs)}


class LLMEngine:
    """One model and its requests. Thread-safe: calls from several threads are serialized."""

    SERVES_REPLICAS = False  # whether the class deals work out to data-parallel replicas (LLM does)

    def __init__(self, model: str, *, share_stop=None, **options):
        """share_stop: on a data-parallel replica that rank 0 spawned, the shared byte telling it to drop
        its share of a generate (ranks.start_ranks); passed by the engine, not by callers."""
        self.config = config = EngineConfig.from_options(model, **options)
        if config.data_parallel_size > 1 and not self.SERVES_REPLICAS:
            raise ValueError(f"data_parallel_size={config.data_parallel_size} needs tritonllm.LLM, whose generate deals "
                             f"prompts out to the replicas; {type(self).__name__} runs one replica (data_parallel_size=1)")
        self.hf_config = hf_config = load_config(config.model)
        config.resolve(hf_config)
        self.tokenizer, self.silent_ids = None, frozenset()
        if has_tokenizer(config.model):
            self.tokenizer = AutoTokenizer.from_pretrained(config.model, trust_remote_code=False)
            self.silent_ids = silent_ids(self.tokenizer)
        generation = load_generation_config(config.model)
        self.eos_id, self.eos_ids = eos_token_ids(config.model, hf_config, self.tokenizer, generation)
        self.sampling_defaults = generation_defaults(generation)  # for requests without SamplingParams
        self.runner, self._workers, self._rank_errors, share_stop = start_runner(type(self), model, options, config,
                                                                                 hf_config, share_stop)
        if self.runner.rank > 0:  # a spawned or torchrun worker: serve its replica's rank 0 until it shuts down
            self.runner.worker_loop()
            return
        # Data-parallel replicas: rank 0 hands out prompts, the other leaders serve it (LLM).
        group = dp_group()
        self.dp_rank = 0 if group is None else torch.distributed.get_rank(group)
        self.dp_size = config.data_parallel_size
        self.share_stop = share_stop
        self.block_manager = BlockManager(self.runner.num_kv_blocks, config.kv_block_size)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        # Requests without a seed draw one from here: each replica its own stream (replica 0's as with one).
        self.rng = random.Random(config.seed if self.dp_rank == 0 else f"{config.seed}/{self.dp_rank}")
        self._broken: str | None = None  # why this engine can no longer serve
        self._lock = threading.RLock()
        self._requests: dict[int, Request] = {}  # the unfinished ones
        self._samples: dict[int, Sample] = {}  # seq_id -> the unfinished sample
        self._counters = dict.fromkeys(("prompt_tokens", "generation_tokens", "prefill_tokens", "unqueued"), 0)
        # Outputs for the next step to return: aborted requests' final ones, and those a failed step made.
        self._pending: list[RequestOutput] = []
        self._in_flight: InFlight | None = None
        self._busy, self._after_step = False, []  # inside step() or after_step work; work deferred to its end
        # The live requests that the step which just raised had launched or in flight (empty if it
        # failed before launching): those a server fails with it.
        self.failed_request_ids: set[int] = set()
        self.last_step = None  # the last step's (tokens computed, is_prefill, seconds); None if it launched nothing
        # Runs on close(), when the engine is garbage-collected, or at interpreter exit, whichever is
        # first; it holds the runner and workers, not the engine, so `del llm` frees it.
        self._finalizer = weakref.finalize(self, shut_down, self.runner, self._workers,
                                           self.dp_rank == 0 and self.dp_size > 1)

    # ---- requests

    def encode(self, prompt, add_special_tokens: bool = True) -> list[int]:
        """A prompt (a string, or a sequence of token ids) as checked token ids; a string gets the
        tokenizer's special tokens (a BOS, for tokenizers that add one) unless add_special_tokens
        is false."""
        return encode_prompt(prompt, self.tokenizer, self.hf_config.vocab_size, add_special_tokens)

    def add_request(self, prompt, params: SamplingParams | None = None, stream: bool = True) -> int:
        """Queue a prompt (a string or token ids) for params.n samples; returns its request id.
        `stream`: step() reports each sample's new tokens and text; otherwise only final outputs."""
        return self.queue(self.make_sequence(prompt, params), stream)

    def make_sequence(self, prompt, params: SamplingParams | None = None, *, strict_length: bool = False) -> Sequence:
        """The checked, not yet queued, request: prompt encoded, params validated and copied (fields may
        change after construction), length checked. As vLLM's LLM, max_tokens is capped where the sequence
        reaches max_model_len (finish "length"; a prompt of that length still gets one token); strict_length
        refuses it instead, as the OpenAI servers do."""
        return self._sequence(prompt, self._checked_params(params), strict_length)

    def _checked_params(self, params: SamplingParams | None) -> SamplingParams:
        self._check_open()
        return checked_params(params, self.sampling_defaults, self.tokenizer, self.hf_config.vocab_size, self.eos_ids,
                              self.config.max_model_len)

    def _sequence(self, prompt, params: SamplingParams, strict_length: bool = False) -> Sequence:
        """make_sequence, of params from _checked_params: prompts may share them (fit_length copies what it sets)."""
        token_ids = self.encode(prompt)
        if params.truncate_prompt_tokens is not None:  # the last k (vLLM's; -1: max_model_len)
            token_ids = token_ids[-(self.config.max_model_len if params.truncate_prompt_tokens == -1
                                    else params.truncate_prompt_tokens):]
        block_size = self.config.kv_block_size
        params = fit_length(params, len(token_ids), self.config.max_model_len, len(self.block_manager.blocks),
                            block_size, strict_length)
        return Sequence(token_ids, params, block_size)

    def queue(self, seq: Sequence, stream: bool = True) -> int:
        """Queue a sequence from make_sequence as sample 0 of its request; returns the request id."""
        request = make_request(seq, check("stream", stream, bool), self.tokenizer, self.silent_ids)
        with self._lock:
            self._requests[request.request_id] = request
            self._samples.update((sample.seq.seq_id, sample) for sample in request.samples)
            self._counters["prompt_tokens"] += seq.num_prompt_tokens
            self._counters["unqueued"] += len(request.unqueued)
            self.scheduler.add(seq)
        return request.request_id

    def _queue_samples(self, seqs: list[Sequence]) -> None:
        """Queue samples 1..n-1 of the requests whose sample 0 just launched the end of its prompt: they
        hit its full blocks (registered at launch) and compute only the last partial block, each
        sampling its first token."""
        for seq in seqs:
            request = self._requests[self._samples[seq.seq_id].request_id]
            if request.unqueued:
                self._counters["unqueued"] -= len(request.unqueued)
                self.scheduler.add_first([sample.seq for sample in request.unqueued])
                request.num_queued = len(request.samples)

    def abort(self, request_id: int | list[int]) -> None:
        """Stop a request's samples (or those of a list of requests) now and free their blocks (cached
        prefix blocks stay reusable); valid at any moment, a no-op for a request that has finished or is
        unknown. The next step() reports each unfinished sample finished, with finish_reason "abort"."""
        ids = request_id_list(request_id)
        self.after_step(lambda: self._abort(ids))

    def _abort(self, request_ids: list[int]) -> None:
        stopped, queued = [], []  # every sample first, then the outputs (which decode text)
        for request_id in request_ids:
            request = self._requests.pop(request_id, None)
            if request is None:
                continue
            self._counters["unqueued"] -= len(request.unqueued)
            for sample in request.samples:
                if self._samples.pop(sample.seq.seq_id, None) is None:
                    continue
                stopped.append((request, sample))
                if sample.index < request.num_queued:
                    queued.append(sample.seq)
                else:
                    sample.seq.finish_reason, sample.seq.status = "abort", SequenceStatus.FINISHED
        self.scheduler.finish(queued, "abort")
        self._pending += [step_output(request, flush_text(sample), True, self.tokenizer) for request, sample in stopped]

    def after_step(self, work) -> None:
        """Run work() now, or, when this thread is inside a step or another such work, once that ends:
        an abort from a stream that the garbage collector closed midway must not change the queues and
        outputs that the interrupted code is changing."""
        with self._step_scope():  # the outermost scope runs the queue at its end
            self._after_step.append(work)

    @contextmanager
    def _step_scope(self):
        """The lock for a step (or an after_step work), and the work deferred during it run at its end,
        still inside the scope, so that work deferred by those runs after them (once, if nested)."""
        with self._lock:
            if self._busy:
                yield
                return
            self._busy = True
            try:
                yield
            finally:
                try:
                    while self._after_step:
                        self._after_step.pop(0)()
                finally:
                    self._busy = False

    def has_unfinished(self) -> bool:
        """Whether step() has more to do or to report: unfinished requests, or outputs it has not returned
        (never once closed: the requests it held went with it)."""
        return self._finalizer.alive and bool(self._requests or self._pending)

    # ---- the step

    def step(self) -> list[RequestOutput]:
        """Launch the next step, then resolve the previous one: outputs of the requests that got a
        token (streamed ones each time, the others when they finish) and of those aborted since."""
        with self._step_scope():
            start = time.perf_counter()
            self.failed_request_ids = set()
            self._check_open()
            self._check_workers()
            batch = self.scheduler.schedule()
            if batch is None and self._in_flight is None and not self.scheduler.is_finished():
                raise RuntimeError("the scheduler found nothing to run: the KV cache is too small for the waiting requests")
            outputs, self._pending = self._pending, []
            if batch is None and self._in_flight is None:
                return outputs
            previous = self._in_flight
            try:
                self._in_flight = self._launch(batch) if batch is not None else None
                self._resolve(previous, outputs)
            except BaseException as error:
                # The outputs made so far report tokens the requests keep: the next step returns them.
                # Whatever was in flight is lost: every live request is recomputed from its known tokens.
                held = (batch.seqs if batch is not None else []) + (previous.seqs if previous is not None else [])
                self.failed_request_ids = {self._samples[seq.seq_id].request_id for seq in held
                                           if seq.seq_id in self._samples}
                self._pending = outputs
                self._in_flight = None
                self.scheduler.recompute_all()
                self.runner.penalties.reset()  # the counts may hold tokens the host never got
                if self.runner.stranded:
                    self._finalizer.detach()
                    abandon(self.runner, self._workers)
                    self._broken = (f"a step failed on rank 0 ({type(error).__name__}) while the tensor-parallel ranks "
                                    "ran it, and they cannot be brought back in step")
                elif isinstance(error, RuntimeError) and self._workers:  # a collective failed: name a dead worker
                    self._check_workers(wait=1.0)
                raise
            self.last_step = (batch.num_tokens, batch.is_prefill, time.perf_counter() - start) if batch else None
            return outputs

    def stats(self) -> dict[str, int]:
        """Counters for monitoring (a server's /metrics): sequences running and waiting (samples not
        yet queued included), KV blocks free and in all, requests unfinished, preemptions, and totals
        since start of prompt tokens added (once per request), tokens computed by prefill (prefix
        cache hits excluded, recomputation included) and tokens generated. No lock, no device sync."""
        return {"num_running_seqs": len(self.scheduler.running),
                "num_waiting_seqs": len(self.scheduler.waiting) + self._counters["unqueued"],
                "num_free_kv_blocks": self.block_manager.num_free_blocks, "num_kv_blocks": len(self.block_manager.blocks),
                "num_unfinished_requests": len(self._requests), "num_preemptions": self.scheduler.num_preemptions,
                "prompt_tokens_total": self._counters["prompt_tokens"],
                "prefill_tokens_total": self._counters["prefill_tokens"],
                "generation_tokens_total": self._counters["generation_tokens"]}

    def _seed(self, seq: Sequence) -> int:
        if seq.params.seed is None:
            return self.rng.getrandbits(62)
        return (seq.params.seed * 0x9E3779B97F4A7C15 + seq.num_completion_tokens) % (1 << 62)

    def _launch(self, batch: ScheduledBatch) -> InFlight | None:
        previous = self._in_flight
        spans = prompt_logprob_spans(batch) if batch.is_prefill else []
        gather, graphs = self.config.prefill_gather_blocks, self.runner.prefill_graphs
        if gather and batch.is_prefill and graphs and graphs.holds(batch.num_tokens, len(batch.seqs)):
            gather = 0  # an fp8 cache's step that a graph holds reads the cache in place
        inputs = build_step_inputs(batch, previous.rows() if previous else {}, self.config.kv_block_size, gather, spans)
        seqs = batch.sampling_seqs
        samples, scores = self.runner.launch(inputs, seqs, [self._seed(seq) for seq in seqs],
                                             min_tokens_bans(seqs, self.eos_ids),
                                             previous.samples.ids if previous and previous.samples else None)
        self.scheduler.launched(batch)
        if batch.is_prefill:
            # Registered at launch: written before any later step reads them, so a prompt admitted next hits them.
            for seq in batch.seqs:
                self.block_manager.register_computed_blocks(seq)
            self._counters["prefill_tokens"] += batch.num_tokens
            self._queue_samples(seqs)
        return InFlight(seqs, samples, spans, scores) if samples is not None or scores is not None else None

    def _check_open(self) -> None:
        if self._broken:
            raise RuntimeError(f"this LLM can no longer serve: {self._broken}; make a new one")
        if not self._finalizer.alive:  # its workers and process group are gone
            raise RuntimeError("this LLM is closed (close(), or the end of its with block): make a new one")

    def _check_workers(self, wait: float = 0.0) -> None:
        check_ranks(self._workers, self._rank_errors, wait)

    def _resolve(self, in_flight: InFlight | None, outputs: list[RequestOutput]) -> None:
        """Bring in a launched step's prompt scores and sampled tokens, appending the outputs they make to
        `outputs` (one at a time: a failure midway keeps those made); rows of sequences that finished
        since are dropped."""
        if in_flight is None:
            return
        check = self._check_workers if self._workers else None
        if in_flight.prompt_scores is not None:  # a step's prompt scores come before its samples
            add_prompt_logprobs(in_flight.prompt_spans, *in_flight.prompt_scores.result(check))
        if in_flight.samples is None:
            return
        token_ids, logprobs, top = in_flight.samples.result(check)
        for row, (seq, token) in enumerate(zip(in_flight.seqs, token_ids)):
            if seq.is_finished:
                continue
            sample = self._samples[seq.seq_id]
            request = self._requests[sample.request_id]
            params, saved = seq.params, sample.save()
            try:  # all of a token or none of it: undone, it is sampled again after the recompute
                seq.append_token(token)
                if params.wants_logprobs:
                    seq.logprobs.append(logprobs[row])
                if k := params.num_top_logprobs:
                    seq.top_logprobs.append(dict(zip(top[1][row][:k], top[0][row][:k])))
                self.block_manager.register_computed_blocks(seq)
                reason = finish_reason(sample, self.eos_ids, self.eos_id)
                output = (step_output(request, sample, reason is not None, self.tokenizer)
                          if reason is not None or request.stream else None)
            except BaseException:
                sample.restore(saved)
                raise
            self._counters["generation_tokens"] += 1
            if reason is not None:
                self._finish(request, sample, reason)
            if output is not None:
                outputs.append(output)

    def _finish(self, request: Request, sample: Sample, reason: str) -> None:
        """A sample done with its last token: its blocks freed, its request forgotten with its last sample."""
        self.scheduler.finish([sample.seq], reason)
        del self._samples[sample.seq.seq_id]
        request.num_finished += 1
        if request.num_finished == len(request.samples):
            del self._requests[request.request_id]

    def close(self) -> None:
        """Free the weights and the KV cache, stop the parallel workers and leave the process group; also
        done by `del`, at exit and at the end of a `with` block."""
        finalizer = getattr(self, "_finalizer", None)  # absent if __init__ failed, or on ranks > 0
        if finalizer is not None:
            finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
