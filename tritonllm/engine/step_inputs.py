"""The host-side inputs of one step, built from the scheduled batch (rank 0, then broadcast to TP ranks)."""
from dataclasses import dataclass

import numpy as np
import torch

from tritonllm.engine.prompt_logprobs import PromptSpan
from tritonllm.engine.scheduler import ScheduledBatch
from tritonllm.engine.sequence import Sequence


@dataclass
class StepInputs:
    is_prefill: bool
    token_ids: torch.Tensor  # [T] int64; 0 where the token is still pending (see pending_rows)
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, cache slot of each new token
    seq_lens: torch.Tensor  # [B] int32, cached + new tokens
    block_tables: torch.Tensor  # [B, max blocks in the batch] int32, zero-padded
    cu_seqlens_q: torch.Tensor | None  # [B + 1] int32 (prefill only)
    max_q_len: int
    max_seq_len: int
    logit_rows: torch.Tensor  # [N] int64, the rows of the T tokens whose logits are sampled
    # Decode only, None when every token is known: [B] int64, the row of the previous step's
    # samples that holds a pending token, or -1.
    pending_rows: torch.Tensor | None
    num_previous_samples: int  # rows of the previous step's samples (TP ranks > 0 receive them)
    # Prefill over an fp8 cache (else None; layers/attention.py): the step's sequences run on
    # num_copies copies of the distinct blocks they hold. gather_blocks [C] int32: the blocks holding
    # cached tokens, which copies 0..C-1 take from the cache; gather_tables: block_tables rewritten to
    # index the copies; copy_slots [T] int64: the slot in the copies of each new token, which the
    # store writes there itself.
    gather_blocks: torch.Tensor | None = None
    gather_tables: torch.Tensor | None = None
    copy_slots: torch.Tensor | None = None
    num_copies: int = 0
    # Prefill with prompt_logprobs (engine/prompt_logprobs.py; else None): prompt_rows [M] int64, rows
    # of the T tokens whose logits score the next prompt token, prompt_ids [M] int64; prompt_top: the
    # most top logprobs any of their sequences asks for.
    prompt_rows: torch.Tensor | None = None
    prompt_ids: torch.Tensor | None = None
    prompt_top: int = 0


def block_table_array(seq: Sequence) -> np.ndarray:
    """seq's block table as int32, converted once and extended as blocks are appended (block
    tables only grow until the block manager replaces the list)."""
    table, cached = seq.block_table, seq.block_table_array
    if cached is None or cached[0] is not table:
        cached = (table, np.array(table, dtype=np.int32))
    elif len(cached[1]) < len(table):
        cached = (table, np.concatenate([cached[1], np.array(table[len(cached[1]):], dtype=np.int32)]))
    seq.block_table_array = cached
    return cached[1]


