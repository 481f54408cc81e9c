"""MoE benchmark cases of bench/kernels.py (issue 18): the router alone (moe_route), and a Qwen3-MoE
layer's experts from the router logits to y (moe_route + fused_moe: align, the two grouped GEMMs,
the sum over the top-k), bf16.

Shapes: Qwen3-30B-A3B (E 128, k 8, N 768, H 2048; N 384 at TP 2) and Qwen3-235B-A22B (E 128, k 8,
N 1536, H 4096) at 1 to 16384 tokens.

- Up to 256 tokens the layer is memory-bound: bytes = the weights of the distinct experts the ids
  touch (3 N H bf16 each, counted from the ids of the input sets timed) plus logits, x and y; the %
  is of the 4.24 TB/s copy ceiling (the floor). Timed as CUDA-graph replays over input sets routed
  differently, so the experts come from HBM.
- At 4096 and 16384 tokens: FLOPs = 2 T k 3 N H, % of the 690 TFLOP/s bf16 ceiling. Anchor "cuBLAS
  dense pair": torch.matmul of [T k, H] x [H, 2N] and [T k, N] x [N, H], the same FLOPs without
  the gather, the routing or the sum. Anchor "CUTLASS grouped pair": torch._grouped_mm (PyTorch's
  CUTLASS grouped GEMM on sm_90) of the same two GEMMs over the same ids' group sizes, from the router
  logits (moe_route, the group ends) on rows already in expert order: no gather, no padding, no sum.
- Anchor "torch": reference.moe_route + reference.fused_moe (a loop over the experts), eager.
"""
import torch

from kernel_cases import Case, randn, reference_anchors
from timing import MAX_INPUT_SETS, input_sets
from tritonllm import kernels
from tritonllm.kernels import reference

SHAPES = {"30B-A3B": (128, 8, 768, 2048), "30B-A3B TP2": (128, 8, 384, 2048), "235B-A22B": (128, 8, 1536, 4096)}
TOKENS = (1, 16, 64, 256, 4096, 16384)
DECODE_MAX = 256  # up to this many tokens: bytes and CUDA graphs; past it FLOPs
SETS = MAX_INPUT_SETS  # router logits for every input set bench/kernels.py may time

_weights = {}


def new_expert_weights(experts, inter, hidden):
    """Random w13 [E, 2N, H], w2 [E, H, N] bf16 on the GPU, scaled so that each stage stays O(1)."""
    return randn(experts, 2 * inter, hidden) * hidden**-0.5, randn(experts, hidden, inter) * inter**-0.5


def expert_weights(experts, inter, hidden):
    """new_expert_weights, made once per shape (the 235B layer is 4.8 GB)."""
    key = (experts, inter, hidden)
    if key not in _weights:
        _weights[key] = new_expert_weights(experts, inter, hidden)
    return _weights[key]


def router_logits(tokens, experts, index):
    """Input set `index`'s bf16 router logits, on the CPU: the same on every call."""
    generator = torch.Generator().manual_seed(1000 * tokens + index)
    return torch.randn(tokens, experts, generator=generator).to(torch.bfloat16)


def touched_bytes(tokens, experts, top_k, inter, hidden):
    """Mean bytes of a call over the input sets the bench will time: each set's distinct experts'
    weights (from its ids) plus logits, x and y."""
    def moved(index):
        distinct = router_logits(tokens, experts, index).float().topk(top_k, dim=1).indices.unique().numel()
        return distinct * 3 * inter * hidden * 2 + tokens * (experts + 2 * hidden) * 2

    estimate = sum(moved(i) for i in range(SETS)) // SETS
    used = input_sets(estimate)  # as many as bench/kernels.py will time
    return sum(moved(i) for i in range(used)) // used


def moe_cases(quick):
    shapes = [("30B-A3B", 1), ("30B-A3B", 16384)] if quick else [(name, t) for name in SHAPES for t in TOKENS]
    cases = []
    for name, tokens in shapes:
        experts, top_k, inter, hidden = SHAPES[name]
        decode = tokens <= DECODE_MAX
        calls = iter(range(10**9))

        def make(t=tokens, e=experts, n=inter, h=hidden, k=top_k, decode=decode, calls=calls):
            w13, w2 = expert_weights(e, n, h)
            logits = router_logits(t, e, next(calls) % SETS).cuda()
            dense = () if decode else (randn(t * k, h), randn(t * k, n))
            return logits, randn(t, h), w13, w2, *dense

        def triton_moe(logits, x, w13, w2, *dense, k=top_k):
            return kernels.fused_moe(x, w13, w2, *kernels.moe_route(logits, k, True))

        def torch_moe(logits, x, w13, w2, *dense, k=top_k):
            return reference.fused_moe(x, w13, w2, *reference.moe_route(logits, k, True))

        anchors = {"torch": torch_moe}
        if not decode:
            anchors["cuBLAS dense pair"] = lambda logits, x, w13, w2, a1, a2: (a1 @ w13[0].T, a2 @ w2[0].T)
            if hasattr(torch, "_grouped_mm"):
                anchors["CUTLASS grouped pair"] = grouped_pair
        label = f"{name} E{experts} k{top_k} N{inter} H{hidden} T{tokens} bf16"
        size = {"bytes": touched_bytes(tokens, experts, top_k, inter, hidden)} if decode else {
            "flops": 2 * tokens * top_k * 3 * inter * hidden}
        cases.append(Case("fused_moe", label, make, triton_moe, anchors, graph=decode, eager_anchors=("torch",),
                          **size))
    return route_cases(quick) + cases


def group_ends(topk_ids, experts):
    """Where each expert's rows end when the pairs are sorted by expert (torch._grouped_mm's offs),
    int32, with no host sync (bincount would take one)."""
    ids = topk_ids.flatten().long()
    counts = torch.zeros(experts, dtype=torch.int32, device=ids.device)
    return torch.cumsum(counts.scatter_add_(0, ids, torch.ones_like(ids, dtype=torch.int32)), 0, dtype=torch.int32)


def grouped_pair(logits, x, w13, w2, a1, a2, k=8):
    """The two expert GEMMs as PyTorch's grouped GEMM over the router's group sizes, rows pre-sorted."""
    ends = group_ends(kernels.moe_route(logits, k, True)[1], w13.shape[0])
    return (torch._grouped_mm(a1, w13.transpose(1, 2), offs=ends),
            torch._grouped_mm(a2, w2.transpose(1, 2), offs=ends))


def route_cases(quick):
    """moe_route alone on bf16 logits, E 128, k 8: bytes = logits read, weights and ids written."""
    cases = []
    for tokens in (1, 4096) if quick else TOKENS:
        cases.append(Case(
            "moe_route", f"T{tokens} x E128 top-8 bf16", lambda t=tokens: (randn(t, 128), 8, True),
            kernels.moe_route, reference_anchors(reference.moe_route), bytes=tokens * (128 * 2 + 8 * 8),
            graph=tokens <= DECODE_MAX,
        ))
    return cases
