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

# Programs a launch aims at: a row is read in pieces so that a small batch still spreads over
# the SMs. One program a row read 256 x 152k bf16 logits in 46 us on an H200 (75 dependent
# loads a row, two waves); the copy floor is 19 us.
_TARGET_PROGRAMS = 1024
_MAX_SPLITS = 32


@triton.jit(do_not_specialize=["vocab_size", "chunk", "num_splits"])
def _sample_kernel(
    part_score_ptr,  # float32 [N, num_splits]: each piece's best score
    part_idx_ptr,  # int32 [N, num_splits]: its token (vocab_size when the piece saw none)
    logits_ptr,  # [N, V], any float dtype
    temperature_ptr,  # float32 [N]; 0 = greedy
    seeds_ptr,  # int64 [N]
    mask_ptr,  # int32 [R, words]: grammar bitmasks (HAS_MASK)
    mask_rows_ptr,  # int32 [N]: each row's bitmask row, -1 for none (HAS_MASK)
    stride_row,
    stride_mask,
    vocab_size,
    chunk,  # tokens a piece, a multiple of BLOCK
    num_splits,
    BLOCK: tl.constexpr,
    HAS_MASK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    if HAS_MASK:
        mask_row = tl.load(mask_rows_ptr + row).to(tl.int64)
    temp = tl.load(temperature_ptr + row)
    greedy = temp == 0.0
    inv_temp = 1.0 / tl.where(greedy, 1.0, temp)
    seed = tl.load(seeds_ptr + row)
    offs = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    best_idx = tl.full([BLOCK], vocab_size, dtype=tl.int32)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, vocab_size)
    for start in range(lo, hi, BLOCK):
        idx = start + offs
        ok = idx < hi
        x = tl.load(logits_ptr + row * stride_row + idx, mask=ok, other=float("-inf"))
        if HAS_MASK:
            # A token whose bit is clear in the row's grammar bitmask cannot win.
            # (A row without one, -1, reads row 0 and ignores it.)
            words = tl.load(mask_ptr + tl.maximum(mask_row, 0) * stride_mask + idx // 32,
                            mask=ok, other=-1)
            allowed = (((words >> (idx % 32)) & 1) != 0) | (mask_row < 0)
            x = tl.where(allowed, x, float("-inf"))
        score = x.to(tl.float32) * inv_temp
        if not greedy:
            # The noise depends on the token's index only, so the draw is the same whatever
            # the pieces.
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
    tl.store(part_score_ptr + row * num_splits + split, top)
    tl.store(part_idx_ptr + row * num_splits + split, pick)


@triton.jit(do_not_specialize=["vocab_size", "num_splits"])
def _pick_kernel(out_ptr, part_score_ptr, part_idx_ptr, vocab_size, num_splits,
                 SPLITS_PAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, SPLITS_PAD)
    ok = offs < num_splits
    score = tl.load(part_score_ptr + row * num_splits + offs, mask=ok, other=float("-inf"))
    idx = tl.load(part_idx_ptr + row * num_splits + offs, mask=ok, other=vocab_size)
    top = tl.max(score, axis=0)
    # Pieces are in vocabulary order: the smallest index holding the maximum is the first.
    pick = tl.min(tl.where(score == top, idx, vocab_size), axis=0)
    # NOTE: a row of all -inf (or NaN) leaves every piece at -inf; its token is 0, like argmax.
    pick = tl.where(top > float("-inf"), pick, 0)
    tl.store(out_ptr + row, pick.to(tl.int64))


def sample_tokens_triton(logits: torch.Tensor, temperature: torch.Tensor,
                         seeds: torch.Tensor, num_splits: int | None = None,
                         mask: torch.Tensor | None = None,
                         mask_rows: torch.Tensor | None = None) -> torch.Tensor:
    """``logits`` [N, V] (rows may be strided), ``temperature`` float32 [N] (0 = greedy),
    ``seeds`` int64 [N] -> int64 [N] tokens. A row's draw depends only on its logits, its
    temperature and its seed (the Sampler draws the seeds from the global RNG), not on how many
    pieces (``num_splits``, default from the batch size) its row is read in.

    With grammar bitmasks (``mask`` int32 [R, >= ceil(V / 32)], ``mask_rows`` int32 [N]: row
    ``r`` draws under bitmask row ``mask_rows[r]``, or freely where it is -1), a token whose
    bit is clear is drawn as if its logit were -inf: the same tokens as masking the logits
    first (``ops/triton/grammar_bitmask.py``), without writing them."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [N, V] with unit column stride; got {tuple(logits.shape)}")
    num_rows, vocab_size = logits.shape
    for name, t, dtype in (("temperature", temperature, torch.float32),
                           ("seeds", seeds, torch.int64)):
        if t.dtype != dtype or t.shape != (num_rows,) or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous {dtype} [{num_rows}]; got {t.dtype} "
                             f"{tuple(t.shape)}")
    has_mask = mask is not None
    if has_mask and (mask_rows is None or mask.dtype != torch.int32 or mask.dim() != 2
                     or mask.stride(1) != 1 or mask.shape[1] * 32 < vocab_size
                     or mask_rows.shape != (num_rows,) or mask_rows.dtype != torch.int32):
        raise ValueError(f"mask must be int32 [R, >= {-(-vocab_size // 32)}] with mask_rows "
                         f"int32 [{num_rows}]; got {getattr(mask, 'shape', None)} and "
                         f"{getattr(mask_rows, 'shape', None)}")
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0 or vocab_size == 0:
        return out.zero_()
    if num_splits is None:
        num_splits = min(_MAX_SPLITS, triton.cdiv(_TARGET_PROGRAMS, num_rows))
    num_splits = max(1, min(num_splits, _MAX_SPLITS, vocab_size))
    per_split = triton.cdiv(vocab_size, num_splits)
    block = min(2048, max(16, triton.next_power_of_2(per_split)))
    chunk = triton.cdiv(per_split, block) * block
    num_splits = triton.cdiv(vocab_size, chunk)  # no piece left empty
    part_score = torch.empty((num_rows, num_splits), dtype=torch.float32, device=logits.device)
    part_idx = torch.empty((num_rows, num_splits), dtype=torch.int32, device=logits.device)
    _sample_kernel[(num_rows, num_splits)](
        part_score, part_idx, logits, temperature, seeds,
        mask if has_mask else seeds, mask_rows if has_mask else seeds, logits.stride(0),
        mask.stride(0) if has_mask else 0, vocab_size, chunk, num_splits, BLOCK=block,
        HAS_MASK=has_mask, num_warps=8 if block >= 1024 else 4,
    )  # fmt: skip
    _pick_kernel[(num_rows,)](out, part_score, part_idx, vocab_size, num_splits,
                              SPLITS_PAD=triton.next_power_of_2(_MAX_SPLITS), num_warps=1)
    return out