def block_copies(tables: list[np.ndarray], block_tables: np.ndarray, starts: np.ndarray, seq_lens: np.ndarray,
                  block_size: int, limit: int) -> tuple[np.ndarray, np.ndarray, int] | None:
    """Copies of the distinct blocks the sequences hold (their first cdiv(seq_len, block_size) table
    entries), those holding cached tokens (before starts) first: (those cached blocks [C] int32 in
    copy order, block_tables rewritten to index the copies (zero-padded), the number of copies); None
    past `limit` copies."""
    counts, cached = -(-seq_lens // block_size), -(-starts // block_size)
    held = np.concatenate([table[:n] for table, n in zip(tables, counts)])
    blocks, inverse = np.unique(held, return_inverse=True)
    if len(blocks) > limit:
        return None
    holds_cached = np.zeros(len(blocks), dtype=bool)
    index_in_seq = np.arange(len(held)) - np.repeat(np.cumsum(counts) - counts, counts)
    holds_cached[inverse[index_in_seq < np.repeat(cached, counts)]] = True
    order = np.argsort(~holds_cached, kind="stable")
    copy_of = np.empty_like(order)
    copy_of[order] = np.arange(len(order))
    rewritten = np.zeros_like(block_tables)
    rewritten[np.arange(block_tables.shape[1])[None, :] < counts[:, None]] = copy_of[inverse]  # row by row
    return blocks[order[:holds_cached.sum()]].astype(np.int32), rewritten, len(blocks)


def build_step_inputs(batch: ScheduledBatch, previous_rows: dict[int, int], block_size: int,
                      gather_limit: int = 0, prompt_spans: list[PromptSpan] = ()) -> StepInputs:
    """Host tensors of one step, built with numpy and little Python per sequence.

    previous_rows: seq_id -> row of the previous (still unresolved) step's samples; a decode row
    whose last token is pending reads it from there on the device. gather_limit: a prefill step
    whose sequences hold at most this many distinct cache blocks runs on copies of them (gather_blocks,
    gather_tables, copy_slots, num_copies; EngineConfig.prefill_gather_blocks; 0: never).
    prompt_spans: the prompt positions the step scores (prompt_logprob_spans).
    """
    seqs = batch.seqs
    tables = [block_table_array(seq) for seq in seqs]
    block_tables = np.zeros((len(seqs), max(map(len, tables))), dtype=np.int32)
    for row, table in zip(block_tables, tables):
        row[:len(table)] = table
    pending_rows = None
    if batch.is_prefill:  # every prompt token is known
        counts = np.array(batch.num_new, dtype=np.int64)
        starts = np.fromiter((seq.num_computed_tokens for seq in seqs), dtype=np.int64, count=len(seqs))
        seq_lens = starts + counts
        token_ids = [t for seq, s, e in zip(seqs, starts.tolist(), seq_lens.tolist()) for t in seq.token_ids[s:e]]
        seq_index = np.repeat(np.arange(len(seqs)), counts)
        positions = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts - starts, counts)
        cu_seqlens_q = torch.from_numpy(np.concatenate([[0], np.cumsum(counts)]).astype(np.int32))
        logit_rows = (np.cumsum(counts) - 1)[np.array(batch.samples)]
    else:
        token_ids = [seq.token_ids[-1] if not seq.num_pending else 0 for seq in seqs]
        if any(seq.num_pending for seq in seqs):
            pending_rows = torch.tensor([previous_rows[seq.seq_id] if seq.num_pending else -1 for seq in seqs])
        seq_index = np.arange(len(seqs))
        seq_lens = np.fromiter(map(len, seqs), dtype=np.int64, count=len(seqs))
        positions = seq_lens - 1
        cu_seqlens_q = None
        logit_rows = seq_index

    def slots_in(table_rows: np.ndarray) -> np.ndarray:  # each new token's slot through these block tables
        return table_rows[seq_index, positions // block_size].astype(np.int64) * block_size + positions % block_size

    slots = slots_in(block_tables)
    extra = {}
    if batch.is_prefill and gather_limit:
        gathered = block_copies(tables, block_tables, starts, seq_lens, block_size, gather_limit)
        if gathered is not None:
            gather_blocks, gather_tables, num_copies = gathered
            extra = dict(gather_blocks=torch.from_numpy(gather_blocks), gather_tables=torch.from_numpy(gather_tables),
                         copy_slots=torch.from_numpy(slots_in(gather_tables)), num_copies=num_copies)
    if prompt_spans:
        extra["prompt_rows"] = torch.tensor([row for span in prompt_spans
                                             for row in range(span.row, span.row + span.count)])
        extra["prompt_ids"] = torch.tensor([t for span in prompt_spans
                                             for t in span.seq.token_ids[span.first + 1:span.first + span.count + 1]])
        extra["prompt_top"] = max(span.seq.params.prompt_logprobs for span in prompt_spans)
    return StepInputs(
        is_prefill=batch.is_prefill, token_ids=torch.tensor(token_ids, dtype=torch.int64),
        positions=torch.from_numpy(positions), slot_mapping=torch.from_numpy(slots),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)), block_tables=torch.from_numpy(block_tables),
        cu_seqlens_q=cu_seqlens_q, max_q_len=max(batch.num_new), max_seq_len=int(seq_lens.max()),
        logit_rows=torch.from_numpy(logit_rows), pending_rows=pending_rows, num_previous_samples=len(previous_rows),
        **extra)
