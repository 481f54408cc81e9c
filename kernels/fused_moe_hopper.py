"""Hopper (sm_90) path of fused_moe's two grouped GEMMs: persistent, warp-specialized Gluon kernels.

The same work as kernels/fused_moe.py's `_moe_gate_up_kernel` and `_moe_down_kernel` (a tile is a
block of BLOCK_M slots of one expert by BLOCK_N columns; the same roundings), scheduled by hand:

- persistent: one program an SM strides over the used blocks' tiles, whose count (moe_align's
  num_padded) is read on the GPU, so the launch needs no host sync and stays graph capturable;
- a loader partition fills a ring of NUM_STAGES shared-memory slots, each with a `ready`
  barrier: the expert's weight tiles by TMA; gate/up's BLOCK_M token rows of x gathered through
  sorted_ids by cp.async (Hopper's TMA has no gather; each loader thread's arrival on the barrier
  fires when its own copies land); down's intermediate rows by TMA;
- a consumer warpgroup per 64 rows runs the dots as asynchronous wgmma from shared memory with one
  k-step in flight, frees each slot as soon as its dots are done, and runs the epilogue (SiLU-and-
  mul; or the routing weight and the store to each pair's row) while the loader already fills the
  next tile's slots.
"""
import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from tritonllm.kernels import tuning
from tritonllm.kernels.prefill_attention_hopper import _cp_async, _sm_count, _tma_load


@gluon.jit
def _tile_of(tile, block_expert_ptr, num_m, num_n, GROUP_M: gl.constexpr):
    """Tile `tile`'s block, column tile and expert: GROUP_M blocks down a column before moving right
    (the order of fused_moe._tile), so one expert's weight tile is read while it is in L2."""
    width = GROUP_M * num_n
    first_m = tile // width * GROUP_M
    group = gl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (tile % width) % group
    return pid_m, (tile % width) // group, gl.load(block_expert_ptr + pid_m)


