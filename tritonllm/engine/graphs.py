"""CUDA graphs of the model's forward: decode steps, and short prefill steps.

Decode steps replay a graph captured for the smallest batch (graph_batch_sizes) and context bound
(graph_context_bounds, engine/warmup.py) that hold them. Padding rows store nothing (slot -1) and
read one key (seq_len 1).

An eager prefill step launches some 270 kernels, and their launches cost the host about 13 ms on
a GPU that runs a 512-token step in 2 ms (bench/NOTES-engine.md): a short prompt's first token
waited on Python. Steps of at most GRAPH_TOKENS new tokens and GRAPH_SEQS sequences replay a graph
captured for the next power of two of each instead. Over an fp8 cache such steps read the cache in
place (the engine asks `holds`), not copies of their blocks, whose count varies by step.
Padding: token rows past the step's belong to no sequence (attention leaves them alone, their
slot -1 stores nothing, and every other kernel works row by row), sequences past the step's have
no new tokens (their attention programs exit at once). Padding rows carry whatever attention left
in them, which no real row reads; MoE layers skip their pairs (Context.real_tokens). The
graph's attention grid and configs follow its bucket: the step's longest query may be the whole bucket.
"""
import torch
import torch.nn.functional as F

from tritonllm.context import Context
from tritonllm.engine.step_inputs import StepInputs
from tritonllm.engine.warmup import graph_batch_sizes, graph_context_bound, graph_context_bounds

GRAPH_TOKENS = 2048
GRAPH_SEQS = 8


def copy_padded(dst: torch.Tensor, src: torch.Tensor, value) -> None:
    """dst <- host tensor src padded with `value` to dst's length; on a GPU straight from pinned memory,
    so the copy never waits for the step still running there."""
    padded = F.pad(src, (0, len(dst) - len(src)), value=value)
    dst.copy_(padded.pin_memory() if dst.is_cuda else padded, non_blocking=True)


class StepGraphs:
    """What the decode and prefill graphs share. A subclass sets `forward` (the model runner's
    forward(token_ids, positions, context) -> hidden), `keys` (largest first, the order of capture),
    `graphs` (key -> graph), the input buffers `inputs` and the output buffer `output`, and defines
    `context(*key)` and `tokens(key)`, a graph's forward context (views of the buffers) and its token rows,
    and `padding(key, num_tokens)`: (buffer, rows, value) for each input a replay pads to the graph's size."""
    kind = ""

    def capture(self, pool, progress, largest_only: bool = False):
        """Capture every graph (largest_only: the largest) into the memory pool `pool` (None: a new one),
        each after one eager run that compiles and warms its kernels; returns the pool."""
        g = self.inputs
        for key in progress(self.keys[:1] if largest_only else self.keys, f"Capturing {self.kind} graphs"):
            tokens = self.tokens(key)
            args = (g["token_ids"][:tokens], g["positions"][:tokens], self.context(*key))
            self.forward(*args)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                self.output[:tokens].copy_(self.forward(*args))
            pool = graph.pool()
            self.graphs[key] = graph
        return pool

    def replay(self, inputs: StepInputs, token_ids: torch.Tensor, key: tuple[int, int], to_device) -> torch.Tensor:
        """Fill the buffers from the step's inputs (host tensors but token_ids; to_device as the model
        runner's, for the block tables, whose slice of their buffer is not contiguous), each padded to
        graph `key`'s size as `padding` says, and replay; returns the hidden states of the step's tokens."""
        g, num_tokens = self.inputs, len(token_ids)
        g["token_ids"][:num_tokens].copy_(token_ids)
        for name, size, pad_value in self.padding(key, num_tokens):
            copy_padded(g[name][:size], getattr(inputs, name), pad_value)
        g["block_tables"][:len(inputs.seq_lens), :inputs.block_tables.shape[1]].copy_(to_device(inputs.block_tables))
        self.graphs[key].replay()
        return self.output[:num_tokens]


class DecodeGraphs(StepGraphs):
    """The decode graphs, one per (context bound, batch), and their buffers, which hold max_blocks
    table entries a sequence."""
    kind = "decode"

    def __init__(self, forward, max_num_seqs: int, max_blocks: int, max_model_len: int, hidden_size: int,
                 dtype: torch.dtype, device: torch.device):
        self.forward, self.max_model_len = forward, max_model_len
        self.keys = [(bound, batch) for bound in reversed(graph_context_bounds(max_model_len))
                     for batch in reversed(graph_batch_sizes(max_num_seqs))]  # largest first, the order of capture
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.inputs = {
            "token_ids": torch.zeros(max_num_seqs, dtype=torch.long, device=device),
            "positions": torch.zeros(max_num_seqs, dtype=torch.long, device=device),
            "slot_mapping": torch.full((max_num_seqs,), -1, dtype=torch.long, device=device),
            "seq_lens": torch.ones(max_num_seqs, dtype=torch.int32, device=device),
            "block_tables": torch.zeros(max_num_seqs, max_blocks, dtype=torch.int32, device=device),
        }
        self.output = torch.zeros(max_num_seqs, hidden_size, dtype=dtype, device=device)

    def context(self, bound: int, batch: int) -> Context:
        g = self.inputs
        return Context(False, g["slot_mapping"][:batch], g["seq_lens"][:batch], g["block_tables"][:batch], None, 1, bound)

    def tokens(self, key: tuple[int, int]) -> int:
        return key[1]

    def key(self, inputs: StepInputs) -> tuple[int, int] | None:
        """The graph a decode step replays: of the smallest context bound that holds its longest
        context, the smallest batch that holds its rows; None for prefill, or where none holds it."""
        if inputs.is_prefill:
            return None
        bound, batch = graph_context_bound(self.max_model_len, inputs.max_seq_len), len(inputs.seq_lens)
        return min((key for key in self.graphs if key[0] == bound and key[1] >= batch), default=None)

    def padding(self, key: tuple[int, int], num_tokens: int) -> tuple:
        # Rows past the batch are padding: no KV store (slot -1) and one key read (seq_len 1), from
        # block_tables[row, 0]. Every table entry ever written is a valid block id and entries past a
        # sequence's length are never read, so the tables are not cleared.
        batch = key[1]
        return ("positions", batch, 0), ("slot_mapping", batch, -1), ("seq_lens", batch, 1)


