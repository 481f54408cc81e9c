"""The engine: requests in, one step at a time, outputs out (add_request / step / abort).

Each step launches the next batch on the device and then brings in the previous step's sampled
tokens while the device runs, so the device does not wait on Python between steps. That
launched-but-unresolved step is the engine's one piece of in-flight state (`InFlight`).
"""
import dataclasses
import os
import random
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch.multiprocessing as mp
from transformers import AutoTokenizer, GenerationConfig

from tritonllm.config import EngineConfig
from tritonllm.distributed import free_port
from tritonllm.engine.block_manager import BlockManager
from tritonllm.engine.model_runner import ModelRunner, SampledTokens
from tritonllm.engine.output import GenerationOutput, IncrementalText, RequestOutput
from tritonllm.engine.scheduler import ScheduledBatch, Scheduler
from tritonllm.engine.sequence import Sequence
from tritonllm.engine.step_inputs import build_step_inputs
from tritonllm.loader import load_config
from tritonllm.sampling_params import SamplingParams
from tritonllm.validation import as_int


@dataclass
class InFlight:
    """A launched step whose sampled tokens are not on the host yet: one row per sampling sequence."""
    seqs: list[Sequence]
    samples: SampledTokens

    def rows(self) -> dict[int, int]:
        return {seq.seq_id: row for row, seq in enumerate(self.seqs)}


@dataclass
class Request:
    seq: Sequence
    text: IncrementalText | None  # decoded as tokens arrive (streamed, or checked for stop strings)
    stream: bool  # report every step's tokens and text, or only the final output
    num_emitted: int = 0  # completion tokens reported so far


def _worker(config: EngineConfig, hf_config, rank: int, init_method: str, started) -> None:
    started.set()
    ModelRunner(config, hf_config, rank, init_method).worker_loop()


def _shut_down(runner: ModelRunner, workers: list) -> None:
    """Stop the workers (killed if they do not exit within 30 s) and leave the process group."""
    runner.shutdown(peers_alive=all(p.is_alive() for p in workers))
    for process in workers:
        process.join(timeout=30)
        if process.is_alive():
            process.kill()


