"""LoRA shrink/expand Triton kernels against their torch references (ops/lora.py).

Without CUDA the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``) at small
shapes in float32; ranks 8, 16 and 64, rows with no adapter, batches mixing slots, 1, 8 and
more rows than a tile, K split over many programs or not, fused layers of 1 to 3 slices.
"""

from __future__ import annotations

import importlib
import os
import sys

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # NOTE: Triton decides interpreted vs compiled when a kernel is decorated, so this must
    # precede importing triton and the kernel modules (see tests/test_triton_kernels.py).
    os.environ["TRITON_INTERPRET"] = "1"

import numpy as np
import pytest

from bastion.ops.lora import (
    ExpandConfig,
    LoRAIndex,
    ShrinkConfig,
    build_lora_index,
    expand_config,
    kernel_variants,
    lora_expand_ref,
    lora_shrink_ref,
    max_row_tiles,
    shrink_config,
)


def _interpreted_kernels() -> tuple[object, object]:
    if not HAS_CUDA and "triton" in sys.modules:
        from triton.language.standard import cdiv
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(cdiv, InterpretedFunction):  # imported compiled: re-import its Python
            for name in [n for n in sys.modules if n == "triton" or n.startswith("triton.")]:
                if not name.startswith("triton._C"):
                    del sys.modules[name]
    mods = []
    for name in ("bastion.ops.triton.lora_shrink", "bastion.ops.triton.lora_expand"):
        mod = sys.modules.get(name)
        mods.append(importlib.reload(mod) if mod is not None else importlib.import_module(name))
    return mods[0].lora_shrink_triton, mods[1].lora_expand_triton


lora_shrink_triton, lora_expand_triton = _interpreted_kernels()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
NUM_SLOTS = 3
# The interpreter computes tl.dot in float32; a GPU runs float32 dots in TF32.
TOL = {"rtol": 2e-2, "atol": 2e-2} if HAS_CUDA else {"rtol": 1e-4, "atol": 1e-4}


def _index(slots: torch.Tensor) -> LoRAIndex:
    row_ids, starts = build_lora_index(slots.numpy(), NUM_SLOTS)
    pad = np.zeros(len(slots) - len(row_ids), dtype=np.int32)
    return LoRAIndex(
        slots.to(DEVICE),
        torch.from_numpy(np.concatenate([row_ids, pad])).to(DEVICE),
        torch.from_numpy(starts).to(DEVICE),
    )


def _batch(
    num_tokens: int, rank: int, hidden: int, out: int, slice_ends: tuple[int, ...], seed: int
):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    a = torch.randn(NUM_SLOTS, rank, hidden, generator=gen) * 0.1
    b = torch.randn(NUM_SLOTS, out, rank, generator=gen) * 0.1
    b.masked_fill_(_off_block(out, rank, slice_ends), 0.0)  # as LoRASlots stores a fused B
    # Every slot, and rows with no adapter (-1), interleaved.
    slots = torch.tensor(
        [((i + 2) % (NUM_SLOTS + 1)) - 1 for i in range(num_tokens)], dtype=torch.int32
    )
    scales = torch.tensor([0.5, 2.0, 1.25])
    x, a, b, scales = (t.to(DEVICE) for t in (x, a, b, scales))
    return x, a, b, _index(slots), scales


def _off_block(out: int, rank: int, slice_ends: tuple[int, ...]) -> torch.Tensor:
    """[out, rank]: True off the block diagonal (slice i's columns read rank block i only)."""
    col_slice = torch.bucketize(torch.arange(out), torch.tensor(slice_ends), right=True)
    rank_slice = torch.arange(rank) // (rank // len(slice_ends))
    return col_slice[:, None] != rank_slice[None, :]


def _counts(num_tokens: int) -> torch.Tensor:
    return torch.zeros(NUM_SLOTS, max_row_tiles(num_tokens), dtype=torch.int32, device=DEVICE)


