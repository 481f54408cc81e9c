"""Public wrappers refuse, before any launch, arguments a kernel would read out of place (kernels/checks.py):
the error is a TypeError or ValueError that names the argument. And empty inputs give empty results."""
import pytest
import torch

from tritonllm import kernels as K

B, V, T, D = 3, 40, 5, 16


def _rows(dtype=torch.float32, n=B):
    return torch.ones(n, dtype=dtype)


def _sample(**bad):
    args = dict(logits=torch.randn(B, V), temperature=_rows(), top_k=_rows(torch.int64), top_p=_rows(),
                min_p=_rows(torch.float32) * 0, seeds=torch.arange(B))
    return lambda: K.sample(**(args | bad))


def _penalties(**bad):
    args = dict(logits=torch.randn(B, V), counts=torch.zeros(2, V, dtype=torch.int32),
                prompt_mask=torch.zeros(2, V, dtype=torch.uint8), rows=torch.zeros(B, dtype=torch.int32),
                presence=_rows(), frequency=_rows(), repetition=_rows())
    return lambda: K.apply_penalties(**(args | bad))


def _caches(dtype=torch.float32):
    return torch.zeros(4, 16, 2, D, dtype=dtype), torch.zeros(4, 16, 2, D, dtype=dtype)


def _store(**bad):
    k_cache, v_cache = _caches()
    args = dict(k=torch.randn(T, 2, D), v=torch.randn(T, 2, D), k_cache=k_cache, v_cache=v_cache,
                slot_mapping=torch.arange(T))
    return lambda: K.store_kv_cache(**(args | bad))


def _rotary(**bad):
    args = dict(positions=torch.arange(T), q=torch.randn(T, 4, D), k=torch.randn(T, 2, D),
                cos_sin_cache=torch.randn(64, D))
    return lambda: K.rotary_embedding(**(args | bad))


def _qk_norm_rotary(**bad):
    k_cache, v_cache = _caches()
    args = dict(positions=torch.arange(T), qkv=torch.randn(T, 8 * D), q_weight=torch.ones(D), k_weight=torch.ones(D),
                eps=1e-6, cos_sin_cache=torch.randn(64, D), k_cache=k_cache, v_cache=v_cache,
                slot_mapping=torch.arange(T), num_heads=4, num_kv_heads=2)
    return lambda: K.qk_norm_rotary_store(**(args | bad))


def _decode(**bad):
    k_cache, v_cache = _caches()
    args = dict(q=torch.randn(2, 4, D), k_cache=k_cache, v_cache=v_cache,
                seq_lens=torch.tensor([3, 20], dtype=torch.int32), block_tables=torch.zeros(2, 2, dtype=torch.int32))
    return lambda: K.decode_attention(**(args | bad))


def _prefill(**bad):
    k_cache, v_cache = _caches()
    args = dict(q=torch.randn(T, 4, D), k_cache=k_cache, v_cache=v_cache,
                cu_seqlens_q=torch.tensor([0, 2, T], dtype=torch.int32), seq_lens=torch.tensor([2, 3], dtype=torch.int32),
                block_tables=torch.zeros(2, 1, dtype=torch.int32))
    return lambda: K.prefill_attention(**(args | bad))


def _fused_moe(**bad):
    args = dict(x=torch.randn(T, D), w13=torch.randn(4, 8, D), w2=torch.randn(4, D, 4), topk_weights=torch.rand(T, 2),
                topk_ids=torch.zeros(T, 2, dtype=torch.int32))
    return lambda: K.fused_moe(**(args | bad))


