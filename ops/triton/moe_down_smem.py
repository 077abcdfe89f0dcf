"""The few-token MoE down product with its weights staged in shared memory while the up kernel
streams (Hopper on, Gluon; ``BASTION_MOE_DOWN_SMEM``, off by default, for A/B runs).

At batch 1 the up kernel (``fused_moe_gemv.py``) reads its 50 MB at about the stream's rate, and
the down kernel's 25 MB after it run at two thirds of it: its 255-register programs become
resident only as the up kernel's leave, and its L2 prefetch, issued any earlier, is evicted by
the up stream before it is read (docs/BENCHMARKS.md, sessions 30 and 32). Here a program is
small in registers and large in shared memory, so that it fits a SM beside the up kernel's
programs (39 registers, 8 warps, 6 a SM, no shared memory): it reads the routing's ids,
asks the tensor-memory accelerator for its ``BLOCK_N`` rows of each of the token's k experts
(``BLOCK_N * k * K`` weights: 192 KB at 16 rows of Qwen3-30B-A3B's 8 x 768) and only then
waits for the up kernel. The bytes land in shared memory while the up kernel streams, where
nothing evicts them; after the wait the program reads the up kernel's products and sums from
shared memory.

A program sums its k experts' products in float32 over ``BLOCK_K``-column steps and stores
once, like the Triton down kernel, but in its own order: the two agree to rounding, not bits.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

# Triton 3.6 (the GPU host's) names the copy engine's load async_copy_global_to_shared; later
# ones, async_load (the old name raises).
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

BLOCK_N = 16  # output rows a program: 2048 / 16 = 128 programs, one a SM
BLOCK_K = 64  # columns a weight copy and a step
ACT_K = 256  # columns a copy of the k product rows
NUM_WARPS = 2  # 64 threads at <= 64 registers fit beside six up programs of 10,240
# (form 2, BASTION_MOE_DOWN_SMEM=2: 4 warps at 80 registers beside six up programs capped at 32)
# What a program may stage: a SM's 228 KB less the driver's 1 KB a program (the six up
# programs' and this one's) and the barriers. Qwen3-30B-A3B stages 204 KB.
SMEM_LIMIT = 220 * 1024


@gluon.jit
def _gdc_wait():
    gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _gdc_launch_dependents():
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [],
                              dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _moe_down_smem_kernel(
    act_desc,
    w2_desc,
    out_ptr,
    ids_ptr,
    weights_ptr,
    expert_offset,
    num_local,
    N,
    stride_out,
    TOP_K: gl.constexpr,
    BLOCK_TOPK: gl.constexpr,
    NUM_KC: gl.constexpr,
    NUM_AC: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr,
    ACT_K: gl.constexpr,
    USE_PDL: gl.constexpr,
):
    if USE_PDL == 2:  # early mode: the next kernel may launch now (ops/triton/pdl.py)
        _gdc_launch_dependents()
    token = gl.program_id(0)
    n0 = gl.program_id(1) * BLOCK_N
    w_smem = gl.allocate_shared_memory(w2_desc.dtype, [TOP_K * NUM_KC, BLOCK_N, BLOCK_K],
                                       w2_desc.layout)
    act_smem = gl.allocate_shared_memory(act_desc.dtype, [NUM_AC, TOP_K, ACT_K],
                                         act_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [TOP_K + 1, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(TOP_K + 1):
        mbarrier.init(bars.index(j), count=1)
    fence_async_shared()
    # The routing (two kernels back) has ended: the up kernel lets this one launch only after
    # its own wait. The token's k ids and weights are read at once into every thread (a pick
    # of one is then a sum within the thread, not a round trip), and each pair's expert rows
    # are asked for now: a pair on another rank's expert (or id -1) reads local expert 0's
    # rows instead and is given weight zero.
    pick: gl.constexpr = gl.BlockedLayout([BLOCK_TOPK], [32], [gl.num_warps()], [0])
    offs_j = gl.arange(0, BLOCK_TOPK, layout=pick)
    experts = gl.load(ids_ptr + token * TOP_K + offs_j, mask=offs_j < TOP_K,
                      other=-1).to(gl.int32) - expert_offset
    local = (offs_j < TOP_K) & (experts >= 0) & (experts < num_local)
    weights = gl.load(weights_ptr + token * TOP_K + offs_j, mask=local, other=0.0)
    weights = gl.where(local, weights.to(gl.float32), 0.0)
    rows = gl.where(local, experts, 0) * N + n0
    for j in gl.static_range(TOP_K):
        row = gl.sum(gl.where(offs_j == j, rows, 0), axis=0)
        mbarrier.expect(bars.index(j), NUM_KC * BLOCK_N * BLOCK_K * 2)
        for c in gl.static_range(NUM_KC):
            _tma_load(w2_desc, [row, c * BLOCK_K], bars.index(j),
                                            w_smem.index(j * NUM_KC + c))
    _gdc_wait()  # the up kernel's products are written
    if USE_PDL == 1:  # late mode
        _gdc_launch_dependents()
    mbarrier.expect(bars.index(TOP_K), NUM_AC * TOP_K * ACT_K * 2)
    for c in gl.static_range(NUM_AC):
        _tma_load(act_desc, [token * TOP_K, c * ACT_K],
                                        bars.index(TOP_K), act_smem.index(c))
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [128 // BLOCK_K, BLOCK_K // 4],
                                            [gl.num_warps(), 1], [1, 0])
    acc = gl.zeros([BLOCK_N, BLOCK_K], gl.float32, layout)
    mbarrier.wait(bars.index(TOP_K), 0)
    for j in gl.static_range(TOP_K):
        weight = gl.sum(gl.where(offs_j == j, weights, 0.0), axis=0)
        mbarrier.wait(bars.index(j), 0)
        for c in gl.static_range(NUM_KC):
            a = act_smem.index(c * BLOCK_K // ACT_K).slice(j, 1, dim=0).slice(
                (c * BLOCK_K) % ACT_K, BLOCK_K, dim=1).load(layout).to(gl.float32)
            # A pair on no local expert has no product (its row of act was never written).
            a = gl.where(weight == 0.0, 0.0, a * weight)
            w = w_smem.index(j * NUM_KC + c).load(layout).to(gl.float32)
            acc += w * a
    for j in gl.static_range(TOP_K + 1):
        mbarrier.invalidate(bars.index(j))
    out = gl.sum(acc, axis=1)
    offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    gl.store(out_ptr + token.to(gl.int64) * stride_out + offs_n,
             out.to(out_ptr.dtype.element_ty), mask=offs_n < N)


def fits(w2: torch.Tensor, top_k: int) -> bool:
    """Whether the staged form takes this layer: 2-byte weights, rows aligned for the copy
    engine, and a program's k experts' rows and k product rows within ``SMEM_LIMIT``."""
    inter = w2.shape[2]
    staged = top_k * (_cdiv(inter, BLOCK_K) * BLOCK_N * BLOCK_K + _cdiv(inter, ACT_K) * ACT_K)
    return (w2.dtype in (torch.bfloat16, torch.float16) and w2.is_contiguous()
            and (inter * 2) % 16 == 0 and w2.data_ptr() % 16 == 0 and top_k <= 256
            and staged * 2 <= SMEM_LIMIT)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _layout() -> gl.NVMMASharedLayout:
    """Unswizzled: a program reads each staged box row by row."""
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)


def _w2_descriptor(w2: torch.Tensor) -> TensorDescriptor:
    """The copy engine's view of the experts' down rows, [E * H, I] in [BLOCK_N, BLOCK_K]
    boxes (built per launch: the launcher encodes it per launch anyway, and a cache would
    keep freed weights alive)."""
    return TensorDescriptor.from_tensor(w2.view(-1, w2.shape[2]), [BLOCK_N, BLOCK_K], _layout())


def moe_down_smem(act: torch.Tensor, w2: torch.Tensor, out: torch.Tensor, ids: torch.Tensor,
                  weights: torch.Tensor, expert_offset: int, use_pdl: int,
                  num_warps: int = NUM_WARPS) -> None:
    """``out[t] = sum_j weights[t, j] * w2[ids[t, j]] @ act[t * k + j]`` over the local
    experts, as ``fused_moe_gemv``'s down kernel; the caller checked ``fits``. ``act`` is
    [tokens * k, I], contiguous."""
    num_tokens, top_k = ids.shape
    num_local, hidden, inter = w2.shape
    act_desc = TensorDescriptor.from_tensor(act, [top_k, ACT_K], _layout())
    grid = (num_tokens, _cdiv(hidden, BLOCK_N))
    _moe_down_smem_kernel[grid](
        act_desc, _w2_descriptor(w2), out, ids, weights, expert_offset, num_local, hidden,
        out.stride(0), TOP_K=top_k, BLOCK_TOPK=triton.next_power_of_2(top_k),
        NUM_KC=_cdiv(inter, BLOCK_K), NUM_AC=_cdiv(inter, ACT_K),
        BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, ACT_K=ACT_K, USE_PDL=use_pdl, num_warps=num_warps,
        launch_pdl=bool(use_pdl))