# 1, 5 and 70 rows: decode batches (70: several tiles of a slot's rows), K split over 1, 2, 5 or
# 12 programs (560 columns are 9 blocks of 64: 12 splits would leave some empty); 2100: 11 tiles
# of 64 rows a slot, no split. Fused layers: 2 slices (gate_up) and 3 of unequal sizes (qkv).
@pytest.mark.parametrize(
    "rank, num_tokens, split_k, slice_ends",
    [
        (8, 1, 3, (40,)),
        (8, 5, 2, (40,)),
        (16, 5, 1, (24, 40)),
        (48, 5, 12, (24, 32, 40)),
        (64, 8, 5, (40,)),
        (8, 70, 1, (40,)),
        (32, 70, 2, (16, 40)),
        (64, 70, 12, (40,)),
        (48, 2100, 1, (24, 32, 40)),
    ],
)
def test_shrink_then_expand_match_the_reference(
    rank: int, num_tokens: int, split_k: int, slice_ends: tuple[int, ...]
) -> None:
    hidden, out = 48 if num_tokens > 70 else 560, slice_ends[-1]
    x, a, b, index, scales = _batch(num_tokens, rank, hidden, out, slice_ends, rank + num_tokens)
    block_m = 16 if num_tokens <= 16 else 64
    shrink = ShrinkConfig(
        block_m, min(64, max(16, 1 << (rank - 1).bit_length())), 64, split_k, 4, 1
    )
    h_ref = torch.zeros(num_tokens, rank, device=DEVICE)
    h_tri = h_ref.clone()
    lora_shrink_ref(x, a, index.token_slots, h_ref)
    lora_shrink_triton(x, a, index, h_tri, shrink)
    torch.testing.assert_close(h_tri, h_ref, **TOL)
    none = index.token_slots < 0
    assert bool((h_tri[none] == 0).all())  # rows without an adapter are untouched
    # And each row is its own adapter's product.
    row = int(torch.nonzero(index.token_slots == 1)[0])
    torch.testing.assert_close(h_tri[row], x[row] @ a[1].T, **TOL)

    base = torch.randn(num_tokens, out + 8, device=DEVICE)
    y_ref, y_tri = base.clone(), base.clone()
    # A column slice of a wider output, as a fused layer's q/k/v slices are.
    counts = _counts(num_tokens)
    expand = ExpandConfig(block_m, 16, 16, 4, 1)
    h_read = h_tri.clone()
    lora_expand_ref(h_ref, b, index.token_slots, scales, y_ref[:, 4 : 4 + out])
    # The kernel reads only B's diagonal blocks: what lies off them is never read.
    b_tri = b.masked_fill(_off_block(out, rank, slice_ends).to(DEVICE), float("nan"))
    lora_expand_triton(
        h_tri,
        b_tri,
        index,
        scales,
        y_tri[:, 4 : 4 + out],
        counts,
        slice_ends,
        expand,
    )
    torch.testing.assert_close(y_tri, y_ref, **TOL)
    assert torch.equal(y_tri[none], base[none])  # exactly the base output
    assert torch.equal(y_tri[:, :4], base[:, :4]) and torch.equal(
        y_tri[:, 4 + out :], base[:, 4 + out :]
    )
    expected = base[row, 4 : 4 + out] + scales[1] * h_read[row] @ b[1].T
    torch.testing.assert_close(y_tri[row, 4 : 4 + out], expected, **TOL)
    # The next shrink finds the scratch zero and the counters back at zero.
    assert bool((h_tri == 0).all()) and bool((h_ref == 0).all())
    assert bool((counts == 0).all())