def prefill_graph_keys(max_num_batched_tokens: int, max_num_seqs: int) -> list[tuple[int, int]]:
    """(tokens, sequences) of the graphs: powers of two from 16 tokens and 1 sequence, each at most
    the step limits (and no more sequences than tokens); largest first, the order of capture."""
    max_tokens, max_seqs = min(GRAPH_TOKENS, max_num_batched_tokens), min(GRAPH_SEQS, max_num_seqs)
    tokens = [t for t in (16 << i for i in range(GRAPH_TOKENS.bit_length())) if t <= max_tokens]
    seqs = [s for s in (1 << i for i in range(GRAPH_SEQS.bit_length())) if s <= max_seqs]
    return sorted(((t, s) for t in tokens for s in seqs if s <= t), reverse=True)


def prefill_graph_key(keys, num_tokens: int, num_seqs: int) -> tuple[int, int] | None:
    """The graph a prefill step of num_tokens new tokens in num_seqs sequences replays: the smallest
    that holds both; None where none does."""
    return min((key for key in keys if key[0] >= num_tokens and key[1] >= num_seqs), default=None)


class PrefillGraphs(StepGraphs):
    """The prefill graphs, one per (tokens, sequences), and their buffers, which hold max_blocks table
    entries a sequence."""
    kind = "prefill"

    def __init__(self, forward, max_num_batched_tokens: int, max_num_seqs: int, max_blocks: int, max_model_len: int,
                 hidden_size: int, dtype: torch.dtype, device: torch.device):
        self.forward, self.max_model_len = forward, max_model_len
        self.keys = prefill_graph_keys(max_num_batched_tokens, max_num_seqs)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        tokens, seqs = max(self.keys, default=(0, 0))  # the largest graph (none under 16 tokens a step)
        self.inputs = {  # what a replay's padding holds: no new token stored, no sequence attended
            "token_ids": torch.zeros(tokens, dtype=torch.long, device=device),
            "positions": torch.zeros(tokens, dtype=torch.long, device=device),
            "slot_mapping": torch.full((tokens,), -1, dtype=torch.long, device=device),
            "seq_lens": torch.zeros(seqs, dtype=torch.int32, device=device),
            "cu_seqlens_q": torch.zeros(seqs + 1, dtype=torch.int32, device=device),
            "block_tables": torch.zeros(seqs, max_blocks, dtype=torch.int32, device=device),
        }
        self.output = torch.zeros(tokens, hidden_size, dtype=dtype, device=device)

    def context(self, tokens: int, seqs: int) -> Context:
        """The forward context of graph (tokens, seqs): views of the input buffers."""
        g = self.inputs
        # Padding sequences end where the last real one does: cu_seqlens_q[seqs] counts the real tokens.
        return Context(True, g["slot_mapping"][:tokens], g["seq_lens"][:seqs], g["block_tables"][:seqs],
                       g["cu_seqlens_q"][:seqs + 1], tokens, self.max_model_len,
                       real_tokens=g["cu_seqlens_q"][seqs:seqs + 1])

    def tokens(self, key: tuple[int, int]) -> int:
        return key[0]

    def holds(self, num_tokens: int, num_seqs: int) -> bool:
        """Whether a prefill step of this size replays a graph (given no copies of an fp8 cache's blocks)."""
        return bool(self.graphs) and prefill_graph_key(self.keys, num_tokens, num_seqs) is not None

    def key(self, inputs: StepInputs) -> tuple[int, int] | None:
        """The graph this step replays, or None (a decode step, a long one, or one on copies)."""
        if not self.graphs or not inputs.is_prefill or inputs.gather_blocks is not None:
            return None
        return prefill_graph_key(self.keys, len(inputs.positions), len(inputs.seq_lens))

    def padding(self, key: tuple[int, int], num_tokens: int) -> tuple:
        tokens, seqs = key
        return (("positions", tokens, 0), ("slot_mapping", tokens, -1), ("seq_lens", seqs, 0),
                ("cu_seqlens_q", seqs + 1, num_tokens))
