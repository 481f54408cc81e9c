"""CUDA graphs of the decode step, one per batch-size bucket.

Every rank captures the forward pass from the step's inputs through the logits (the all-reduces and
the logits' gather to rank 0 included). Rank 0 also captures the sampler over those logits with the
parameters in buffers of their own: a step whose rows all sample plainly (no penalties, no
logprobs) replays it instead of launching the sampler's kernels from Python, which is most of the
host's time in a small decode step. Other steps sample the graph's logits eagerly.
"""
import numpy as np
import torch
import torch.nn.functional as F

from tritonllm.context import Context
from tritonllm.engine.step_inputs import StepInputs


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_num_seqs + 1, 16))
    return sorted({min(s, max_num_seqs) for s in sizes} | {max_num_seqs})


class DecodeGraphs:
    def __init__(self, runner, progress):
        """Capture the graphs of `runner` (a ModelRunner with its KV cache and sampler compiled),
        largest batch first so the smaller ones reuse its memory pool."""
        self.runner = runner
        config, d = runner.config, runner.device
        max_bs = config.max_num_seqs
        self.inputs = {
            "token_ids": torch.zeros(max_bs, dtype=torch.long, device=d),
            "positions": torch.zeros(max_bs, dtype=torch.long, device=d),
            "slot_mapping": torch.full((max_bs,), -1, dtype=torch.long, device=d),
            "seq_lens": torch.ones(max_bs, dtype=torch.int32, device=d),
            "block_tables": torch.zeros(max_bs, runner.max_blocks_per_seq, dtype=torch.int32, device=d),
        }
        self.samples = runner.rank == 0
        vocab = runner.hf_config.vocab_size
        if self.samples:
            self.logits = torch.zeros(max_bs, vocab, dtype=config.dtype, device=d)
            # Temperature, top_p, min_p of a bucket's B rows back to back, then top_k and seeds.
            self.floats = torch.ones(3 * max_bs, dtype=torch.float32, device=d)
            self.ints = torch.zeros(2 * max_bs, dtype=torch.int64, device=d)
            self.ids = torch.zeros(max_bs, dtype=torch.int64, device=d)
        self.forward_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.sample_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        pool = None
        for batch in progress(list(reversed(graph_batch_sizes(max_bs))), "Capturing decode graphs"):
            self._forward(batch)  # compiles and warms the kernels
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                self._forward(batch)
            pool = graph.pool()
            self.forward_graphs[batch] = graph
            if self.samples:
                self._sample(batch)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool):
                    self._sample(batch)
                self.sample_graphs[batch] = graph
            torch.cuda.synchronize(d)

    def _forward(self, batch: int) -> None:
        g, runner = self.inputs, self.runner
        context = Context(False, g["slot_mapping"][:batch], g["seq_lens"][:batch], g["block_tables"][:batch], None, 1,
                          runner.config.max_model_len)
        logits = runner.model.compute_logits(runner.forward(g["token_ids"][:batch], g["positions"][:batch], context))
        if self.samples:
            self.logits[:batch] = logits

    def _sample(self, batch: int) -> None:
        f, i = self.floats, self.ints
        ids = self.runner.ops.sample(self.logits[:batch], f[:batch], i[:batch].to(torch.int32), f[batch:2 * batch],
                                     f[2 * batch:3 * batch], i[batch:2 * batch])
        self.ids[:batch] = ids

    def fits(self, batch: int) -> bool:
        return batch <= max(self.forward_graphs)

    def _bucket(self, batch: int) -> int:
        return next(size for size in sorted(self.forward_graphs) if size >= batch)

    def replay(self, inputs: StepInputs, token_ids: torch.Tensor) -> torch.Tensor | None:
        """The step's forward; on rank 0 its logits [B, V] (a view of the graphs' buffer, valid until
        the next replay), None elsewhere."""
        batch = len(inputs.seq_lens)
        bucket = self._bucket(batch)
        g = self.inputs
        g["token_ids"][:batch].copy_(token_ids)
        # Rows past the batch are padding: no KV store (slot -1) and one key read (seq_len 1), from
        # block_tables[row, 0]. Every table entry ever written is a valid block id and entries past a
        # sequence's length are never read, so the tables are not cleared. The host pads the other
        # inputs: one copy from pinned memory straight into each graph buffer. The tables' slice of
        # their buffer is not contiguous, so they go through a device copy.
        for name, pad_value in (("positions", 0), ("slot_mapping", -1), ("seq_lens", 1)):
            padded = F.pad(getattr(inputs, name), (0, bucket - batch), value=pad_value)
            g[name][:bucket].copy_(padded.pin_memory(), non_blocking=True)
        g["block_tables"][:batch, : inputs.block_tables.shape[1]].copy_(self.runner.to_device(inputs.block_tables))
        self.forward_graphs[bucket].replay()
        return self.logits[:batch] if self.samples else None

    def sample(self, temperature: list, top_k: list, top_p: list, min_p: list, seeds: list) -> torch.Tensor:
        """Rank 0, right after `replay`: ids [B] drawn from its logits as ops.sample would (padding
        rows draw greedily and are dropped)."""
        batch = len(seeds)
        bucket = self._bucket(batch)
        floats = np.zeros((3, bucket), dtype=np.float32)
        floats[1] = 1.0  # top_p off
        floats[:, :batch] = (temperature, top_p, min_p)
        ints = np.zeros((2, bucket), dtype=np.int64)
        ints[:, :batch] = (top_k, seeds)
        self.floats[:3 * bucket].copy_(torch.from_numpy(floats.ravel()).pin_memory(), non_blocking=True)
        self.ints[:2 * bucket].copy_(torch.from_numpy(ints.ravel()).pin_memory(), non_blocking=True)
        self.sample_graphs[bucket].replay()
        return self.ids[:batch].clone()  # the next step's replay overwrites the buffer

    def clear(self) -> None:
        self.forward_graphs.clear()
        self.sample_graphs.clear()
