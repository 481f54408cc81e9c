"""Run a tritonllm model on whole sequences without the engine: paged caches, context, forward; the
same sequences through HF transformers; the TP=2 worker."""
import torch
import torch.multiprocessing as mp
from numerics import rel_err
from transformers import AutoModelForCausalLM

from tritonllm.context import Context, set_context
from tritonllm.distributed import close_distributed, free_port, init_distributed
from tritonllm.layers.attention import allocate_kv_caches
from tritonllm.loader import build_model, load_config, load_weights

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK_SIZE = 16
SEQ_LENS = [1, 16, 37]  # a single token, a block boundary, a partial last block


def load(path, dtype=torch.float32, device=DEVICE):
    config = load_config(str(path))
    model = build_model(config, dtype, torch.device(device))
    load_weights(model, path)
    return model


def random_sequences(vocab, lengths, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]


def shuffled_block_tables(lengths, extra_blocks=3, seed=0):
    """Non-contiguous blocks in random order; unused entries point at blocks never written."""
    per_seq = [-(-n // BLOCK_SIZE) + extra_blocks for n in lengths]
    order = torch.randperm(sum(per_seq), generator=torch.Generator().manual_seed(seed))
    tables, start = [], 0
    for n in per_seq:
        tables.append(order[start:start + n])
        start += n
    return torch.stack([t[: min(per_seq)] for t in tables]).to(torch.int32), sum(per_seq)


def hf_logits(path, sequences, dtype=torch.float32):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(DEVICE)
    with torch.no_grad():
        return [model(torch.tensor([seq], device=DEVICE)).logits[0].float() for seq in sequences]


def prefill_then_decode(model, sequences, dtype, extra_token_seed=1):
    """Logits of a batched prefill of `sequences`, then of one decode step on one more token each."""
    lengths = [len(s) for s in sequences]
    block_tables, num_blocks = shuffled_block_tables([n + 1 for n in lengths])
    allocate_kv_cache(model, num_blocks, BLOCK_SIZE, dtype, DEVICE)
    block_tables = block_tables.to(DEVICE)
    prefill = run_step(model, sequences, [0] * len(sequences), block_tables, BLOCK_SIZE, DEVICE)
    longer = [seq + extra for seq, extra in zip(sequences, random_sequences(model.config.vocab_size, [1] * len(sequences), extra_token_seed))]
    decode = run_step(model, longer, lengths, block_tables, BLOCK_SIZE, DEVICE)
    return prefill, longer, decode


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


def tp_worker(rank, world_size, port, path, out_file):
    device = init_distributed(rank, world_size, DEVICE if DEVICE == "cpu" else "cuda", f"tcp://127.0.0.1:{port}")
    config = load_config(str(path))
    model = build_model(config, torch.float32, device)
    load_weights(model, path)
    sequences = random_sequences(config.vocab_size, SEQ_LENS)
    block_tables, num_blocks = shuffled_block_tables([n + 1 for n in SEQ_LENS])
    allocate_kv_cache(model, num_blocks, BLOCK_SIZE, torch.float32, device)
    logits = run_step(model, sequences, [0] * len(sequences), block_tables.to(device), BLOCK_SIZE, device)
    assert (logits is None) == (rank != 0)
    if rank == 0:
        torch.save(logits.cpu(), out_file)
    close_distributed()


def tensor_parallel_2_error(path, tmp_path) -> float:
    """rel_err of the logits of a batched prefill at TP = 2 (two spawned ranks) against TP = 1."""
    mp.spawn(tp_worker, args=(2, free_port(), path, tmp_path / "tp2.pt"), nprocs=2)
    model = load(path)
    sequences = random_sequences(model.config.vocab_size, SEQ_LENS)
    block_tables, num_blocks = shuffled_block_tables([n + 1 for n in SEQ_LENS])
    allocate_kv_cache(model, num_blocks, BLOCK_SIZE, torch.float32, DEVICE)
    single = run_step(model, sequences, [0] * len(sequences), block_tables.to(DEVICE), BLOCK_SIZE, DEVICE)
    return rel_err(torch.load(tmp_path / "tp2.pt"), single.cpu())