def test_the_policy_configs_run_and_match() -> None:
    # The launchers with what ops.lora picks (a CUDA batch's path), decode and prefill sizes.
    for num_tokens, hidden in ((8, 1024), (200, 256), (2048, 48)):
        x, a, b, index, scales = _batch(num_tokens, 48, hidden, 40, (24, 32, 40), num_tokens)
        h = torch.zeros(num_tokens, 48, device=DEVICE)
        config = shrink_config(num_tokens, hidden, 48)
        lora_shrink_triton(x, a, index, h, config)
        h_ref = torch.zeros_like(h)
        lora_shrink_ref(x, a, index.token_slots, h_ref)
        torch.testing.assert_close(h, h_ref, **TOL)
        y, y_ref = (
            torch.zeros(num_tokens, 40, device=DEVICE),
            torch.zeros(num_tokens, 40, device=DEVICE),
        )
        lora_expand_triton(
            h,
            b,
            index,
            scales,
            y,
            _counts(num_tokens),
            (24, 32, 40),
            expand_config(num_tokens, 40, 16),
        )
        lora_expand_ref(h_ref, b, index.token_slots, scales, y_ref)
        torch.testing.assert_close(y, y_ref, **TOL)


def test_right_after_the_base_matmul() -> None:
    # As a layer runs them: y = x W^T, then the shrink and the expand with no kernel between
    # (on a Hopper GPU they start while the matmul drains and must still see its y), twice in
    # a row through the same scratch.
    x, a, b, index, scales = _batch(8, 48, 512, 96, (64, 80, 96), seed=5)
    w = torch.randn(96, 512, device=DEVICE) * 0.05
    h, counts = torch.zeros(8, 48, device=DEVICE), _counts(8)
    for _ in range(2):
        y = torch.empty(8, 96, device=DEVICE)
        torch.mm(x, w.t(), out=y)
        lora_shrink_triton(x, a, index, h, shrink_config(8, 512, 48))
        lora_expand_triton(h, b, index, scales, y, counts, (64, 80, 96), expand_config(8, 96, 16))
        h_ref, y_ref = torch.zeros_like(h), x @ w.t()
        lora_shrink_ref(x, a, index.token_slots, h_ref)
        lora_expand_ref(h_ref, b, index.token_slots, scales, y_ref)
        torch.testing.assert_close(y, y_ref, **TOL)
        assert bool((h == 0).all()) and bool((counts == 0).all())


def test_expand_is_deterministic() -> None:
    # The same h gives bit-identical outputs run after run (the expand adds no atomics).
    x, a, b, index, scales = _batch(5, 16, 560, 40, (40,), seed=3)
    h = torch.zeros(5, 16, device=DEVICE)
    lora_shrink_triton(x, a, index, h, ShrinkConfig(16, 16, 64, 5, 4, 1))
    outs = []
    for _ in range(2):
        y = torch.zeros(5, 40, device=DEVICE)
        lora_expand_triton(
            h.clone(),
            b,
            index,
            scales,
            y,
            _counts(5),
            (40,),
            ExpandConfig(16, 16, 16, 4, 1),
        )
        outs.append(y)
    assert torch.equal(outs[0], outs[1])


def test_index_groups_rows_by_slot() -> None:
    row_ids, starts = build_lora_index(np.array([2, -1, 0, 2, 0, -1, 1]), 4)
    assert row_ids.tolist() == [2, 4, 6, 0, 3] and starts.tolist() == [0, 2, 3, 5, 5]
    row_ids, starts = build_lora_index(np.full(3, -1), 2)
    assert row_ids.tolist() == [] and starts.tolist() == [0, 0, 0]


def test_a_steps_index_lands_in_the_fixed_buffers() -> None:
    # What captured graphs read in place: the slots (padding rows -1) and the rows by slot.
    from bastion.core.lora.layers import LoRAState

    state = LoRAState(max_loras=3, max_tokens=6, max_width=48, device=torch.device("cpu"))
    state.set_rows(np.array([1, -1, 0, 1], dtype=np.int32))
    assert state.index.token_slots.tolist() == [1, -1, 0, 1, -1, -1]
    assert state.index.row_ids[:3].tolist() == [2, 0, 3]
    assert state.index.slot_starts.tolist() == [0, 1, 3, 3] and state.is_active
    state.set_rows(np.full(2, -1, dtype=np.int32))
    assert state.index.token_slots.tolist() == [-1] * 6 and not state.is_active
    assert state.index.slot_starts.tolist() == [0, 0, 0, 0]


