"""LoRA shrink/expand Triton kernels against their torch references (ops/lora.py).

Without CUDA the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``) at small
shapes in float32; ranks 8, 16 and 64, rows with no adapter, batches mixing slots, K split
into several partials or not.
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

import pytest

from bastion.ops.lora import lora_expand_ref, lora_shrink_ref, lora_split_k, max_split_scratch


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


def _batch(num_tokens: int, rank: int, hidden: int, out: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    a = torch.randn(NUM_SLOTS, rank, hidden, generator=gen) * 0.1
    b = torch.randn(NUM_SLOTS, out, rank, generator=gen) * 0.1
    # Every slot, and rows with no adapter (-1), interleaved.
    slots = torch.tensor([(i % (NUM_SLOTS + 1)) - 1 for i in range(num_tokens)], dtype=torch.int32)
    scales = torch.tensor([0.5, 2.0, 1.25])
    return [t.to(DEVICE) for t in (x, a, b, slots, scales)]


# 5 and 70 tokens: decode batches, K split in 1, 2, 5 or 12 planes (560 columns are 9 blocks of
# 64, so 12 splits leave some empty); 2100: 33 row tiles, no split.
@pytest.mark.parametrize(
    "rank, num_tokens, split_k",
    [
        (8, 5, 2),
        (16, 5, 1),
        (16, 5, 12),
        (64, 5, 5),
        (8, 70, 1),
        (16, 70, 2),
        (64, 70, 12),
        (16, 2100, 1),
    ],
)
def test_shrink_then_expand_match_the_reference(rank: int, num_tokens: int, split_k: int) -> None:
    hidden, out = 48 if num_tokens > 70 else 560, 40
    x, a, b, slots, scales = _batch(num_tokens, rank, hidden, out, seed=rank + num_tokens)
    # Stale scratch: the shrink writes every partial of a row with a slot, so nothing is zeroed.
    h_ref = torch.full((split_k, num_tokens, rank), 7.0, device=DEVICE)
    h_tri = h_ref.clone()
    lora_shrink_ref(x, a, slots, h_ref)
    lora_shrink_triton(x, a, slots, h_tri)
    torch.testing.assert_close(h_tri.sum(0), h_ref.sum(0), **TOL)
    none = slots < 0
    assert bool((h_tri[:, none] == 7.0).all())  # rows without an adapter are untouched

    base = torch.randn(num_tokens, out + 8, device=DEVICE)
    y_ref, y_tri = base.clone(), base.clone()
    # A column slice of a wider output, as a fused layer's q/k/v slices are; the kernel reads
    # its own partials (split differently from the reference's).
    lora_expand_ref(h_ref, b, slots, scales, y_ref[:, 4 : 4 + out])
    lora_expand_triton(h_tri, b, slots, scales, y_tri[:, 4 : 4 + out])
    torch.testing.assert_close(y_tri, y_ref, **TOL)
    assert torch.equal(y_tri[none], base[none])  # exactly the base output
    assert torch.equal(y_tri[:, :4], base[:, :4]) and torch.equal(
        y_tri[:, 4 + out :], base[:, 4 + out :]
    )
    # And each row is its own adapter's delta.
    row = int(torch.nonzero(slots == 1)[0])
    torch.testing.assert_close(h_tri[:, row].sum(0), x[row] @ a[1].T, **TOL)
    expected = base[row, 4 : 4 + out] + scales[1] * (x[row] @ a[1].T) @ b[1].T
    torch.testing.assert_close(y_tri[row, 4 : 4 + out], expected, **TOL)


def test_expand_sums_the_partials_in_order() -> None:
    # The same partials give bit-identical outputs run after run (no atomics).
    x, a, b, slots, scales = _batch(5, 16, 560, 40, seed=3)
    h = torch.empty(5, 5, 16, device=DEVICE)
    lora_shrink_triton(x, a, slots, h)
    outs = []
    for _ in range(2):
        y = torch.zeros(5, 40, device=DEVICE)
        lora_expand_triton(h, b, slots, scales, y)
        outs.append(y)
    assert torch.equal(outs[0], outs[1])


def test_split_k_is_for_decode_and_fits_the_scratch() -> None:
    # Llama-3-8B: hidden 4096 (qkv, o, gate_up), 14336 (down).
    assert lora_split_k(8, 4096) == 4 and lora_split_k(8, 14336) == 4
    assert lora_split_k(256, 14336) == 4 and lora_split_k(1024, 14336) == 4
    assert lora_split_k(2048, 14336) == 1 and lora_split_k(8, 200) == 1
    for max_tokens in (1, 100, 256, 1000, 8448):
        worst = max(lora_split_k(t, 14336) * t for t in range(1, max_tokens + 1))
        assert worst <= max_split_scratch(max_tokens)


def test_launchers_check_shapes_and_dtypes() -> None:
    x, a, b, slots, scales = _batch(4, 8, 32, 16, seed=0)
    h = torch.zeros(1, 4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="shapes disagree"):
        lora_shrink_triton(x, a[:, :, :16], slots, h)
    with pytest.raises(ValueError, match="float32 out and int32 slots"):
        lora_shrink_triton(x, a, slots.long(), h)
    with pytest.raises(ValueError, match="contiguous"):
        lora_expand_triton(h, b, slots, scales, torch.zeros(16, 4, device=DEVICE).T)
    with pytest.raises(ValueError, match="shapes disagree"):
        lora_expand_triton(h, b, slots, scales[:2], torch.zeros(4, 16, device=DEVICE))
    with pytest.raises(ValueError, match=r"out \[SPLIT_K, T, R\]"):
        lora_shrink_triton(x, a, slots, h[0])
