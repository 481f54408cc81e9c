"""`bench/decode_workload.py --files bench/gluon_decode_adapter.py`: the Gluon e4m3 decode prototype
(kernels/decode_attention_gluon.py) called as decode_attention is, for the workload A/B."""
from tritonllm.kernels.decode_attention_gluon import decode_attention_gluon


def decode_attention(q, k_cache, v_cache, seq_lens, block_tables, config, k_scale, v_scale):
    if config["BLOCK_N"] > 64:
        raise ValueError("the one-warp Gluon tile holds at most 64 keys")
    return decode_attention_gluon(q, k_cache, v_cache, seq_lens, block_tables, k_scale, v_scale, config)
