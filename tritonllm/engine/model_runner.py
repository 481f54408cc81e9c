"""One rank's model: weights, KV cache, forward, CUDA graphs, sampling.

Rank 0 gets each step's inputs from the engine and broadcasts them; every rank runs the same
forward on its shards; rank 0 samples. Ranks > 0 sit in `worker_loop` until told to exit.
"""
import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from tritonllm.config import EngineConfig
from tritonllm.context import Context, set_context
from tritonllm.distributed import (all_reduce, broadcast, broadcast_object, close_distributed, init_distributed,
                                   interrupt_after, tp_rank)
from tritonllm.engine.penalties import PenaltyRows, add_logit_bias
from tritonllm.engine.graphs import DecodeGraphs, PrefillGraphs
from tritonllm.engine.prompt_logprobs import score_positions
from tritonllm.engine.sampled_tokens import SampledTokens, agreeing_top
from tritonllm.engine.sequence import Sequence
from tritonllm.engine.step_inputs import StepInputs
from tritonllm.engine.warmup import compile_sampler, prefill_warmup_steps, split_lengths
from tritonllm.layers.attention import Attention, allocate_kv_caches, kv_bytes_per_token
from tritonllm.layers.ops import backend
from tritonllm.loader import build_model, init_dummy_weights, load_weights

CPU_KV_CACHE_BYTES = 1 << 30


