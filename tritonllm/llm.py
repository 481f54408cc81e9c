"""The public API: LLM(model).generate / stream / chat."""
import os
import random
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch.multiprocessing as mp
from tqdm.auto import tqdm
from transformers import AutoTokenizer, GenerationConfig

from tritonllm.config import EngineConfig
from tritonllm.distributed import free_port
from tritonllm.engine.block_manager import BlockManager
from tritonllm.engine.model_runner import ModelRunner
from tritonllm.engine.scheduler import Scheduler
from tritonllm.engine.sequence import Sequence
from tritonllm.loader import load_config, safetensors_files
from tritonllm.sampling_params import SamplingParams


@dataclass
class GenerationOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]  # the completion
    text: str | None  # None without a tokenizer (preset models)
    finish_reason: str  # "stop" or "length"
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    logprobs: list[float] | None = None

    def __getitem__(self, key: str):
        """out["text"], out["token_ids"]: the dict access of nano-vllm's outputs."""
        return getattr(self, key)


@dataclass
class StreamOutput:
    index: int  # position of the request in the prompts given
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    output: GenerationOutput | None = field(default=None)  # set when finished


def _worker(config: EngineConfig, hf_config, rank: int, init_method: str) -> None:
    ModelRunner(config, hf_config, rank, init_method).worker_loop()


def _shut_down(runner: ModelRunner, workers: list) -> None:
    """Stop the workers (killed if they do not exit within 30 s) and leave the process group."""
    runner.shutdown(peers_alive=all(p.is_alive() for p in workers))
    for process in workers:
        process.join(timeout=30)
        if process.is_alive():
            process.kill()


