"""Triton kernels of tritonllm; kernels/reference.py holds the PyTorch reference of each, README.md the contract."""
from tritonllm.kernels.decode_attention import decode_attention
from tritonllm.kernels.fused_moe import fused_moe
from tritonllm.kernels.kv_cache import gather_kv_blocks, store_kv_cache
from tritonllm.kernels.linear import linear
from tritonllm.kernels.logprobs import compute_logprobs, compute_top_logprobs
from tritonllm.kernels.moe_routing import moe_align, moe_route
from tritonllm.kernels.norm import fused_add_rms_norm, rms_norm
from tritonllm.kernels.penalties import apply_penalties, count_tokens
from tritonllm.kernels.prefill_attention import prefill_attention
from tritonllm.kernels.qk_norm_rotary import qk_norm_rotary_store
from tritonllm.kernels.rotary import rotary_embedding
from tritonllm.kernels.sampler import sample
from tritonllm.kernels.silu_and_mul import silu_and_mul