class LLMEngine:
    """One model and its requests. Thread-safe: calls from several threads are serialized."""

    def __init__(self, model: str, **options):
        self.config = config = EngineConfig.from_options(model, **options)
        self.hf_config = hf_config = load_config(config.model)
        config.resolve(hf_config)
        self.tokenizer = None
        if Path(config.model).is_dir() and any((Path(config.model) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
            self.tokenizer = AutoTokenizer.from_pretrained(config.model, trust_remote_code=False)
        self.eos_ids = self._eos_ids()
        self._workers = []
        rank, init_method = int(os.environ.get("RANK", 0)), None
        try:
            if config.tensor_parallel_size > 1 and "RANK" not in os.environ:
                init_method = f"tcp://127.0.0.1:{free_port()}"
                self._start_workers(init_method)
            self.runner = ModelRunner(config, hf_config, rank, init_method)
        except BaseException:  # the workers would wait for rank 0 forever
            for process in self._workers:
                process.kill()
            raise
        if rank > 0:  # under torchrun: serve rank 0 until it shuts down
            self.runner.worker_loop()
            return
        self.block_manager = BlockManager(self.runner.num_kv_blocks, config.kv_block_size)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.rng = random.Random(config.seed)
        self._lock = threading.RLock()
        self._requests: dict[int, Request] = {}
        self._aborted: list[RequestOutput] = []  # the final outputs of aborted requests, for the next step
        self._in_flight: InFlight | None = None
        self.last_step = None  # the last step's (tokens computed, is_prefill, seconds); None if it launched nothing
        # Runs on close(), when the engine is garbage-collected, or at interpreter exit, whichever is
        # first; it holds the runner and workers, not the engine, so `del llm` frees it.
        self._finalizer = weakref.finalize(self, _shut_down, self.runner, self._workers)

    def _start_workers(self, init_method: str) -> None:
        """Spawn ranks 1..N-1 and wait until each runs: a rank that dies while starting (as when the
        script lacks its main guard and the spawned rank re-runs it) is an error, not a hang."""
        context = mp.get_context("spawn")
        started = [context.Event() for _ in range(1, self.config.tensor_parallel_size)]
        for rank, event in enumerate(started, start=1):
            process = context.Process(target=_worker, args=(self.config, self.hf_config, rank, init_method, event), daemon=True)
            process.start()
            self._workers.append(process)
        for rank, (event, process) in enumerate(zip(started, self._workers), start=1):
            while not event.wait(0.05):
                if not process.is_alive():
                    raise RuntimeError(
                        f"tensor-parallel worker rank {rank} exited while starting (exit code {process.exitcode}). "
                        "Workers are spawned and import the main module again: a script that makes a "
                        "tensor-parallel LLM must do so under `if __name__ == \"__main__\":`.")

    def _eos_ids(self) -> set[int]:
        ids = set()
        sources = [self.hf_config]
        if Path(self.config.model, "generation_config.json").exists():
            sources.append(GenerationConfig.from_pretrained(self.config.model))
        for source in sources:
            eos = getattr(source, "eos_token_id", None)
            ids.update([eos] if isinstance(eos, int) else eos or [])
        return ids

    # ---- requests

    def encode(self, prompt) -> list[int]:
        """A prompt (a string, or a sequence of token ids) as checked token ids."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: give prompts as lists of token ids")
            token_ids = self.tokenizer.encode(prompt)
            self.check_known_characters(prompt, token_ids)
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
        vocab = self.hf_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab}), got {bad[:5]}")
        return token_ids

    def check_known_characters(self, prompt: str, token_ids: list[int]) -> None:
        """Reject characters the tokenizer can only map to its unknown token (small vocabularies)."""
        model = getattr(getattr(self.tokenizer, "backend_tokenizer", None), "model", None)
        unk = getattr(model, "unk_token", None) or self.tokenizer.unk_token
        unk_id = self.tokenizer.convert_tokens_to_ids(unk) if unk else None
        if unk_id is None or unk_id not in token_ids or unk in prompt:
            return
        unknown = sorted({c for c in prompt if unk_id in self.tokenizer.encode(c, add_special_tokens=False)})
        vocab = sorted(t for t in self.tokenizer.get_vocab() if len(t) == 1)
        raise ValueError(f"prompt has characters this model's tokenizer does not know: {''.join(unknown)!r}; "
                         f"it knows {''.join(vocab)!r}")

    def add_request(self, prompt, params: SamplingParams | None = None, stream: bool = True) -> int:
        """Queue a prompt (a string or token ids); returns its request id. `stream`: step() reports
        each new token and piece of text; otherwise only the final output."""
        return self.queue(self.make_sequence(prompt, params), stream)

    def make_sequence(self, prompt, params: SamplingParams | None = None) -> Sequence:
        """The checked, not yet queued, request: its prompt encoded, its params validated and copied
        (fields may have changed since construction) and its length checked."""
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        params = dataclasses.replace(params)
        token_ids = self.encode(prompt)
        total = len(token_ids) + params.max_tokens
        if total > self.config.max_model_len:
            raise ValueError(f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                             f"max_model_len={self.config.max_model_len}")
        num_blocks = len(self.block_manager.blocks)
        if -(-total // self.config.kv_block_size) > num_blocks:
            raise ValueError(f"a request of {total} tokens can never fit the KV cache of {num_blocks} blocks "
                             f"of {self.config.kv_block_size}")
        return Sequence(token_ids, params, self.config.kv_block_size)

    def queue(self, seq: Sequence, stream: bool = True) -> int:
        """Queue a sequence from make_sequence; returns its request id."""
        text = None
        if self.tokenizer is not None and (stream or seq.params.stop):
            text = IncrementalText(self.tokenizer, seq.params.stop, seq.params.min_tokens)
        with self._lock:
            self._requests[seq.seq_id] = Request(seq, text, stream)
            self.scheduler.add(seq)
        return seq.seq_id

    def abort(self, request_id: int) -> None:
        """Stop a request now and free its blocks (cached prefix blocks stay reusable); valid at any
        moment, a no-op for a request that has finished or is unknown. The next step() reports it
        finished, with finish_reason "abort"."""
        with self._lock:
            request = self._requests.pop(request_id, None)
            if request is not None:
                self.scheduler.finish(request.seq, "abort")
                self._aborted.append(RequestOutput(request_id, [], "", True, self._final_output(request)))

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    # ---- the step

    def step(self) -> list[RequestOutput]:
        """Launch the next step, then resolve the previous one: outputs of the requests that got a
        token (streamed ones each time, the others when they finish) and of those aborted since."""
        with self._lock:
            start = time.perf_counter()
            outputs, self._aborted = self._aborted, []
            self._check_workers()
            batch = self.scheduler.schedule()
            if batch is None and self._in_flight is None:
                if not self.scheduler.is_finished():
                    raise RuntimeError("the scheduler found nothing to run: the KV cache is too small for the waiting requests")
                return outputs
            try:
                launched = self._launch(batch) if batch is not None else None
                previous, self._in_flight = self._in_flight, launched
                outputs += self._resolve(previous)
            except BaseException as error:
                # Whatever was in flight is lost: every live request is recomputed from its known tokens.
                self._in_flight = None
                self.scheduler.recompute_all()
                if isinstance(error, RuntimeError) and self._workers:  # a collective failed: name a dead worker
                    self._check_workers(wait=1.0)
                raise
            self.last_step = (batch.num_tokens, batch.is_prefill, time.perf_counter() - start) if batch else None
            return outputs

    def _seed(self, seq: Sequence) -> int:
        if seq.params.seed is None:
            return self.rng.getrandbits(62)
        return (seq.params.seed * 0x9E3779B97F4A7C15 + seq.num_completion_tokens) % (1 << 62)

    def _launch(self, batch: ScheduledBatch) -> InFlight | None:
        previous = self._in_flight
        inputs = build_step_inputs(batch, previous.rows() if previous else {}, self.config.kv_block_size)
        seqs = batch.sampling_seqs
        samples = self.runner.launch(inputs, seqs, [self._seed(seq) for seq in seqs],
                                     previous.samples.ids if previous else None)
        self.scheduler.launched(batch)
        return InFlight(seqs, samples) if samples is not None else None

    def _check_workers(self, wait: float = 0.0) -> None:
        """Raise if a tensor-parallel worker has exited (within `wait` seconds each): a collective with
        a dead rank would wait forever."""
        for process in self._workers if wait else ():
            process.join(wait)
        dead = [(rank, p.exitcode) for rank, p in enumerate(self._workers, start=1) if not p.is_alive()]
        if dead:
            raise RuntimeError(f"tensor-parallel worker(s) exited: {', '.join(f'rank {r} (exit code {c})' for r, c in dead)}")

    def _resolve(self, in_flight: InFlight | None) -> list[RequestOutput]:
        """Bring in a launched step's sampled tokens; rows of sequences that finished since are dropped."""
        if in_flight is None:
            return []
        token_ids, logprobs = in_flight.samples.result(self._check_workers if self._workers else None)
        outputs = []
        for row, (seq, token) in enumerate(zip(in_flight.seqs, token_ids)):
            if seq.is_finished:
                continue
            seq.append_token(token)
            if logprobs is not None and seq.params.logprobs:
                seq.logprobs.append(logprobs[row])
            self.block_manager.register_computed_blocks(seq)
            output = self._advance(self._requests[seq.seq_id])
            if output is not None:
                outputs.append(output)
        return outputs

    def _advance(self, request: Request) -> RequestOutput | None:
        """The one place a request finishes: EOS or a stop token, a stop string, max_tokens."""
        seq, params = request.seq, request.seq.params
        completion = seq.completion_token_ids
        token = completion[-1]
        reason = None
        if len(completion) > params.min_tokens and (token in params.stop_token_ids
                                                    or (not params.ignore_eos and token in self.eos_ids)):
            reason = "stop"
        last = reason is not None or len(completion) >= params.max_tokens
        if request.text is not None and request.text.update(completion, final=last):
            reason = "stop"
        if reason is None and last:
            reason = "length"
        if reason is not None:
            del self._requests[seq.seq_id]
            self.scheduler.finish(seq, reason)
        elif not request.stream:
            return None
        new_tokens, request.num_emitted = completion[request.num_emitted:], len(completion)
        delta = request.text.delta(reason is not None) if request.stream and request.text is not None else ""
        output = self._final_output(request) if reason is not None else None
        return RequestOutput(seq.seq_id, new_tokens, delta, reason is not None, output)

    def _final_output(self, request: Request) -> GenerationOutput:
        seq = request.seq
        if request.text is not None:
            text = request.text.text
        else:
            text = self.tokenizer.decode(seq.completion_token_ids, skip_special_tokens=True) if self.tokenizer else None
        return GenerationOutput(seq.token_ids[:seq.num_prompt_tokens], seq.completion_token_ids, text,
                                seq.finish_reason, seq.num_cached_tokens, seq.logprobs if seq.params.logprobs else None)

    def close(self) -> None:
        """Stop the tensor-parallel workers and leave the process group; also done by `del` and at exit."""
        finalizer = getattr(self, "_finalizer", None)  # absent if __init__ failed, or on ranks > 0
        if finalizer is not None:
            finalizer()