class ModelRunner:
    def __init__(self, config: EngineConfig, hf_config, rank: int, init_method: str | None):
        self.config, self.hf_config = config, hf_config
        self.world_size = config.tensor_parallel_size
        self.device = init_distributed(rank, self.world_size * config.data_parallel_size, config.device, init_method,
                                       self.world_size)
        self.rank = tp_rank()  # within the replica: rank 0 samples and drives the others
        self.ops = backend(config.kernels)
        torch.manual_seed(config.seed)
        self.model = build_model(hf_config, config.dtype, self.device, config.kernels)
        if config.load_format == "dummy":
            init_dummy_weights(self.model, config.seed)
        else:
            load_weights(self.model, config.model)
        self.block_size = config.kv_block_size
        self.max_blocks_per_seq = -(-config.max_model_len // self.block_size)
        if self.device.type == "cuda" and self.rank == 0:
            # Before the KV cache is sized: its scratch is gone by then.
            compile_sampler(self.ops, config.max_num_seqs, hf_config.vocab_size, config.dtype, self.device)
        self.decode_graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None  # short prefill steps' graphs
        # The references index with boolean masks, which syncs the host: they cannot be captured.
        self.use_graphs = self.device.type == "cuda" and not config.enforce_eager and config.kernels == "triton"
        if self.use_graphs:  # their buffers before the KV cache is sized, which counts them
            self.decode_graphs = DecodeGraphs(self._forward, config.max_num_seqs, self.max_blocks_per_seq,
                                              config.max_model_len, hf_config.hidden_size, config.dtype, self.device)
            self.prefill_graphs = PrefillGraphs(self._forward, config.max_num_batched_tokens, config.max_num_seqs,
                                                self.max_blocks_per_seq, config.max_model_len, hf_config.hidden_size,
                                                config.dtype, self.device)
        self.num_kv_blocks = self._allocate_kv_cache()
        self.penalties = PenaltyRows(self.ops, hf_config.vocab_size, config.max_num_seqs, self.device, self._to_device)
        self.stranded = False  # rank 0 left a step midway: the other ranks cannot be brought back in step
        if self.use_graphs:
            self._capture_graphs()

    # ---- KV cache

    def _allocate_kv_cache(self) -> int:
        num_blocks = self.config.num_kv_blocks
        if num_blocks is None:
            if self.device.type == "cuda":
                self._warmup()
                graph_bytes = self._graph_memory() if self.use_graphs else 0
                free, total = torch.cuda.mem_get_info(self.device)
                used_at_peak = total - free + torch.cuda.max_memory_allocated(self.device) - torch.cuda.memory_allocated(self.device)
                budget = (total * self.config.gpu_memory_utilization - used_at_peak - self._sampling_bytes()
                          - graph_bytes)
            else:
                budget = CPU_KV_CACHE_BYTES
            # More blocks than max_num_seqs full-length sequences hold would only keep old prefixes.
            block_bytes = self.block_size * kv_bytes_per_token(self.model, self.config.cache_dtype)
            num_blocks = min(int(budget // block_bytes), self.config.max_num_seqs * self.max_blocks_per_seq)
            if self.world_size > 1:  # every rank must agree on the smallest
                count = torch.tensor([num_blocks], device=self.device)
                num_blocks = int(all_reduce(count, op=dist.ReduceOp.MIN).item())
        if num_blocks < 1:
            raise ValueError("no memory left for the KV cache: lower max_num_batched_tokens or raise gpu_memory_utilization")
        allocate_kv_caches(self.model, num_blocks, self.block_size, self.config.cache_dtype, self.device)
        if self.device.type == "cuda" and self.config.kernels == "triton":
            self._compile_prefill()
        return num_blocks

    def _warmup(self) -> None:
        """A largest-possible prefill, so the peak activation memory (with an fp8 cache, the largest
        copies of its blocks) is known before the cache is sized."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        num_tokens = min(self.config.max_num_batched_tokens, self.config.max_model_len * self.config.max_num_seqs)
        lengths = split_lengths(num_tokens, self.config.max_model_len)
        allocate_kv_caches(self.model, 1, self.block_size, self.config.cache_dtype, self.device, fill=0.0)
        self._dummy_prefill(lengths, self.config.prefill_gather_blocks)  # the most copies, each of block 0
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # its activations, cached, would count twice: in use and in the peak

    def _graph_memory(self) -> int:
        """Bytes the graphs' memory pool will hold, held from their capture on: the largest decode and
        prefill graphs captured over the one-block cache into one pool, measured, and dropped."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(self.device)
        self._capture_graphs(largest_only=True)
        held = torch.cuda.memory_reserved(self.device) - before
        self.decode_graphs.graphs.clear()
        self.prefill_graphs.graphs.clear()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        return held

    def _sampling_bytes(self) -> int:
        """Rank 0's most sampling memory (not in the warm-up's peak), max_num_seqs rows of the vocabulary:
        logits, a float32 copy and allowed_token_ids mask, penalty counts (int32) and prompt mask (uint8)."""
        if self.rank:
            return 0
        return self.config.max_num_seqs * self.hf_config.vocab_size * (self.config.dtype.itemsize + 4 + 4 + 4 + 1)

    def _compile_prefill(self) -> None:
        """Run the prefill steps of `prefill_warmup_steps` (over an fp8 cache, on copies of its blocks
        and in place), so no Triton compile (seconds each) lands in the middle of serving, as for
        the sampler. They read zeroed block 0 and store nothing."""
        config = self.config
        for module in self.model.modules():
            if isinstance(module, Attention):  # block 0 is free: the first request that takes it overwrites it
                for t in (module.k_cache, module.v_cache, module.k_scale, module.v_scale):
                    if t is not None:
                        t[0].zero_()
        copies = 1 if config.prefill_gather_blocks else 0
        steps = prefill_warmup_steps(config.max_model_len, config.max_num_batched_tokens, config.max_num_seqs)
        # Over an fp8 cache the one-sequence steps (one a query bucket) run again in place, as steps
        # holding more blocks than the copies take do.
        runs = [(lengths, copies) for lengths in steps]
        runs += [(lengths, 0) for lengths in steps if copies and len(lengths) == 1]
        for lengths, step_copies in self._progress(runs, "Compiling prefill kernels"):
            self._dummy_prefill(lengths, step_copies)
        torch.cuda.synchronize(self.device)

    def _progress(self, items: list, desc: str):
        """items, with a progress bar on rank 0 when stderr is a terminal (a cold start compiles for a minute)."""
        return tqdm(items, desc=desc, leave=False, dynamic_ncols=True, disable=True if self.rank else None)

    def _dummy_prefill(self, lengths: list[int], copies: int) -> None:
        """A prefill of sequences of these lengths that stores nothing (slots -1) and reads block 0 of
        the cache for every key; over an fp8 cache its attention reads `copies` gathered copies of
        block 0."""
        d = self.device
        num_tokens = sum(lengths)
        cu = torch.tensor([0] + lengths, device=d).cumsum(0).to(torch.int32)
        positions = torch.cat([torch.arange(n, device=d) for n in lengths])
        tables = torch.zeros(len(lengths), -(-max(lengths) // self.block_size), dtype=torch.int32, device=d)
        no_slots = torch.full((num_tokens,), -1, device=d)
        context = Context(True, no_slots, torch.tensor(lengths, dtype=torch.int32, device=d), tables, cu,
                          max(lengths), max(lengths))
        if copies:
            context.gather_blocks = torch.zeros(copies, dtype=torch.int32, device=d)
            context.gather_tables, context.copy_slots, context.num_copies = tables, no_slots, copies
        self._forward(torch.zeros(num_tokens, dtype=torch.long, device=d), positions, context)

    # ---- inputs (rank 0) -> broadcast -> forward (every rank)

    def _to_device(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """Host tensor to this rank's device; from pinned memory on a GPU, so the copy never waits for
        the step still running there."""
        if t is None or self.device.type == "cpu":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def _input_ids(self, inputs: StepInputs, previous_ids: torch.Tensor | None) -> torch.Tensor:
        """The step's token ids on the device; pending ones are taken from the previous step's samples."""
        token_ids = self._to_device(inputs.token_ids)
        if inputs.pending_rows is None:
            return token_ids
        if self.world_size > 1:  # rank 0 sampled them; the other ranks receive them here
            if self.rank > 0:
                previous_ids = torch.empty(inputs.num_previous_samples, dtype=torch.long, device=self.device)
            broadcast(previous_ids)
        rows = self._to_device(inputs.pending_rows)
        return torch.where(rows >= 0, previous_ids[rows.clamp(min=0)], token_ids)

    @torch.inference_mode()
    def execute(self, inputs: StepInputs, previous_ids: torch.Tensor | None = None) -> tuple:
        """Forward one step on this rank (no host sync): logits [N, V] of the rows that sample, and
        the prompt positions' scores on their way to the host (rank 0, with prompt_rows; else None).
        previous_ids: the previous step's sampled ids on the device (rank 0), read by pending rows."""
        to = self._to_device
        token_ids = self._input_ids(inputs, previous_ids)
        for graphs in (self.decode_graphs, self.prefill_graphs):
            key = graphs.key(inputs) if graphs else None
            if key is not None:
                hidden = graphs.replay(inputs, token_ids, key, to)
                break
        else:
            context = Context(inputs.is_prefill, to(inputs.slot_mapping), to(inputs.seq_lens), to(inputs.block_tables),
                              to(inputs.cu_seqlens_q), inputs.max_q_len, inputs.max_seq_len, to(inputs.gather_blocks),
                              to(inputs.gather_tables), to(inputs.copy_slots), inputs.num_copies)
            hidden = self._forward(token_ids, to(inputs.positions), context)
        scored = None
        if inputs.prompt_rows is not None:
            scored = score_positions(self.model, self.ops, hidden, to(inputs.prompt_rows), to(inputs.prompt_ids),
                                     inputs.prompt_top)
        return self.model.compute_logits(hidden[to(inputs.logit_rows)]), scored and SampledTokens(*scored)

    @torch.inference_mode()
    def _forward(self, token_ids, positions, context: Context) -> torch.Tensor:
        set_context(context)
        try:
            return self.model(token_ids, positions)
        finally:
            set_context(None)

    # ---- CUDA graphs (engine/graphs.py)

    @torch.inference_mode()
    def _capture_graphs(self, largest_only: bool = False) -> None:
        """Capture the decode graphs, then the prefill graphs, into one memory pool; largest_only: only
        the largest of each (the memory probe)."""
        pool = self.decode_graphs.capture(None, self._progress, largest_only)
        self.prefill_graphs.capture(pool, self._progress, largest_only)
        torch.cuda.synchronize(self.device)

    # ---- sampling (rank 0)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, seqs: list[Sequence], seeds: list[int],
               bans: list[tuple[int, int]]) -> "SampledTokens":
        """Sample each row (no host sync); the ids and, when asked, logprobs head to the host.
        Each row's logit_bias is added first (add_logit_bias), then the penalties (both on a float32
        copy of the logits), when a row has some; the (row, token) pairs of `bans` are never drawn;
        logprobs are of the raw logits."""
        params = [seq.params for seq in seqs]
        vocab = self.hf_config.vocab_size
        rows = self.penalties.rows(seqs)
        penalties = [] if rows is None else [[p.presence_penalty for p in params], [p.frequency_penalty for p in params],
                                             [p.repetition_penalty for p in params]]
        floats = self._to_device(torch.tensor([[p.temperature for p in params], [p.top_p for p in params],
                                               [p.min_p for p in params], *penalties], dtype=torch.float32))
        # top_k past the vocabulary means off; clamped so that it fits the kernel's int32.
        ints = self._to_device(torch.tensor([[min(p.top_k, vocab) for p in params], seeds, *([] if rows is None else [rows])],
                                            dtype=torch.int64))
        raw, wants_logprobs = logits, any(p.wants_logprobs for p in params)
        biased = add_logit_bias(logits, seqs, self._to_device)
        if biased is not None:
            logits = biased
        elif rows is not None:  # penalties in float32 (vLLM's): bf16 would round small ones away
            logits = logits.to(torch.float32, copy=True)
        elif wants_logprobs and bans:
            logits = logits.clone()
        if bans:
            logits[tuple(self._to_device(torch.tensor(bans).T.contiguous()))] = float("-inf")
        if rows is not None:
            self.ops.apply_penalties(logits, self.penalties.counts, self.penalties.prompt_mask, ints[2], *floats[3:])
        ids = self.ops.sample(logits, floats[0], ints[0].to(torch.int32), floats[1], floats[2], ints[1])
        if rows is not None:
            self.ops.count_tokens(self.penalties.counts, ints[2], ids)
        logprobs = self.ops.compute_logprobs(raw, ids) if wants_logprobs else None
        k = min(max(p.num_top_logprobs for p in params), vocab)
        top = self.ops.compute_top_logprobs(raw, k) if k else None
        return SampledTokens(ids, logprobs, top if top is None or logprobs is None else agreeing_top(top, ids, logprobs))

    # ---- tensor-parallel driving

    def launch(self, inputs: StepInputs, seqs: list[Sequence], seeds: list[int], bans: list[tuple[int, int]],
               previous_ids: torch.Tensor | None) -> tuple:
        """Rank 0: start one step on every rank and sample the rows of `seqs` (one per logit row, in
        order; bans as sample's); returns the samples (None if no row samples) and the prompt scores
        (execute's) without waiting for them."""
        if self.world_size > 1:
            with interrupt_after():
                broadcast_object(("execute", inputs))
                try:
                    logits, scored = self.execute(inputs, previous_ids)
                except BaseException:
                    self.stranded = True  # the other ranks wait in a collective this one left
                    raise
        else:
            logits, scored = self.execute(inputs, previous_ids)
        return self.sample(logits, seqs, seeds, bans) if seqs else None, scored

    def worker_loop(self) -> None:
        """Ranks > 0: run what rank 0 broadcasts until it says exit."""
        while True:
            method, inputs = broadcast_object()
            if method == "exit":
                break
            self.execute(inputs)
        self.shutdown()

    def shutdown(self, peers_alive: bool = True) -> None:
        """Release the graphs and the process group; rank 0 first tells live workers to exit."""
        if self.rank == 0 and self.world_size > 1 and peers_alive:
            try:
                broadcast_object(("exit", None))
            except RuntimeError:  # a peer died since the caller looked
                peers_alive = False
        for graphs in (self.decode_graphs, self.prefill_graphs):
            if graphs is not None:  # before the process group: they may hold its collectives
                graphs.graphs.clear()
        close_distributed(peers_alive)
        # The weights, the KV cache and the step buffers go now, not when the last reference to the
        # LLM does: a closed LLM still bound to a name would leave a new one no memory.
        self.model = self.penalties = self.decode_graphs = self.prefill_graphs = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
