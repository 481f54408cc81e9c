import pytest
import torch
from kernel_utils import DEVICE, DTYPES, assert_close, randn

from tritonllm.kernels import reference, rotary_embedding
from tritonllm.layers import rotary


def cos_sin_cache(max_pos, head_dim, yarn=None):
    return rotary.cos_sin_cache(head_dim, max_pos, 1e6, yarn).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, q_heads, k_heads, head_dim", [(1, 1, 1, 64), (7, 16, 8, 128), (100, 4, 1, 64), (5, 6, 2, 80)])
def test_rotary_embedding(tokens, q_heads, k_heads, head_dim, dtype):
    cache = cos_sin_cache(4096, head_dim)
    positions = torch.randint(0, 4096, (tokens,), device=DEVICE)
    q, k = randn(tokens, q_heads, head_dim, dtype=dtype), randn(tokens, k_heads, head_dim, dtype=dtype)
    ref_q, ref_k = reference.rotary_embedding(positions, q, k, cache)
    out_q, out_k = rotary_embedding(positions, q.clone(), k.clone(), cache)
    assert_close(out_q, ref_q, dtype)
    assert_close(out_k, ref_k, dtype)


def test_rotary_embedding_with_yarn_table():
    # YaRN's cos and sin carry its attention factor (~1.14 here): not a pure rotation.
    q, k = randn(9, 4, 128), randn(9, 2, 128)
    positions = torch.randint(0, 4096, (9,), device=DEVICE)
    cache = cos_sin_cache(4096, 128, {"factor": 4.0, "original_max_position_embeddings": 1024})
    ref_q, ref_k = reference.rotary_embedding(positions, q, k, cache)
    out_q, out_k = rotary_embedding(positions, q.clone(), k.clone(), cache)
    assert_close(out_q, ref_q, torch.float32)
    assert_close(out_k, ref_k, torch.float32)


@pytest.mark.parametrize("positions_dtype", [torch.int32, torch.int64])
def test_rotary_embedding_on_packed_qkv(positions_dtype):
    # q and k are strided views of one qkv tensor; v must stay untouched.
    tokens, heads, head_dim = 9, 4, 64
    qkv = randn(tokens, (heads + 2 + 2) * head_dim)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + 2) * head_dim].view(tokens, 2, head_dim)
    v_before = qkv[:, (heads + 2) * head_dim :].clone()
    cache = cos_sin_cache(64, head_dim)
    positions = torch.arange(3, 3 + tokens, device=DEVICE, dtype=positions_dtype)
    ref_q, ref_k = reference.rotary_embedding(positions, q, k, cache)
    out_q, out_k = rotary_embedding(positions, q, k, cache)
    assert out_q.data_ptr() == q.data_ptr()
    assert_close(out_q, ref_q, torch.float32)
    assert_close(out_k, ref_k, torch.float32)
    assert torch.equal(qkv[:, (heads + 2) * head_dim :], v_before)


def test_rotary_position_zero_is_identity():
    q, k = randn(3, 2, 64), randn(3, 1, 64)
    out_q, out_k = rotary_embedding(torch.zeros(3, dtype=torch.long, device=DEVICE), q.clone(), k.clone(), cos_sin_cache(8, 64))
    assert torch.equal(out_q, q) and torch.equal(out_k, k)
