"""Decode CUDA graphs per context bound: a step replays the graph of the smallest bound that holds
its longest context (decode attention's split count and config follow the bound), and of the
smallest batch that holds its rows."""
import random
from types import SimpleNamespace

import pytest
import torch
from graph_stand_in import count_replays, stand_in
from tiny_qwen3 import build_tiny_qwen3, hf_greedy

from tritonllm import LLM, SamplingParams
from tritonllm.engine.graphs import DecodeGraphs
from tritonllm.engine.model_runner import ModelRunner
from tritonllm.engine.warmup import SHORT_CONTEXT, graph_context_bounds


def test_context_bounds():
    assert graph_context_bounds(4096) == [SHORT_CONTEXT, 4096]
    assert graph_context_bounds(40960, short=1024) == [1024, 40960]
    assert graph_context_bounds(SHORT_CONTEXT) == [SHORT_CONTEXT]  # one set where the short bound is all
    assert graph_context_bounds(300) == [300]


@pytest.mark.parametrize("is_prefill, rows, longest, key", [
    (False, 3, 100, (2048, 4)),
    (False, 1, 2048, (2048, 1)),  # a bound holds contexts up to itself
    (False, 1, 2049, (4096, 1)),
    (False, 4, 4096, (4096, 4)),
    (False, 2, 1, (2048, 2)),
    (False, 5, 10, None),  # more rows than any graph: eager
    (False, 1, 4097, None),
    (True, 1, 10, None),
])
def test_a_step_replays_the_smallest_graph_that_holds_it(is_prefill, rows, longest, key):
    graphs = SimpleNamespace(max_model_len=4096,
                             graphs=dict.fromkeys((bound, batch) for bound in (4096, 2048) for batch in (4, 2, 1)))
    inputs = SimpleNamespace(is_prefill=is_prefill, seq_lens=torch.ones(rows), max_seq_len=longest)
    assert DecodeGraphs.key(graphs, inputs) == key


def test_padded_buffers_compute_what_eager_steps_do(tiny_qwen3):
    """The replay path's padding, on the CPU too: decode steps run the forward on the graphs' buffers.
    Three rows decode in the graph of four (its padding row stores nothing and reads one key), then two
    in the graph of two, then one alone, through the real kernels; greedy tokens equal HF's float32 ones."""
    rng = random.Random(3)
    prompts = [[rng.randrange(250) for _ in range(n)] for n in (5, 18, 33)]
    lengths = (3, 5, 7)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    with LLM(tiny_qwen3, max_num_seqs=4, enforce_eager=True) as llm:
        runner, bound = llm.runner, llm.config.max_model_len
        runner.decode_graphs = stand_in(DecodeGraphs(runner._forward, 4, runner.max_blocks_per_seq, bound,
                                                     llm.hf_config.hidden_size, llm.config.dtype, runner.device))
        replayed = count_replays(llm, "decode")
        outs = [out.token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    assert replayed == [(bound, 4)] * 2 + [(bound, 2)] * 2 + [(bound, 1)] * 2
    assert outs == [hf_greedy(tiny_qwen3, p, n) for p, n in zip(prompts, lengths)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="decode CUDA graphs need a GPU")
def test_greedy_across_the_short_bound_equals_hf(tmp_path):
    """Rows that decode past SHORT_CONTEXT keys move their steps from the short bound's graphs to the
    long one's mid-generation (and a row already past it keeps a batch there); every row's greedy
    tokens equal HF's float32 ones."""
    path = build_tiny_qwen3(tmp_path, max_position_embeddings=2 * SHORT_CONTEXT)
    generator = torch.Generator().manual_seed(0)
    lengths = (SHORT_CONTEXT - 6, 40, SHORT_CONTEXT + 9)
    prompts = [torch.randint(0, 250, (n,), generator=generator).tolist() for n in lengths]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(str(path), max_num_seqs=4, max_model_len=2 * SHORT_CONTEXT) as llm:
        assert {bound for bound, _ in llm.runner.decode_graphs.graphs} == {SHORT_CONTEXT, 2 * SHORT_CONTEXT}
        together = [out.token_ids for out in llm.generate(prompts[:2], params, use_tqdm=False)]
        alone = [out.token_ids for out in llm.generate(prompts[1:], params, use_tqdm=False)]
    assert together[0] == hf_greedy(path, prompts[0], 12)
    assert together[1] == alone[0] == hf_greedy(path, prompts[1], 12)
    assert alone[1] == hf_greedy(path, prompts[2], 12)


def graph_pool_bytes() -> int:
    """Bytes the caching allocator holds in private pools (the CUDA graphs'), not in the default pool (0, 0)."""
    return sum(s["total_size"] for s in torch.cuda.memory_snapshot() if tuple(s["segment_pool_id"]) != (0, 0))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="decode CUDA graphs need a GPU")
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_the_kv_budget_holds_the_graphs_pool(tmp_path, monkeypatch, kv_cache_dtype):
    """The KV cache is sized after a probe captured the largest decode and prefill graphs: the pool
    that all the graphs hold once captured is no larger than what the probe reserved for it."""
    probed = []
    probe = ModelRunner._graph_memory
    monkeypatch.setattr(ModelRunner, "_graph_memory", lambda runner: probed.append(probe(runner)) or probed[-1])
    path = build_tiny_qwen3(tmp_path)
    before = graph_pool_bytes()
    with LLM(str(path), max_num_seqs=48, max_model_len=512, kv_cache_dtype=kv_cache_dtype) as llm:
        held = graph_pool_bytes() - before
        assert len(llm.runner.decode_graphs.graphs) > 1 and len(llm.runner.prefill_graphs.graphs) > 1
    assert len(probed) == 1 and 0 < held <= probed[0]
