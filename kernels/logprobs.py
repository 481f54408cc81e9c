"""Log-probabilities: of one chosen token per row (compute_logprobs), and of each row's k most likely
tokens (compute_top_logprobs); each one online max / sum-exp pass over the logits."""
import torch
import triton
import triton.language as tl

from tritonllm.kernels.checks import INDICES, check_logits, check_rows
from tritonllm.kernels.tuning import Tunable, dtype_name, pow2


@triton.jit
def _compute_logprobs_kernel(logits_ptr, stride, token_ptr, out_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride
    m = float("-inf")
    z = 0.0
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        # An all -inf prefix keeps m = -inf: rescale against 0 there, not -inf (NaN).
        ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        z = z * tl.exp(m - ref) + tl.sum(tl.exp(x - ref), 0)
        m = m_new
    x_token = tl.load(row_ptr + tl.load(token_ptr + row).to(tl.int64)).to(tl.float32)
    tl.store(out_ptr + row, x_token - m - tl.log(z))


def _space(dtype, vocab):
    return [{"BLOCK": block, "num_warps": warps} for block in (1024, 2048, 4096, 8192) for warps in (4, 8, 16)
            if block <= max(vocab, 1024)]


def _default(dtype, vocab):
    return {"BLOCK": min(4096, max(vocab, 128)), "num_warps": 8}


_TUNING = Tunable("compute_logprobs", _space, _default)


def compute_logprobs_bucket(dtype: torch.dtype, vocab: int) -> tuple:
    """The tuning bucket of compute_logprobs on [B, vocab] logits of `dtype` (any B)."""
    return dtype_name(dtype), pow2(vocab)


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits.float())[b, token_ids[b]] for every row b.

    logits [B, V] float32/float16/bfloat16 (rows may be strided); token_ids [B] int32/int64, each
    in [0, V). Returns float32 [B]; nothing is modified in place.
    """
    batch, vocab = check_logits(logits)
    check_rows(batch, INDICES, token_ids=token_ids)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    out = torch.empty(batch, dtype=torch.float32, device=logits.device)
    if batch == 0:
        return out

    def launch(config):
        _compute_logprobs_kernel[(batch,)](logits, logits.stride(0), token_ids, out, vocab, **config)

    launch(_TUNING.config(compute_logprobs_bucket(logits.dtype, vocab), launch))
    return out


TOP_SLOTS = 32  # the running top-k list's width (k <= MAX_TOP_LOGPROBS): one compile serves every k
MAX_TOP_LOGPROBS = 20
TOP_BLOCK = 2048
NEG_INF = tl.constexpr(float("-inf"))
INT_MAX = tl.constexpr(2**31 - 1)


@triton.jit
def _best(x, ids):
    """The first element of (x desc, id asc) order: its (value, id)."""
    best = tl.max(x, 0)
    return best, tl.min(tl.where(x == best, ids, INT_MAX), 0)


@triton.jit
def _worst(top_x, top_i, live, SLOTS: tl.constexpr):
    """The last live entry of the top list in (x desc, id asc) order: its (value, id, slot)."""
    worst = tl.min(tl.where(live, top_x, float("inf")), 0)
    at = live & (top_x == worst)
    worst_i = tl.max(tl.where(at, top_i, -1), 0)
    return worst, worst_i, tl.min(tl.where(at & (top_i == worst_i), tl.arange(0, SLOTS), SLOTS), 0)


@triton.jit(do_not_specialize=["k"])  # one compile for every k
def _top_logprobs_kernel(logits_ptr, stride, values_ptr, ids_ptr, V, k, BLOCK: tl.constexpr, SLOTS: tl.constexpr):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride
    live = tl.arange(0, SLOTS) < k
    # The running top k as (logit, id): empty entries (-inf, INT_MAX) lose to any element.
    top_x = tl.full([SLOTS], float("-inf"), tl.float32)
    top_i = tl.full([SLOTS], INT_MAX, tl.int32)
    m = float("-inf")
    z = 0.0
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        x = tl.where(x == x, x, NEG_INF)  # NaN counts as -inf
        m_new = tl.maximum(m, tl.max(x, 0))
        ref = tl.where(m_new == NEG_INF, 0.0, m_new)  # an all -inf prefix: rescale against 0, not -inf
        z = z * tl.exp(m - ref) + tl.sum(tl.exp(x - ref), 0)
        m = m_new
        # Move the tile's elements that beat the list's last entry in, best first: at most k, and
        # usually none once the list holds the row's large values.
        ids = tl.where(offs < V, offs, INT_MAX)
        best_x, best_i = _best(x, ids)
        worst_x, worst_i, slot = _worst(top_x, top_i, live, SLOTS)
        beats = (best_x > worst_x) | ((best_x == worst_x) & (best_i < worst_i))
        while beats:
            put = tl.arange(0, SLOTS) == slot
            top_x = tl.where(put, best_x, top_x)
            top_i = tl.where(put, best_i, top_i)
            taken = ids == best_i
            x = tl.where(taken, NEG_INF, x)
            ids = tl.where(taken, INT_MAX, ids)
            best_x, best_i = _best(x, ids)
            worst_x, worst_i, slot = _worst(top_x, top_i, live, SLOTS)
            beats = (best_x > worst_x) | ((best_x == worst_x) & (best_i < worst_i))
    lse = tl.where(m == float("inf"), m, m + tl.log(z))  # a +inf logit: z is inf - inf = NaN, the others -inf
    out = row.to(tl.int64) * k
    for j in range(0, k):  # the list in order: the best live entry each time
        best_x, best_i = _best(tl.where(live, top_x, NEG_INF), tl.where(live, top_i, INT_MAX))
        tl.store(values_ptr + out + j, tl.where(best_x == NEG_INF, NEG_INF, best_x - lse))
        tl.store(ids_ptr + out + j, best_i.to(tl.int64))
        live = live & (top_i != best_i)


def compute_top_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely tokens of each row and their log-probabilities, sorted descending.

    logits [B, V] float32/float16/bfloat16 (rows may be strided); 1 <= k <= min(20, V). Returns
    (values float32 [B, k], ids int64 [B, k]): values[b, j] = log_softmax(logits[b])[ids[b, j]],
    in (logit desc, id asc) order, so ties go to the lower id. NaN counts as -inf; -inf logits
    get -inf (and are listed, lowest ids first, when a row has fewer than k finite ones). One
    pass over the row, grid (B,), no host sync. Nothing in place.
    """
    batch, vocab = check_logits(logits)
    if not 1 <= k <= min(MAX_TOP_LOGPROBS, vocab):
        raise ValueError(f"k={k} is invalid: must be in [1, min({MAX_TOP_LOGPROBS}, V={vocab})]")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    values = torch.empty(batch, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(batch, k, dtype=torch.int64, device=logits.device)
    if batch:
        _top_logprobs_kernel[(batch,)](logits, logits.stride(0), values, ids, vocab, k,
                                       BLOCK=min(TOP_BLOCK, max(triton.next_power_of_2(vocab), 128)),
                                       SLOTS=TOP_SLOTS, num_warps=8)
    return values, ids