CASES = {
    # per-row tensors shorter than the batch, strided, or of the wrong kind
    "sample temperature short": (_sample(temperature=_rows(n=1)), ValueError, "temperature"),
    "sample top_p strided": (_sample(top_p=torch.ones(2 * B)[::2]), ValueError, "top_p"),
    "sample top_k float": (_sample(top_k=_rows()), TypeError, "top_k"),
    "sample min_p int": (_sample(min_p=_rows(torch.int32)), TypeError, "min_p"),
    "sample seeds float": (_sample(seeds=_rows()), TypeError, "seeds"),
    "sample logits 1-D": (_sample(logits=torch.randn(V)), ValueError, "logits"),
    "sample logits int": (_sample(logits=torch.zeros(B, V, dtype=torch.int32)), TypeError, "logits"),
    "logprobs ids short": (lambda: K.compute_logprobs(torch.randn(B, V), torch.zeros(1, dtype=torch.int64)),
                           ValueError, "token_ids"),
    "logprobs ids float": (lambda: K.compute_logprobs(torch.randn(B, V), _rows()), TypeError, "token_ids"),
    "top logprobs logits 3-D": (lambda: K.compute_top_logprobs(torch.randn(1, B, V), 2), ValueError, "logits"),
    "penalties rows short": (_penalties(rows=torch.zeros(1, dtype=torch.int32)), ValueError, "rows"),
    "penalties repetition short": (_penalties(repetition=_rows(n=2)), ValueError, "repetition"),
    "penalties presence int": (_penalties(presence=_rows(torch.int64)), TypeError, "presence"),
    "count_tokens ids short": (lambda: K.count_tokens(torch.zeros(2, V, dtype=torch.int32),
                                                      torch.zeros(3, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)),
                               ValueError, "token_ids"),
    "count_tokens rows float": (lambda: K.count_tokens(torch.zeros(2, V, dtype=torch.int32), _rows(),
                                                       torch.zeros(3, dtype=torch.int32)), TypeError, "rows"),
    # index tensors of floats
    "store slots float": (_store(slot_mapping=torch.arange(T).float()), TypeError, "slot_mapping"),
    "store slots strided": (_store(slot_mapping=torch.arange(2 * T)[::2]), ValueError, "slot_mapping"),
    "store k int": (_store(k=torch.zeros(T, 2, D, dtype=torch.int32)), TypeError, "k"),
    "store caches of two dtypes": (_store(k_cache=_caches(torch.bfloat16)[0]), ValueError, "v_cache"),
    "rotary positions float": (_rotary(positions=torch.arange(T).float()), TypeError, "positions"),
    "rotary positions short": (_rotary(positions=torch.arange(T - 1)), ValueError, "positions"),
    "rotary cos_sin_cache bf16": (_rotary(cos_sin_cache=torch.randn(64, D).bfloat16()), TypeError, "cos_sin_cache"),
    "rotary odd head_dim": (_rotary(q=torch.randn(T, 4, 7), k=torch.randn(T, 2, 7), cos_sin_cache=torch.randn(64, 7)),
                            ValueError, "head_dim"),
    "rotary k 2-D": (_rotary(k=torch.randn(T, D)), ValueError, "k"),
    "rotary cos_sin_cache 1-D": (_rotary(cos_sin_cache=torch.randn(64)), ValueError, "cos_sin_cache"),
    "qk_norm_rotary positions float": (_qk_norm_rotary(positions=torch.arange(T).float()), TypeError, "positions"),
    "qk_norm_rotary slots float": (_qk_norm_rotary(slot_mapping=torch.arange(T).double()), TypeError, "slot_mapping"),
    "qk_norm_rotary k_weight strided": (_qk_norm_rotary(k_weight=torch.ones(2 * D)[::2]), ValueError, "k_weight"),
    "gather blocks strided": (lambda: K.gather_kv_blocks(*_caches(), torch.arange(4)[::2], torch.float32), ValueError,
                              "blocks"),
    "gather blocks float": (lambda: K.gather_kv_blocks(*_caches(), torch.zeros(2), torch.float32), TypeError, "blocks"),
    "gather block_size 24": (lambda: K.gather_kv_blocks(torch.zeros(2, 24, 1, D), torch.zeros(2, 24, 1, D),
                                                        torch.arange(2), torch.float32), ValueError, "block_size"),
    "qk_norm_rotary cos_sin_cache f16": (_qk_norm_rotary(cos_sin_cache=torch.randn(64, D).half()), TypeError,
                                         "cos_sin_cache"),
    "decode seq_lens int64": (_decode(seq_lens=torch.tensor([3, 20])), TypeError, "seq_lens"),
    "decode seq_lens strided": (_decode(seq_lens=torch.tensor([3, 0, 20], dtype=torch.int32)[::2]), ValueError,
                                "seq_lens"),
    "decode block_tables float": (_decode(block_tables=torch.zeros(2, 2)), TypeError, "block_tables"),
    "decode block_tables strided": (_decode(block_tables=torch.zeros(2, 4, dtype=torch.int32)[:, ::2]), ValueError,
                                    "block_tables"),
    "decode q int": (_decode(q=torch.zeros(2, 4, D, dtype=torch.int32), k_cache=_caches(torch.int32)[0],
                             v_cache=_caches(torch.int32)[1]), TypeError, "q"),
    "prefill cu_seqlens int64": (_prefill(cu_seqlens_q=torch.tensor([0, 2, T])), TypeError, "cu_seqlens_q"),
    "moe_align ids float": (lambda: K.moe_align(torch.zeros(T, 2), 4, 16), TypeError, "topk_ids"),
    "moe_route logits int": (lambda: K.moe_route(torch.zeros(T, 4, dtype=torch.int32), 2, True), TypeError,
                             "router_logits"),
    "fused_moe ids float": (_fused_moe(topk_ids=torch.zeros(T, 2)), TypeError, "topk_ids"),
    "fused_moe top-0": (_fused_moe(topk_weights=torch.zeros(T, 0), topk_ids=torch.zeros(T, 0, dtype=torch.int32)),
                        ValueError, "topk_ids"),
    "rms_norm x 0-d": (lambda: K.rms_norm(torch.tensor(1.0), torch.ones(1), 1e-6), ValueError, "x"),
    "rms_norm x int": (lambda: K.rms_norm(torch.ones(T, D, dtype=torch.int32), torch.ones(D), 1e-6), TypeError, "x"),
    "rms_norm weight strided": (lambda: K.rms_norm(torch.randn(T, D), torch.ones(2 * D)[::2], 1e-6), ValueError,
                                "weight"),
    # written in place, so no contiguous copy would do: rows must be contiguous and evenly spaced
    "fused_add_rms_norm x transposed": (lambda: K.fused_add_rms_norm(torch.randn(D, T).t(), torch.randn(T, D),
                                                                     torch.ones(D), 1e-6), ValueError, "x"),
    "fused_add_rms_norm residual unevenly spaced": (
        lambda: K.fused_add_rms_norm(torch.randn(T, 2, D), torch.randn(2, T, D).transpose(0, 1), torch.ones(D), 1e-6),
        ValueError, "residual"),
    "fused_add_rms_norm weight strided": (lambda: K.fused_add_rms_norm(torch.randn(T, D), torch.randn(T, D),
                                                                       torch.ones(D, 2)[:, 0], 1e-6), ValueError,
                                          "weight"),
    "rms_norm out of another dtype": (lambda: K.rms_norm(torch.randn(T, D), torch.ones(D), 1e-6,
                                                         out=torch.empty(T, D, dtype=torch.float16)), ValueError, "out"),
    "silu_and_mul x int": (lambda: K.silu_and_mul(torch.ones(T, 8, dtype=torch.int64)), TypeError, "x"),
    "silu_and_mul out too short": (lambda: K.silu_and_mul(torch.randn(T, 8), out=torch.empty(T - 1, 4)), ValueError,
                                   "out"),
    # written, so no two elements may share memory (an expanded tensor): each would keep one row's values
    "silu_and_mul out expanded": (lambda: K.silu_and_mul(torch.randn(T, 8), out=torch.empty(1, 4).expand(T, 4)),
                                  ValueError, "out"),
    "fused_add_rms_norm residual expanded": (lambda: K.fused_add_rms_norm(torch.randn(T, D), torch.randn(1, D).expand(T, D),
                                                                          torch.ones(D), 1e-6), ValueError, "residual"),
    "prefill out expanded": (_prefill(out=torch.empty(1, 4, D).expand(T, 4, D)), ValueError, "out"),
    "decode out expanded": (_decode(out=torch.empty(2, 1, D).expand(2, 4, D)), ValueError, "out"),
    "rotary q expanded": (_rotary(q=torch.randn(1, 4, D).expand(T, 4, D)), ValueError, "q"),
    "fused_moe out expanded": (_fused_moe(out=torch.empty(1, D).expand(T, D)), ValueError, "out"),
    "qk_norm_rotary out expanded": (_qk_norm_rotary(out=torch.empty(1, 4, D).expand(T, 4, D)), ValueError, "out"),
    "linear out expanded": (lambda: K.linear(torch.randn(T, D), torch.randn(8, D), out=torch.empty(T, 1).expand(T, 8)),
                            ValueError, "out"),
    "apply_penalties logits expanded": (
        lambda: K.apply_penalties(torch.ones(1, 8).expand(B, 8), torch.ones(B, 8, dtype=torch.int32),
                                  torch.zeros(B, 8, dtype=torch.uint8), torch.arange(B), torch.zeros(B), torch.zeros(B),
                                  torch.full((B,), 2.0)), ValueError, "logits"),
    "count_tokens counts expanded": (lambda: K.count_tokens(torch.zeros(1, 8, dtype=torch.int32).expand(3, 8),
                                                            torch.arange(3), torch.full((3,), 5)), ValueError, "counts"),
    # host values a launch would take as they are
    "store caches of ints": (_store(k_cache=torch.zeros(4, 16, 2, D, dtype=torch.int8),
                                    v_cache=torch.zeros(4, 16, 2, D, dtype=torch.int8)), TypeError, "k_cache"),
    "store k 2-D": (_store(k=torch.randn(T, D)), ValueError, "k"),
    "prefill max_q_len 0 with queries": (_prefill(max_q_len=0), ValueError, "max_q_len"),
    "decode scale a tensor": (_decode(scale=torch.tensor(0.25)), TypeError, "scale"),
    "decode config missing keys": (_decode(config={"num_warps": 1}), ValueError, "config"),
    "decode no KV heads": (_decode(k_cache=torch.zeros(4, 16, 0, D), v_cache=torch.zeros(4, 16, 0, D)), ValueError,
                           "heads"),
    "count_tokens counts 0-d": (lambda: K.count_tokens(torch.tensor(0, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                                                       torch.zeros(1, dtype=torch.int32)), ValueError, "counts"),
    "sample of no vocabulary": (_sample(logits=torch.empty(B, 0)), ValueError, "logits"),
    "fused_moe no experts": (_fused_moe(w13=torch.randn(0, 8, D), w2=torch.randn(0, D, 4)), ValueError, "w13"),
    "moe_align no experts": (lambda: K.moe_align(torch.zeros(T, 2, dtype=torch.int32), 0, 16), ValueError,
                             "num_experts"),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_argument_is_named(case):
    call, error, name = CASES[case]
    with pytest.raises(error, match=rf"\b{name}\b"):
        call()



EMPTY = {  # call on inputs of no rows / tokens -> the expected result's shape (the contract: no launch, empty result)
    "rms_norm": (lambda: K.rms_norm(torch.empty(0, D), torch.ones(D), 1e-6), (0, D)),
    "silu_and_mul": (lambda: K.silu_and_mul(torch.empty(0, 8)), (0, 4)),
    "decode_attention": (lambda: _decode(q=torch.empty(0, 4, D), seq_lens=torch.empty(0, dtype=torch.int32),
                                         block_tables=torch.empty(0, 2, dtype=torch.int32))(), (0, 4, D)),
    "prefill_attention": (lambda: _prefill(q=torch.empty(0, 4, D), cu_seqlens_q=torch.zeros(1, dtype=torch.int32),
                                           seq_lens=torch.empty(0, dtype=torch.int32),
                                           block_tables=torch.empty(0, 1, dtype=torch.int32))(), (0, 4, D)),
    "sample": (lambda: K.sample(torch.empty(0, V), torch.empty(0), torch.empty(0, dtype=torch.int64), torch.empty(0),
                                torch.empty(0)), (0,)),
    "compute_logprobs": (lambda: K.compute_logprobs(torch.empty(0, V), torch.empty(0, dtype=torch.int64)), (0,)),
    "apply_penalties": (lambda: _penalties(logits=torch.empty(0, V), rows=torch.empty(0, dtype=torch.int32),
                                           presence=torch.empty(0), frequency=torch.empty(0),
                                           repetition=torch.empty(0))(), (0, V)),
    "fused_moe": (lambda: _fused_moe(x=torch.empty(0, D), topk_weights=torch.empty(0, 2),
                                     topk_ids=torch.empty(0, 2, dtype=torch.int32))(), (0, D)),
    "rms_norm of zero-width rows": (lambda: K.rms_norm(torch.empty(T, 0), torch.ones(0), 1e-6), (T, 0)),
    "fused_add_rms_norm of zero-width rows": (
        lambda: K.fused_add_rms_norm(torch.empty(2, T, 0), torch.empty(2, T, 0), torch.ones(0), 1e-6)[0], (2, T, 0)),
    "prefill_attention of no heads": (lambda: _prefill(q=torch.empty(T, 0, D))(), (T, 0, D)),
    "decode_attention of no heads": (lambda: _decode(q=torch.empty(2, 0, D))(), (2, 0, D)),
}


@pytest.mark.parametrize("name", EMPTY)
def test_empty_inputs_give_empty_results(name):
    call, shape = EMPTY[name]
    assert tuple(call().shape) == shape


def test_empty_in_place_calls_change_nothing():
    k_cache, v_cache = _caches()
    _store(k=torch.empty(0, 2, D), v=torch.empty(0, 2, D), k_cache=k_cache, v_cache=v_cache,
           slot_mapping=torch.empty(0, dtype=torch.int64))()
    assert not k_cache.any() and not v_cache.any()
    q, k = torch.empty(0, 4, D), torch.empty(0, 2, D)
    rotated = K.rotary_embedding(torch.empty(0, dtype=torch.int64), q, k, torch.randn(64, D))
    assert rotated[0] is q and rotated[1] is k
    counts = torch.zeros(2, V, dtype=torch.int32)
    K.count_tokens(counts, torch.empty(0, dtype=torch.int32), torch.empty(0, dtype=torch.int32))
    assert not counts.any()