@gluon.jit
def _wait_free(free, count, NUM_STAGES: gl.constexpr):
    """Slot count % NUM_STAGES once the consumers freed it (slots start free)."""
    slot = count % NUM_STAGES
    mbarrier.wait(free.index(slot), ((count // NUM_STAGES) & 1) ^ 1)
    return slot


@gluon.jit
def _gate_up_loader(x_ptr, w_desc, a_bufs, w_bufs, ready_a, ready_w, free, sorted_ptr, block_expert_ptr,
                    num_padded_ptr, num_pairs, top_k, inter, hidden, stride_x, BLOCK_M: gl.constexpr,
                    BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr,
                    EVEN_K: gl.constexpr):
    # 16-byte vectors: BLOCK_K / 8 threads a row, 4 warps.
    ROWS: gl.constexpr = gl.BlockedLayout([1, 8], [256 // BLOCK_K, BLOCK_K // 8], [4, 1], [1, 0])
    num_m = gl.load(num_padded_ptr) // BLOCK_M
    num_n = gl.cdiv(inter, BLOCK_N)
    offs_k = gl.arange(0, BLOCK_K, gl.SliceLayout(0, ROWS))
    count = 0
    for tile in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
        pid_m, pid_n, expert = _tile_of(tile, block_expert_ptr, num_m, num_n, GROUP_M)
        pairs = gl.load(sorted_ptr + pid_m * BLOCK_M + gl.arange(0, BLOCK_M, gl.SliceLayout(1, ROWS)))
        # Padding slots read token 0: no row mask.
        tokens = gl.where(pairs < num_pairs, pairs // top_k, 0)
        a_ptrs = x_ptr + tokens.to(gl.int64)[:, None] * stride_x + offs_k[None, :]
        gate_row = expert * (2 * inter) + pid_n * BLOCK_N
        for k0 in range(0, hidden, BLOCK_K):
            slot = _wait_free(free, count, NUM_STAGES)
            # Rows past this expert's gate (or up) rows belong to columns that are not stored; K past H
            # reads zeros.
            mbarrier.expect(ready_w.index(slot), 2 * w_desc.block_type.nbytes)
            _tma_load(w_desc, [gate_row, k0], ready_w.index(slot), w_bufs.index(2 * slot))
            _tma_load(w_desc, [gate_row + inter, k0], ready_w.index(slot), w_bufs.index(2 * slot + 1))
            if EVEN_K:
                _cp_async(a_bufs.index(slot), a_ptrs + k0)
            else:
                _cp_async(a_bufs.index(slot), a_ptrs + k0, mask=(offs_k < hidden - k0)[None, :])
            async_copy.mbarrier_arrive(ready_a.index(slot), increment_count=False)
            count += 1


@gluon.jit
def _gate_up_consumer(out_ptr, a_bufs, w_bufs, ready_a, ready_w, free, block_expert_ptr, num_padded_ptr, inter,
                      hidden, stride_out, WARPGROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr):
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK_N, 16])
    IO: gl.constexpr = gl.BlockedLayout([1, 8], [256 // BLOCK_N, BLOCK_N // 8], [4, 1], [1, 0])
    num_m = gl.load(num_padded_ptr) // BLOCK_M
    num_n = gl.cdiv(inter, BLOCK_N)
    count = 0
    for tile in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
        pid_m, pid_n, expert = _tile_of(tile, block_expert_ptr, num_m, num_n, GROUP_M)
        acc_g = gl.zeros([64, BLOCK_N], gl.float32, ACC)
        acc_u = gl.zeros([64, BLOCK_N], gl.float32, ACC)
        for k0 in range(0, hidden, BLOCK_K):
            slot = count % NUM_STAGES
            phase = (count // NUM_STAGES) & 1
            mbarrier.wait(ready_a.index(slot), phase)
            mbarrier.wait(ready_w.index(slot), phase)
            # cp.async writes through the generic proxy, wgmma reads through the async one.
            fence_async_shared()
            a = a_bufs.index(slot).slice(WARPGROUP * 64, 64)
            acc_g = warpgroup_mma(a, w_bufs.index(2 * slot).permute((1, 0)), acc_g, is_async=True)
            acc_u = warpgroup_mma(a, w_bufs.index(2 * slot + 1).permute((1, 0)), acc_u, is_async=True)
            # This k-step's two dots stay in flight; the previous step's are done, so its slot is free.
            acc_g, acc_u = warpgroup_mma_wait(2, deps=(acc_g, acc_u))
            if k0 > 0:
                mbarrier.arrive(free.index((count - 1) % NUM_STAGES), count=1)
            count += 1
        acc_g, acc_u = warpgroup_mma_wait(0, deps=(acc_g, acc_u))
        mbarrier.arrive(free.index((count - 1) % NUM_STAGES), count=1)
        # As HF and silu_and_mul: gate and up rounded to the model dtype, then silu(gate) (tl.sigmoid's
        # formula), then the product.
        dtype: gl.constexpr = out_ptr.dtype.element_ty
        gate = acc_g.to(dtype).to(gl.float32)
        act = (gate * (1 / (1 + gl.exp(-gate)))).to(dtype).to(gl.float32) * acc_u.to(dtype).to(gl.float32)
        act = gl.convert_layout(act.to(dtype), IO)
        rows = pid_m * BLOCK_M + WARPGROUP * 64 + gl.arange(0, 64, gl.SliceLayout(1, IO))
        cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(0, IO))
        gl.store(out_ptr + rows.to(gl.int64)[:, None] * stride_out + cols[None, :], act, mask=(cols < inter)[None, :])


@gluon.jit
def _moe_gate_up_hopper_kernel(x_ptr, w_desc, out_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, num_pairs, top_k,
                               inter, hidden, stride_x, stride_out, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                               BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr,
                               EVEN_K: gl.constexpr, A_LAYOUT: gl.constexpr):
    WARPGROUPS: gl.constexpr = BLOCK_M // 64
    a_bufs = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [NUM_STAGES, BLOCK_M, BLOCK_K], A_LAYOUT)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [2 * NUM_STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    ready_a = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    ready_w = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(ready_a.index(s), count=128)  # every loader thread arrives once its copies land
        mbarrier.init(ready_w.index(s), count=1)
        mbarrier.init(free.index(s), count=WARPGROUPS)
    fence_async_shared()
    if WARPGROUPS == 1:
        gl.warp_specialize([
            (_gate_up_consumer, (out_ptr, a_bufs, w_bufs, ready_a, ready_w, free, block_expert_ptr, num_padded_ptr,
                                 inter, hidden, stride_out, 0, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_STAGES)),
            (_gate_up_loader, (x_ptr, w_desc, a_bufs, w_bufs, ready_a, ready_w, free, sorted_ptr, block_expert_ptr,
                               num_padded_ptr, num_pairs, top_k, inter, hidden, stride_x, BLOCK_M, BLOCK_N, BLOCK_K,
                               GROUP_M, NUM_STAGES, EVEN_K)),
        ], [4], [56])
    else:
        gl.warp_specialize([
            (_gate_up_consumer, (out_ptr, a_bufs, w_bufs, ready_a, ready_w, free, block_expert_ptr, num_padded_ptr,
                                 inter, hidden, stride_out, 0, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_STAGES)),
            (_gate_up_consumer, (out_ptr, a_bufs, w_bufs, ready_a, ready_w, free, block_expert_ptr, num_padded_ptr,
                                 inter, hidden, stride_out, 1, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_STAGES)),
            (_gate_up_loader, (x_ptr, w_desc, a_bufs, w_bufs, ready_a, ready_w, free, sorted_ptr, block_expert_ptr,
                               num_padded_ptr, num_pairs, top_k, inter, hidden, stride_x, BLOCK_M, BLOCK_N, BLOCK_K,
                               GROUP_M, NUM_STAGES, EVEN_K)),
        ], [4, 4], [224, 56])


@gluon.jit
def _down_loader(a_desc, w_desc, a_bufs, w_bufs, ready, free, block_expert_ptr, num_padded_ptr, inter, hidden,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
                 NUM_STAGES: gl.constexpr):
    num_m = gl.load(num_padded_ptr) // BLOCK_M
    num_n = gl.cdiv(hidden, BLOCK_N)
    count = 0
    for tile in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
        pid_m, pid_n, expert = _tile_of(tile, block_expert_ptr, num_m, num_n, GROUP_M)
        for k0 in range(0, inter, BLOCK_K):
            slot = _wait_free(free, count, NUM_STAGES)
            # K past N reads zeros from both.
            mbarrier.expect(ready.index(slot), a_desc.block_type.nbytes + w_desc.block_type.nbytes)
            _tma_load(a_desc, [pid_m * BLOCK_M, k0], ready.index(slot), a_bufs.index(slot))
            _tma_load(w_desc, [expert * hidden + pid_n * BLOCK_N, k0], ready.index(slot), w_bufs.index(slot))
            count += 1


@gluon.jit
def _down_consumer(out_ptr, a_bufs, w_bufs, ready, free, sorted_ptr, block_expert_ptr, num_padded_ptr, weights_ptr,
                   num_pairs, inter, hidden, stride_out, WARPGROUP: gl.constexpr, BLOCK_M: gl.constexpr,
                   BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr):
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK_N, 16])
    IO: gl.constexpr = gl.BlockedLayout([1, 8], [256 // BLOCK_N, BLOCK_N // 8], [4, 1], [1, 0])
    num_m = gl.load(num_padded_ptr) // BLOCK_M
    num_n = gl.cdiv(hidden, BLOCK_N)
    count = 0
    for tile in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
        pid_m, pid_n, expert = _tile_of(tile, block_expert_ptr, num_m, num_n, GROUP_M)
        acc = gl.zeros([64, BLOCK_N], gl.float32, ACC)
        for k0 in range(0, inter, BLOCK_K):
            slot = count % NUM_STAGES
            mbarrier.wait(ready.index(slot), (count // NUM_STAGES) & 1)
            acc = warpgroup_mma(a_bufs.index(slot).slice(WARPGROUP * 64, 64), w_bufs.index(slot).permute((1, 0)),
                                acc, is_async=True)
            acc = warpgroup_mma_wait(1, deps=(acc,))
            if k0 > 0:
                mbarrier.arrive(free.index((count - 1) % NUM_STAGES), count=1)
            count += 1
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(free.index((count - 1) % NUM_STAGES), count=1)
        # Each row times its pair's weight in float32, rounded to x's dtype, to the pair's row.
        out = gl.convert_layout(acc, IO)
        rows = pid_m * BLOCK_M + WARPGROUP * 64 + gl.arange(0, 64, gl.SliceLayout(1, IO))
        pairs = gl.load(sorted_ptr + rows)
        valid = pairs < num_pairs
        out = out * gl.load(weights_ptr + pairs, mask=valid, other=0.0)[:, None]
        cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(0, IO))
        gl.store(out_ptr + pairs.to(gl.int64)[:, None] * stride_out + cols[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (cols < hidden)[None, :])


@gluon.jit
def _moe_down_hopper_kernel(a_desc, w_desc, out_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, weights_ptr,
                            num_pairs, inter, hidden, stride_out, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                            BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr):
    WARPGROUPS: gl.constexpr = BLOCK_M // 64
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [NUM_STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(free.index(s), count=WARPGROUPS)
    fence_async_shared()
    if WARPGROUPS == 1:
        gl.warp_specialize([
            (_down_consumer, (out_ptr, a_bufs, w_bufs, ready, free, sorted_ptr, block_expert_ptr, num_padded_ptr,
                              weights_ptr, num_pairs, inter, hidden, stride_out, 0, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                              NUM_STAGES)),
            (_down_loader, (a_desc, w_desc, a_bufs, w_bufs, ready, free, block_expert_ptr, num_padded_ptr, inter,
                            hidden, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_STAGES)),
        ], [1], [24])
    else:
        gl.warp_specialize([
            (_down_consumer, (out_ptr, a_bufs, w_bufs, ready, free, sorted_ptr, block_expert_ptr, num_padded_ptr,
                              weights_ptr, num_pairs, inter, hidden, stride_out, 0, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                              NUM_STAGES)),
            (_down_consumer, (out_ptr, a_bufs, w_bufs, ready, free, sorted_ptr, block_expert_ptr, num_padded_ptr,
                              weights_ptr, num_pairs, inter, hidden, stride_out, 1, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                              NUM_STAGES)),
            (_down_loader, (a_desc, w_desc, a_bufs, w_bufs, ready, free, block_expert_ptr, num_padded_ptr, inter,
                            hidden, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_STAGES)),
        ], [4, 1], [240, 24])


def _hopper_space(dtype_name, experts, inter, hidden, tokens):
    return [{"BLOCK_M": block_m, "BLOCK_N": block_n, "DOWN_BLOCK_N": down_n, "NUM_STAGES": stages, "GROUP_M": 8}
            for block_m in (64, 128) for block_n in (64, 128) for down_n in (128, 256) for stages in (3, 4)]


def _hopper_default(dtype_name, experts, inter, hidden, tokens):
    return {"BLOCK_M": 128, "BLOCK_N": 128, "DOWN_BLOCK_N": 256, "NUM_STAGES": 3, "GROUP_M": 8}


HOPPER_TUNABLE = tuning.Tunable("fused_moe_hopper", _hopper_space, _hopper_default)
BLOCK_K = 64  # 128-byte rows of 16-bit values: one swizzle atom wide


@functools.cache
def _is_sm90(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def supports(x, w13, w2, rows_per_expert) -> bool:
    """Whether the Hopper kernels take these inputs: an sm_90 GPU, bf16/fp16, contiguous 16-byte-aligned
    weights with rows of 16-byte multiples, and prefill-sized calls (at least 64 pairs an expert on
    average; decode-sized calls stream weights, which the portable kernels' many small programs do well)."""
    if not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16) or rows_per_expert < 64:
        return False
    if not _is_sm90(x.device.index):
        return False
    return all(t.is_contiguous() and t.data_ptr() % 16 == 0 and t.shape[-1] * t.element_size() % 16 == 0
               for t in (w13, w2)) and x.stride(0) * x.element_size() % 16 == 0 and x.data_ptr() % 16 == 0


def moe_gemms_hopper(x, w13, w2, topk_weights, sorted_ids, block_expert, num_padded, act, rows, top_k, config):
    """Both grouped GEMMs on Hopper: act [P, N] (scratch) <- SiLU-and-mul of x's gathered rows times
    w13, then rows [T*k, H] <- each pair's weight times act @ w2^T, in place; inputs as
    fused_moe's, sorted_ids / block_expert / num_padded from moe_align with block_m = BLOCK_M."""
    experts, hidden, inter = w2.shape
    block_m, block_n, down_n, stages = config["BLOCK_M"], config["BLOCK_N"], config["DOWN_BLOCK_N"], config["NUM_STAGES"]
    element = gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16
    swizzled = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    w13_rows = [experts * 2 * inter, hidden]
    w13_desc = TensorDescriptor(w13.view(w13_rows), w13_rows, [hidden, 1], [block_n, BLOCK_K], swizzled)
    a_layout = gl.NVMMASharedLayout.get_default_for([block_m, BLOCK_K], element)
    programs = _sm_count(x.device)
    _moe_gate_up_hopper_kernel[(min(block_expert.shape[0] * triton.cdiv(inter, block_n), programs),)](
        x, w13_desc, act, sorted_ids, block_expert, num_padded, topk_weights.numel(), top_k,
        inter, hidden, x.stride(0), act.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K,
        GROUP_M=config["GROUP_M"], NUM_STAGES=stages, EVEN_K=hidden % BLOCK_K == 0, A_LAYOUT=a_layout, num_warps=4)
    w2_rows = [experts * hidden, inter]
    w2_desc = TensorDescriptor(w2.view(w2_rows), w2_rows, [inter, 1], [down_n, BLOCK_K], swizzled)
    act_desc = TensorDescriptor(act, list(act.shape), [act.stride(0), 1], [block_m, BLOCK_K], swizzled)
    _moe_down_hopper_kernel[(min(block_expert.shape[0] * triton.cdiv(hidden, down_n), programs),)](
        act_desc, w2_desc, rows, sorted_ids, block_expert, num_padded, topk_weights, topk_weights.numel(), inter,
        hidden, rows.stride(0), BLOCK_M=block_m, BLOCK_N=down_n, BLOCK_K=BLOCK_K, GROUP_M=config["GROUP_M"],
        NUM_STAGES=stages, num_warps=4)