class LLM:
    """An offline engine for one model. `model`: a checkpoint folder or a preset name (load_format="dummy").

    Options (all named; see EngineConfig): tensor_parallel_size, dtype, device, max_model_len,
    max_num_seqs, max_num_batched_tokens, kv_block_size, num_kv_blocks, gpu_memory_utilization,
    enforce_eager, load_format, seed, kernels.
    """

    def __init__(self, model: str, **options):
        self.config = config = EngineConfig.from_options(str(model), **options)
        self.hf_config = hf_config = load_config(config.model)
        if not Path(config.model).is_dir() and config.load_format != "dummy":
            raise ValueError(f"preset {config.model!r} has no weights: pass load_format='dummy'")
        if config.load_format == "auto":
            safetensors_files(Path(config.model))  # no weights: an error before anything is allocated
        config.resolve(hf_config)
        self.tokenizer = None
        if Path(config.model).is_dir() and any((Path(config.model) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
            self.tokenizer = AutoTokenizer.from_pretrained(config.model, trust_remote_code=False)
        self.eos_ids = self._eos_ids()
        self._workers = []
        rank, init_method = int(os.environ.get("RANK", 0)), None
        if config.tensor_parallel_size > 1 and "RANK" not in os.environ:
            init_method = f"tcp://127.0.0.1:{free_port()}"
            context = mp.get_context("spawn")
            for worker_rank in range(1, config.tensor_parallel_size):
                process = context.Process(target=_worker, args=(config, hf_config, worker_rank, init_method), daemon=True)
                process.start()
                self._workers.append(process)
        try:
            self.runner = ModelRunner(config, hf_config, rank, init_method)
        except BaseException:  # the workers would wait for rank 0 forever
            for process in self._workers:
                process.kill()
            raise
        if rank > 0:  # under torchrun: serve rank 0 until it shuts down
            self.runner.worker_loop()
            return
        self.block_manager = BlockManager(self.runner.num_kv_blocks, config.kv_block_size)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens, self.eos_ids)
        self.rng = random.Random(config.seed)
        self._in_flight = None  # the launched step whose sampled tokens are not resolved yet
        # Runs on close(), when the LLM is garbage-collected, or at interpreter exit, whichever is first;
        # it holds the runner and workers, not the LLM, so `del llm` frees it.
        self._finalizer = weakref.finalize(self, _shut_down, self.runner, self._workers)

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

    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: give prompts as lists of token ids")
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = list(prompt)
        if not token_ids:
            raise ValueError("prompt is empty: give at least one token")
        vocab = self.hf_config.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be ints in [0, {vocab}), got {bad[:5]}")
        return token_ids

    def _make_sequences(self, prompts, sampling_params) -> list[Sequence]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params has {len(params)} entries for {len(prompts)} prompts")
        seqs = []
        for prompt, p in zip(prompts, params):
            if not isinstance(p, SamplingParams):
                raise TypeError(f"sampling_params must be SamplingParams, got {type(p).__name__}")
            token_ids = self._encode(prompt)
            total = len(token_ids) + p.max_tokens
            if total > self.config.max_model_len:
                raise ValueError(f"prompt ({len(token_ids)} tokens) + max_tokens ({p.max_tokens}) exceeds max_model_len={self.config.max_model_len}")
            if -(-total // self.config.kv_block_size) > len(self.block_manager.blocks):
                raise ValueError(f"a request of {total} tokens can never fit the KV cache of {len(self.block_manager.blocks)} blocks of {self.config.kv_block_size}")
            seqs.append(Sequence(token_ids, p, self.config.kv_block_size))
        return seqs

    # ---- the step loop

    def _seed(self, seq: Sequence) -> int:
        if seq.params.seed is None:
            return self.rng.getrandbits(62)
        return (seq.params.seed * 0x9E3779B97F4A7C15 + seq.num_completion_tokens) % (1 << 62)

    def _step(self):
        """Launch the next step, then bring in the previous step's sampled tokens while the GPU runs
        this one, so the GPU does not wait on Python between steps. Returns (sequences that got a
        token, tokens the launched step computes, whether it is a prefill)."""
        self._check_workers()
        seqs, num_new, is_prefill = self.scheduler.schedule()
        if not seqs and self._in_flight is None:
            raise RuntimeError("the scheduler found nothing to run: the KV cache is too small for the waiting requests")
        launched = None
        try:
            if seqs:
                sampled = self.runner.launch(seqs, num_new, is_prefill, [self._seed(seq) for seq in seqs])
                rows = self.scheduler.launched(seqs, num_new)
                launched = (rows, sampled) if sampled is not None else None
            resolved = self._resolve(self._in_flight)
        except RuntimeError:  # a collective fails when a worker dies in it: name the worker
            self._check_workers(wait=1.0)
            raise
        self._in_flight = launched
        return resolved, sum(num_new) if is_prefill else len(seqs), is_prefill

    def _check_workers(self, wait: float = 0.0) -> None:
        """Raise if a tensor-parallel worker has exited (within `wait` seconds each): a collective with
        a dead rank would wait forever."""
        for process in self._workers if wait else ():
            process.join(wait)
        dead = [(rank, p.exitcode) for rank, p in enumerate(self._workers, start=1) if not p.is_alive()]
        if dead:
            raise RuntimeError(f"tensor-parallel worker(s) exited: {', '.join(f'rank {r} (exit code {c})' for r, c in dead)}")

    def _resolve(self, in_flight) -> list[Sequence]:
        """Wait for a launched step's sampled tokens and hand them to the scheduler."""
        if in_flight is None:
            return []
        rows, sampled = in_flight
        token_ids, logprobs = sampled.result(self._check_workers if self._workers else None)
        resolved = self.scheduler.resolve(rows, token_ids)
        if logprobs is not None:
            by_seq = {seq.seq_id: lp for (seq, _), lp in zip(rows, logprobs)}
            for seq in resolved:
                if seq.params.logprobs:
                    seq.logprobs.append(by_seq[seq.seq_id])
        return resolved

    def _text(self, seq: Sequence) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(seq.completion_token_ids, skip_special_tokens=True)

    def _check_stop_strings(self, seq: Sequence, text: str | None) -> str | None:
        """Finish seq at the first stop string in its text; returns the text cut before it."""
        if text is None or not seq.params.stop or len(seq.completion_token_ids) <= seq.params.min_tokens:
            return text
        cut = min((i for i in (text.find(s) for s in seq.params.stop) if i >= 0), default=-1)
        if cut < 0:
            return text
        if seq.finish_reason is None:
            self.scheduler.finish(seq, "stop")
        seq.finish_reason = "stop"
        return text[:cut]

    def _output(self, seq: Sequence, text: str | None) -> GenerationOutput:
        return GenerationOutput(seq.token_ids[:seq.num_prompt_tokens], seq.completion_token_ids, text,
                                seq.finish_reason, seq.num_cached_tokens, seq.logprobs if seq.params.logprobs else None)

    def stream(self, prompts, sampling_params=None) -> Iterator[StreamOutput]:
        """Yield each request's new tokens and text as they are generated; the last yield has the output."""
        seqs = self._make_sequences(prompts, sampling_params)
        index = {seq.seq_id: i for i, seq in enumerate(seqs)}
        texts = {seq.seq_id: "" for seq in seqs}
        emitted = {seq.seq_id: 0 for seq in seqs}
        for seq in seqs:
            self.scheduler.add(seq)
        pending = len(seqs)
        while pending:
            sampled, _, _ = self._step()
            for seq in sampled:
                text = self._check_stop_strings(seq, self._text(seq))
                is_done = seq.finish_reason is not None
                delta = ""
                if text is not None and (is_done or not text.endswith("\ufffd")):  # hold back a partial character
                    delta, texts[seq.seq_id] = text[len(texts[seq.seq_id]):], text
                known = seq.completion_token_ids
                new = known[emitted[seq.seq_id]:]
                emitted[seq.seq_id] = len(known)
                pending -= is_done
                yield StreamOutput(index[seq.seq_id], new, delta, is_done, self._output(seq, text) if is_done else None)

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True) -> list[GenerationOutput]:
        """Complete every prompt (strings or token-id lists); outputs in the order of the prompts."""
        seqs = self._make_sequences(prompts, sampling_params)  # validate everything before any work
        for seq in seqs:
            self.scheduler.add(seq)
        outputs: dict[int, GenerationOutput] = {}
        bar = tqdm(total=len(seqs), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        rates = {True: 0.0, False: 0.0}
        while len(outputs) < len(seqs):
            start = time.perf_counter()
            sampled, num_tokens, is_prefill = self._step()
            rates[is_prefill] = num_tokens / max(time.perf_counter() - start, 1e-9)
            for seq in sampled:
                if seq.params.stop or seq.finish_reason is not None:
                    text = self._check_stop_strings(seq, self._text(seq))
                    if seq.finish_reason is not None:
                        outputs[seq.seq_id] = self._output(seq, text)
                        bar.update(1)
            bar.set_postfix(prefill=f"{rates[True]:.0f}tok/s", decode=f"{rates[False]:.0f}tok/s")
        bar.close()
        return [outputs[seq.seq_id] for seq in seqs]

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True) -> list[GenerationOutput]:
        """Generate replies to one conversation (a list of {"role", "content"}) or a list of them."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in conversations]
        prompts = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        return self.generate(prompts, sampling_params, use_tqdm)

    def close(self) -> None:
        """Stop the tensor-parallel workers and leave the process group; also done by `del` and at exit."""
        finalizer = getattr(self, "_finalizer", None)  # absent if __init__ failed, or on ranks > 0
        if finalizer is not None:
            finalizer()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
