"""The forward context: how the tokens of one step sit in the paged KV cache.

The model runner sets it before each forward; the attention and MoE layers read it. A module-level
value (rather than an argument threaded through every layer) keeps the model code plain and lets
CUDA graphs capture the tensors it points to.
"""
from dataclasses import dataclass

import torch


@dataclass
class Context:
    is_prefill: bool
    slot_mapping: torch.Tensor  # [T] cache slot of each new token (-1: do not store)
    seq_lens: torch.Tensor  # [B] int32, cached + new tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32
    cu_seqlens_q: torch.Tensor | None = None  # [B + 1] int32, prefill only
    max_q_len: int = 1  # host-side bounds of the new and of all tokens per sequence, for the kernels' grids
    max_seq_len: int = 0
    # Prefill over an fp8 cache (else None; engine/step_inputs.StepInputs): num_copies copies of the
    # step's blocks, of which the first len(gather_blocks) come from those cache blocks, the new
    # tokens' rows from the store at copy_slots; block tables into the copies.
    gather_blocks: torch.Tensor | None = None
    gather_tables: torch.Tensor | None = None
    copy_slots: torch.Tensor | None = None
    num_copies: int = 0
    # A prefill graph's real tokens, int32 [1] (the rows past are padding; None: every row is real).
    real_tokens: torch.Tensor | None = None


_context: Context | None = None


def set_context(context: Context | None) -> None:
    global _context
    _context = context


def get_context() -> Context:
    if _context is None:
        raise RuntimeError("no forward context: the model runner sets one before each forward")
    return _context