def test_k_is_spread_over_programs_while_rows_are_few() -> None:
    # Llama-3-8B: hidden 4096 (qkv, o, gate_up), 14336 (down); stacked ranks 48, 16, 32, 16.
    for hidden in (4096, 14336):
        for num_tokens in (1, 8, 64, 256, 1024, 2048, 8192):
            config = shrink_config(num_tokens, hidden, 48)
            k_range = -(-hidden // config.split_k)
            assert config.split_k * num_tokens <= max(16384, num_tokens)  # atomics bounded
            if num_tokens <= 256:  # decode: one K step a program, programs enough
                assert k_range <= config.block_k <= 256 and config.split_k >= 56
            if num_tokens >= 2048:  # prefill: long K ranges, fewer programs
                assert config.block_k == 64 and k_range >= 1024 or config.split_k == 1
        assert shrink_config(16384, hidden, 48).split_k == 1
    assert shrink_config(8, 64, 16).split_k == 1  # one K step: nothing to split
    assert expand_config(8, 4096, 16).block_k == 16 and expand_config(8, 4096, 64).block_k == 64


def test_few_kernel_variants_cover_every_batch_size() -> None:
    # Start-up builds these (precompile_lora); a step of any size must need no other, or
    # Triton builds one in the middle of serving. Llama-3-8B's down_proj, 16384-token budget.
    variants = kernel_variants(16384, 14336, 16, 4096, 1)
    assert len(variants) <= 8
    keys = {(s._replace(split_k=0), e, rows <= s.block_m) for rows, s, e in variants}
    for num_tokens in (1, 7, 16, 17, 100, 128, 129, 256, 300, 1000, 2047, 2048, 9000, 16384):
        shrink, expand = shrink_config(num_tokens, 14336, 16), expand_config(num_tokens, 4096, 16)
        key = (shrink._replace(split_k=0), expand, num_tokens <= shrink.block_m)
        assert key in keys
    for rows, shrink, _ in variants:  # each is built by a batch of its own kind
        assert (rows <= shrink.block_m) == (shrink_config(rows, 14336, 16).block_m >= rows)


def test_launchers_check_shapes_and_dtypes() -> None:
    x, a, b, index, scales = _batch(4, 8, 32, 16, (16,), seed=0)
    h = torch.zeros(4, 8, device=DEVICE)
    config, expand = ShrinkConfig(16, 16, 64, 1, 4, 1), ExpandConfig(16, 16, 16, 4, 1)
    with pytest.raises(ValueError, match="shapes disagree"):
        lora_shrink_triton(x, a[:, :, :16], index, h, config)
    with pytest.raises(ValueError, match="float32 h and an int32 index"):
        lora_shrink_triton(x, a, index._replace(row_ids=index.row_ids.long()), h, config)
    with pytest.raises(ValueError, match=r"h \[T, R\]"):
        lora_shrink_triton(x, a, index, h[None], config)
    counts = _counts(4)
    with pytest.raises(ValueError, match="contiguous"):
        lora_expand_triton(
            h, b, index, scales, torch.zeros(16, 4, device=DEVICE).T, counts, (16,), expand
        )
    with pytest.raises(ValueError, match="shapes disagree"):
        lora_expand_triton(
            h, b, index, scales[:2], torch.zeros(4, 16, device=DEVICE), counts, (16,), expand
        )
    with pytest.raises(ValueError, match="1 to 3 slices"):
        lora_expand_triton(
            h,
            b,
            index,
            scales,
            torch.zeros(4, 16, device=DEVICE),
            counts,
            (4, 8, 12, 16),
            expand,
        )
