"""One token per row of logits in a single read: greedy rows take the argmax, the others draw
from ``softmax(logits / T)`` by the exponential race, with Philox noise from a per-row seed.

The race picks ``argmax(p_i / E_i)`` with ``E_i ~ Exp(1)``, an exact draw from ``p``. In log
space that is ``argmax(x_i / T - log E_i)``: no softmax and no normalisation, so one pass over the
row suffices. The torch sampler needs about eight passes over float32 copies for the same draw
(copy, divide, softmax, noise, log, divide, argmax), 0.3 ms a step at 256 x 152k on an H200.

Used for batches with no processor before the draw (no penalties, min_tokens, min-p, top-k,
top-p or logprobs); anything else goes through the torch sampler.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _sample_kernel(
    out_ptr,  # int64 [N]
    logits_ptr,  # [N, V], any float dtype
    temperature_ptr,  # float32 [N]; 0 = greedy
    seeds_ptr,  # int64 [N]
    stride_row,
    vocab_size,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    temp = tl.load(temperature_ptr + row)
    greedy = temp == 0.0
    inv_temp = 1.0 / tl.where(greedy, 1.0, temp)
    seed = tl.load(seeds_ptr + row)
    offs = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    best_idx = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, vocab_size, BLOCK):
        idx = start + offs
        ok = idx < vocab_size
        x = tl.load(logits_ptr + row * stride_row + idx, mask=ok, other=float("-inf"))
        score = x.to(tl.float32) * inv_temp
        if not greedy:
            u = tl.rand(seed, idx)
            # E = -log(U) ~ Exp(1). NOTE: not -log(1 - U): 1 - U rounds to 1 for U < 2^-25, and
            # E = 0 would then put that token ~87/T above every other. U = 0 gives E = inf: the
            # token cannot win. The floor only keeps a -inf logit from becoming NaN.
            e = tl.maximum(-tl.log(u), 1.1754943508222875e-38)
            score = score - tl.log(e)
        # Strictly greater: within a lane the earliest index keeps a tie.
        take = score > best
        best = tl.where(take, score, best)
        best_idx = tl.where(take, idx, best_idx)
    top = tl.max(best, axis=0)
    # The first index among the lanes holding the maximum, as torch.argmax picks.
    pick = tl.min(tl.where(best == top, best_idx, vocab_size), axis=0)
    # NOTE: a row of all -inf (or NaN) leaves every lane at -inf; its token is 0, like argmax.
    pick = tl.where(top > float("-inf"), pick, 0)
    tl.store(out_ptr + row, pick.to(tl.int64))


def sample_tokens_triton(logits: torch.Tensor, temperature: torch.Tensor,
                         seeds: torch.Tensor) -> torch.Tensor:
    """``logits`` [N, V] (rows may be strided), ``temperature`` float32 [N] (0 = greedy),
    ``seeds`` int64 [N] -> int64 [N] tokens. A row's draw depends only on its logits, its
    temperature and its seed (the Sampler draws the seeds from the global RNG)."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [N, V] with unit column stride; got {tuple(logits.shape)}")
    num_rows, vocab_size = logits.shape
    for name, t, dtype in (("temperature", temperature, torch.float32),
                           ("seeds", seeds, torch.int64)):
        if t.dtype != dtype or t.shape != (num_rows,) or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous {dtype} [{num_rows}]; got {t.dtype} "
                             f"{tuple(t.shape)}")
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    _sample_kernel[(num_rows,)](out, logits, temperature, seeds, logits.stride(0), vocab_size,
                                BLOCK=2048 if vocab_size >= 2048 else
                                triton.next_power_of_2(vocab_size), num_warps=8)
    return out
