"""Run a tritonllm model on whole sequences without the engine: paged caches, context, forward."""
import torch

from tritonllm.context import Context, set_context
from tritonllm.layers.attention import allocate_kv_caches


def allocate_kv_cache(model, num_blocks: int, block_size: int, dtype, device):
    """NaN-filled caches for every attention layer, so a read of an unwritten slot shows."""
    allocate_kv_caches(model, num_blocks, block_size, dtype, device, fill=float("nan"))


def run_step(model, sequences, num_cached, block_tables, block_size, device):
    """Forward the tokens sequences[b][num_cached[b]:] of each sequence; returns logits [T, V].

    block_tables [B, max_blocks] int32 lists each sequence's cache blocks; the first num_cached[b]
    tokens must already be in the cache. A step of one new token per sequence runs as decode.
    """
    new = [seq[cached:] for seq, cached in zip(sequences, num_cached)]
    token_ids = torch.tensor([t for part in new for t in part], device=device)
    positions = torch.tensor([p for seq, cached in zip(sequences, num_cached) for p in range(cached, len(seq))], device=device)
    table = block_tables.tolist()
    slots = [table[b][p // block_size] * block_size + p % block_size
             for b, (seq, cached) in enumerate(zip(sequences, num_cached)) for p in range(cached, len(seq))]
    q_lens = [len(part) for part in new]
    cu_seqlens_q = torch.tensor([0] + q_lens, device=device).cumsum(0).to(torch.int32)
    set_context(Context(
        is_prefill=any(n != 1 for n in q_lens), slot_mapping=torch.tensor(slots, device=device),
        seq_lens=torch.tensor([len(seq) for seq in sequences], dtype=torch.int32, device=device),
        block_tables=block_tables, cu_seqlens_q=cu_seqlens_q, max_q_len=max(q_lens),
        max_seq_len=max(len(seq) for seq in sequences),
    ))
    try:
        return model.compute_logits(model(token_ids, positions))
    finally:
        set_context(None)
