"""Triton kernels against their torch references.

Without CUDA the kernels run under Triton's interpreter on the CPU at small shapes in float32
with tight tolerances; with CUDA the `gpu` tests run them at real shapes in bfloat16.
"""

from __future__ import annotations

import importlib
import os
import sys

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # NOTE: Triton decides interpreted vs compiled when a kernel is decorated, so this must
    # precede importing triton and the kernel modules.
    os.environ["TRITON_INTERPRET"] = "1"

import pytest

from bastion.core.forward_context import AttentionMetadata
from bastion.ops.activation import silu_and_mul_ref
from bastion.ops.attention import paged_attention_ref
from bastion.ops.kv_store import store_kvcache_ref
from bastion.ops.layernorm import fused_add_rms_norm_ref, rms_norm_ref
from bastion.ops.moe import fused_moe_ref, select_experts_ref
from bastion.ops.moe_configs import grouped_moe_config
from bastion.ops.rotary import apply_rotary_emb_ref
from bastion.ops.triton.counters import counters_of

_KERNEL_MODULES = [
    "bastion.ops.triton.attention_reduce",  # before unified_attention, which imports it
    "bastion.ops.triton.unified_attention",
    "bastion.ops.triton.kv_store",
    "bastion.ops.triton.rms_norm",
    "bastion.ops.triton.fused_add_rms_norm",
    "bastion.ops.triton.rotary",
    "bastion.ops.triton.silu_and_mul",
    "bastion.ops.triton.sample",
    "bastion.ops.triton.moe_routing",
    "bastion.ops.triton.moe_align",  # these two before fused_moe, which imports them
    "bastion.ops.triton.moe_sum",
    "bastion.ops.triton.fused_moe",
    "bastion.ops.triton.fused_moe_gemv",
    "bastion.ops.triton.gemv",
    "bastion.ops.triton.grammar_bitmask",
]


def _kernel_modules() -> dict[str, object]:
    if not HAS_CUDA and "triton" in sys.modules and not _triton_interprets():
        # Something imported triton before the interpreter was switched on (transformers does),
        # so even triton.language's own jit helpers (tl.cdiv, tl.max) were compiled-mode.
        # Re-import the Python side of triton (its C extension stays loaded) in interpreter mode.
        for name in [n for n in sys.modules if n == "triton" or n.startswith("triton.")]:
            if not name.startswith("triton._C"):
                del sys.modules[name]
    # The kernels may also have been decorated in the other mode: re-import them too.
    mods = {}
    for name in _KERNEL_MODULES:
        mod = sys.modules.get(name)
        mods[name.rsplit(".", 1)[1]] = (
            importlib.reload(mod) if mod is not None else importlib.import_module(name)
        )
    return mods


def _triton_interprets() -> bool:
    from triton.language.standard import cdiv
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(cdiv, InterpretedFunction)


_K = _kernel_modules()
paged_attention_triton = _K["unified_attention"].paged_attention_triton
store_kvcache_triton = _K["kv_store"].store_kvcache_triton
rms_norm_triton = _K["rms_norm"].rms_norm_triton
fused_add_rms_norm_triton = _K["fused_add_rms_norm"].fused_add_rms_norm_triton
apply_rotary_emb_triton = _K["rotary"].apply_rotary_emb_triton
silu_and_mul_triton = _K["silu_and_mul"].silu_and_mul_triton
sample_tokens_triton = _K["sample"].sample_tokens_triton
moe_routing_triton = _K["moe_routing"].moe_routing_triton
moe_align_triton = _K["moe_align"].moe_align_triton
fused_moe_triton = _K["fused_moe"].fused_moe_triton
gemv_triton = _K["gemv"].gemv_triton
apply_bitmask_rows_triton = _K["grammar_bitmask"].apply_bitmask_rows_triton

gpu = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
CPU = torch.device("cpu")


# ----------------------------------------------------------------------------- helpers


def _build_batch(
    q_lens: list[int],
    ctx_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    num_pad_tokens: int = 0,
    seed: int = 0,
) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch whose sequences own shuffled (non-contiguous) cache blocks; returns metadata,
    both caches (random, including the slots of unused blocks) and the new tokens' K/V."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in zip(q_lens, ctx_lens)]
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = torch.tensor(perm[used : used + n], dtype=torch.int32)
        used += n
    slots: list[int] = []
    for i, (q, s) in enumerate(zip(q_lens, seq_lens)):
        for pos in range(s - q, s):
            slots.append(int(block_tables[i, pos // block_size]) * block_size + pos % block_size)
    slots += [-1] * num_pad_tokens
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    num_tokens = len(slots)
    new_k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    new_v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
    )
    return meta, k_cache.to(device), v_cache.to(device), new_k.to(device), new_v.to(device)


def _check_attention(
    q_lens: list[int],
    ctx_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    num_splits: int | None,
    dtype: torch.dtype = torch.float32,
    device: torch.device = CPU,
    num_pad_tokens: int = 0,
    atol: float = 2e-5,
    config: object = None,
    max_seq_len: int | None = None,
) -> None:
    meta, k_cache, v_cache, new_k, new_v = _build_batch(
        q_lens, ctx_lens, num_kv_heads, head_dim, block_size, dtype, device, num_pad_tokens
    )
    if max_seq_len is not None:  # a CUDA graph's captured bound, above the real contexts
        meta.max_seq_len = max_seq_len
    store_kvcache_ref(new_k, new_v, k_cache, v_cache, meta.slot_mapping)
    gen = torch.Generator().manual_seed(1)
    query = torch.randn(new_k.shape[0], num_heads, head_dim, generator=gen).to(dtype).to(device)
    scale = head_dim**-0.5
    out = paged_attention_triton(query, k_cache, v_cache, meta, scale, num_splits=num_splits,
                                 config=config)
    num_real = meta.query_start_loc_cpu[-1]
    # The reference runs in float32 on the same (rounded) inputs, so bf16 runs are judged
    # against the exact result rather than against a second bf16 approximation.
    ref = paged_attention_ref(
        query[:num_real].float(), k_cache.float(), v_cache.float(), meta, scale
    )
    torch.testing.assert_close(out[:num_real].float(), ref.float(), atol=atol, rtol=0)
    assert torch.equal(out[num_real:], torch.zeros_like(out[num_real:]))


# ----------------------------------------------------------------------------- attention (CPU)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_attention_mixed_prefill_decode_with_cached_prefix(num_splits: int) -> None:
    # decode at a block boundary, chunked prefill over a cached prefix, fresh prefill, decode
    # past several blocks; GQA 4:2; two padding tokens at the end (slot -1) must come back 0.
    _check_attention(
        q_lens=[1, 7, 13, 1], ctx_lens=[16, 9, 0, 37], num_heads=4, num_kv_heads=2,
        head_dim=32, block_size=8, num_splits=num_splits, num_pad_tokens=2,
    )  # fmt: skip


@pytest.mark.parametrize("split_mixed", [True, False])
def test_attention_mixed_batch_runs_its_decode_rows_in_their_own_launch(
        split_mixed: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # Decode rows of a mixed batch take decode's launch (16-row blocks, one program a sequence);
    # the prefill launch skips them. Each launch alone would leave the other's rows unwritten.
    mod = _K["unified_attention"]
    monkeypatch.setenv("BASTION_SPLIT_MIXED_ATTENTION", "1" if split_mixed else "0")
    launches = _record_launches(monkeypatch)
    _check_attention(
        q_lens=[1, 9, 1, 30, 1], ctx_lens=[40, 0, 3, 17, 70], num_heads=4, num_kv_heads=2,
        head_dim=16, block_size=8, num_splits=None, num_pad_tokens=1,
    )  # fmt: skip
    prefill_rows = mod.prefill_config().block_m
    seen = [(c["DECODE"], c["SKIP_DECODE_ROWS"], config.block_m) for config, c in launches]
    assert seen == ([(False, True, prefill_rows), (True, False, mod.decode_config(3, 2).block_m)]
                    if split_mixed else [(False, False, prefill_rows)])


def test_attention_prefill_with_a_larger_query_block() -> None:
    # 128-row query blocks (64 tokens x 2 heads): sequences shorter and longer than a block.
    config = _K["unified_attention"].KernelConfig(32, 8, 2, block_m=128)
    _check_attention(
        q_lens=[70, 1, 5, 130], ctx_lens=[0, 12, 40, 3], num_heads=4, num_kv_heads=2,
        head_dim=16, block_size=8, num_splits=1, config=config,
    )  # fmt: skip


@pytest.mark.parametrize("num_splits", [1, 3])
def test_attention_small_tiles_across_chunks_and_splits(num_splits: int) -> None:
    # 16-key tiles and 16-row query blocks (8 tokens x 2 heads), so these contexts span many
    # tiles: decodes past several tiles, a chunk over a cached prefix whose query blocks start
    # mid-tile, a fresh prompt; splits cut through whole tiles and the causal diagonal.
    config = _K["unified_attention"].KernelConfig(16, 4, 2, block_m=16)
    _check_attention(
        q_lens=[1, 40, 23, 1], ctx_lens=[95, 50, 0, 33], num_heads=4, num_kv_heads=2,
        head_dim=16, block_size=8, num_splits=num_splits, config=config, num_pad_tokens=1,
    )  # fmt: skip


def test_attention_shrinks_a_launch_shape_that_does_not_fit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A GPU with less shared memory than the H200 the shapes were tuned on: any launch with
    # more than one pipeline stage fails. The call still succeeds (one stage), and the next
    # call starts from the shape that fit.
    from triton.runtime.errors import OutOfResources

    mod = _K["unified_attention"]
    stages_tried: list[int] = []

    class SmallGPU:
        def __getitem__(self, grid):  # type: ignore[no-untyped-def]
            launch = real[grid]

            def run(*args, **kwargs):  # type: ignore[no-untyped-def]
                stages_tried.append(kwargs["num_stages"])
                if kwargs["num_stages"] > 1:
                    raise OutOfResources(196608, 101376, "shared memory")
                return launch(*args, **kwargs)

            return run

    real = mod._unified_attention_kernel
    monkeypatch.setattr(mod, "_unified_attention_kernel", SmallGPU())
    monkeypatch.setattr(mod, "_FITTED", {})
    config = mod.KernelConfig(32, 4, 3)
    for _ in range(2):
        _check_attention(
            q_lens=[1, 6], ctx_lens=[9, 4], num_heads=4, num_kv_heads=2, head_dim=16,
            block_size=4, num_splits=1, config=config,
        )  # fmt: skip
    # The first call's prefill launch shrinks; its decode row's launch (the same shape) and the
    # second call's two launches start from the shape that fit.
    assert stages_tried == [3, 2, 1, 1, 1, 1]
    assert mod._FITTED == {config: mod.KernelConfig(32, 4, 1)}


def test_attention_odd_group_and_head_dim() -> None:
    # 3 query heads per KV head (rows of a 16-row tile that fall past BLOCK_Q are masked) and a
    # head dim that is not a power of two (padded to 32 inside the kernel).
    _check_attention(
        q_lens=[5, 1, 11], ctx_lens=[4, 20, 6], num_heads=6, num_kv_heads=2,
        head_dim=24, block_size=4, num_splits=1,
    )  # fmt: skip


@pytest.mark.parametrize("num_splits", [1, 2])
def test_attention_decode_batch_with_graph_padding_rows(num_splits: int) -> None:
    # A decode batch as the CUDA-graph runner pads it: the last two sequences are empty
    # (query_start_loc stays put, seq_len 0) and their tokens have slot -1. Decode launches one
    # program per sequence (no search for its query block); empty ones must write nothing.
    _check_attention(
        q_lens=[1, 1, 1, 0, 0], ctx_lens=[0, 33, 17, 0, 0], num_heads=6, num_kv_heads=2,
        head_dim=32, block_size=8, num_splits=num_splits, num_pad_tokens=2,
    )  # fmt: skip


def _record_launches(monkeypatch: pytest.MonkeyPatch) -> list[tuple[object, dict]]:  # type: ignore[type-arg]
    """(launch shape, constexprs) of every attention launch, in order (a list filled later)."""
    mod = _K["unified_attention"]
    launch, seen = mod._launch, []

    def recording(grid, config, args, **consts):  # type: ignore[no-untyped-def]
        seen.append((config, consts))
        return launch(grid, config, args, **consts)

    monkeypatch.setattr(mod, "_launch", recording)
    return seen


def _split_counts(launches: list[tuple[object, dict]]) -> list[int]:  # type: ignore[type-arg]
    return [c["NUM_SPLITS"] for _, c in launches if c["NUM_SPLITS"] > 1]


@pytest.mark.parametrize("fused", [True, False])
def test_attention_split_decode_merges_in_its_last_split_or_a_second_kernel(
        fused: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # Fused: the last split of each sequence and KV head to finish merges all splits, counted
    # in a zeroed buffer that must be zero again afterwards (a CUDA graph replays the launch);
    # otherwise the merge kernel runs. Includes a padding row and splits that see no key.
    mod = _K["unified_attention"]
    monkeypatch.setenv("BASTION_FUSED_SPLIT_MERGE", "1" if fused else "0")
    merge, merges = mod.merge_attention_splits_triton, []
    monkeypatch.setattr(mod, "merge_attention_splits_triton",
                        lambda *a: merges.append(1) or merge(*a))
    for _ in range(2):  # the second launch sees the counters the first one left
        _check_attention(
            q_lens=[1, 1, 1, 0], ctx_lens=[70, 5, 33, 0], num_heads=4, num_kv_heads=2,
            head_dim=16, block_size=8, num_splits=4, num_pad_tokens=1,
        )  # fmt: skip
    assert len(merges) == (0 if fused else 2)
    if fused:
        assert not counters_of("attention", CPU).any()


def test_attention_decode_under_a_graph_bound_splits_into_mostly_empty_pieces(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Under CUDA graphs the split count follows the captured bound (here 4096 keys: 16 splits)
    # while the real contexts are short: most splits see no key and must not contribute.
    launches = _record_launches(monkeypatch)
    _check_attention(
        q_lens=[1, 1, 0], ctx_lens=[70, 0, 0], num_heads=4, num_kv_heads=2, head_dim=16,
        block_size=8, num_splits=None, num_pad_tokens=1, max_seq_len=4096,
    )  # fmt: skip
    assert _split_counts(launches) == [16]


def test_attention_decode_tile_follows_the_grid(monkeypatch: pytest.MonkeyPatch) -> None:
    # A few (sequence, KV head) programs take 32-key tiles in 2 stages; a grid past
    # SMALL_DECODE_PROGRAMS takes the bandwidth-bound shape, 64 keys in 3 stages.
    mod = _K["unified_attention"]
    launches = _record_launches(monkeypatch)
    for num_seqs in (2, mod.SMALL_DECODE_PROGRAMS // 2 + 1):
        _check_attention(
            q_lens=[1] * num_seqs, ctx_lens=[(7 * i) % 45 for i in range(num_seqs)],
            num_heads=4, num_kv_heads=2, head_dim=16, block_size=8, num_splits=1,
        )  # fmt: skip
    assert [(c.tile, c.num_stages) for c, _ in launches] == [(32, 2), (64, 3)]


def test_attention_decode_auto_split_long_context(monkeypatch: pytest.MonkeyPatch) -> None:
    # a small decode batch makes the launcher split the context; contexts of very different
    # lengths leave some splits empty (they must not contribute).
    launches = _record_launches(monkeypatch)
    _check_attention(
        q_lens=[1, 1, 1], ctx_lens=[600, 3, 64], num_heads=8, num_kv_heads=1,
        head_dim=16, block_size=16, num_splits=None,
    )  # fmt: skip
    # Contexts up to 601 keys: two splits of at least 256 keys each, no more.
    assert _split_counts(launches) == [2]


def test_attention_rejects_bad_inputs() -> None:
    meta, k_cache, v_cache, _, _ = _build_batch([2], [3], 2, 16, 4, torch.float32, CPU)
    with pytest.raises(ValueError, match="multiple of Hk"):
        paged_attention_triton(torch.randn(2, 3, 16), k_cache, v_cache, meta, 1.0)
    meta.block_tables = meta.block_tables.long()
    with pytest.raises(ValueError, match="int32"):
        paged_attention_triton(torch.randn(2, 4, 16), k_cache, v_cache, meta, 1.0)


# ----------------------------------------------------------------------------- KV store (CPU)


def test_store_kvcache_strided_views_and_padding() -> None:
    num_tokens, num_kv_heads, head_dim, num_q_heads = 6, 2, 24, 4
    qkv = torch.randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim)
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    key = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, q_size + kv_size :].view(num_tokens, num_kv_heads, head_dim)
    k_cache = torch.randn(5, 4, num_kv_heads, head_dim)
    v_cache = torch.randn(5, 4, num_kv_heads, head_dim)
    slots = torch.tensor([17, 3, -1, 0, 19, -1], dtype=torch.int64)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kvcache_ref(key, value, k_ref, v_ref, slots)
    store_kvcache_triton(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    assert torch.equal(k_cache[4, 1], key[0]) and torch.equal(v_cache[0, 3], value[1])
    with pytest.raises(ValueError, match="int64"):
        store_kvcache_triton(key, value, k_cache, v_cache, slots.int())


# ----------------------------------------------------------------------------- norms (CPU)


def test_rms_norm_rows_and_per_head_view() -> None:
    x = torch.randn(5, 300)
    w = torch.randn(300)
    torch.testing.assert_close(
        rms_norm_triton(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), atol=1e-6, rtol=1e-6
    )
    # Qwen3's q_norm: a per-head norm over a strided [T, H, D] slice of the QKV output.
    qkv = torch.randn(3, 7 * 16)
    q = qkv[:, : 4 * 16].view(3, 4, 16)
    wq = torch.randn(16)
    out = rms_norm_triton(q, wq, 1e-5)
    assert out.shape == (3, 4, 16)
    ref = rms_norm_ref(q.reshape(-1, 16), wq, 1e-5).view(3, 4, 16)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    # ... and k, which starts inside the row.
    k = qkv[:, 4 * 16:6 * 16].view(3, 2, 16)
    ref = rms_norm_ref(k.reshape(-1, 16), wq, 1e-5).view(3, 2, 16)
    torch.testing.assert_close(rms_norm_triton(k, wq, 1e-5), ref, atol=1e-6, rtol=1e-6)


def test_fused_add_rms_norm_matches_unfused() -> None:
    x, residual, w = torch.randn(4, 96), torch.randn(4, 96), torch.randn(96)
    x0, r0 = x.clone(), residual.clone()
    out, new_residual = fused_add_rms_norm_triton(x, residual, w, 1e-6)
    ref_out, ref_residual = fused_add_rms_norm_ref(x0.clone(), r0.clone(), w, 1e-6)
    torch.testing.assert_close(new_residual, ref_residual, atol=1e-6, rtol=0)
    torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=1e-6)
    assert torch.equal(x, x0) and torch.equal(residual, r0)


# ----------------------------------------------------------------------------- rotary (CPU)


def _cos_sin_cache(max_pos: int, rot_dim: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


@pytest.mark.parametrize("is_neox_style", [True, False])
@pytest.mark.parametrize("rot_dim", [32, 16])
def test_rotary_matches_reference(is_neox_style: bool, rot_dim: int) -> None:
    num_tokens, num_q_heads, num_kv_heads, head_dim = 5, 6, 2, 32
    qkv = torch.randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim)
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    query, key = qkv[:, :q_size], qkv[:, q_size : q_size + kv_size]  # strided views
    positions = torch.tensor([0, 1, 7, 30, 63], dtype=torch.int64)
    cache = _cos_sin_cache(64, rot_dim)
    q_out, k_out = apply_rotary_emb_triton(positions, query, key, cache, head_dim, is_neox_style)
    q_ref, k_ref = apply_rotary_emb_ref(
        positions, query.clone(), key.clone(), cache, head_dim, is_neox_style
    )
    torch.testing.assert_close(q_out, q_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_out, k_ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(q_out[0], query[0])  # position 0 is the identity rotation
    if rot_dim < head_dim:  # pass-through dims are untouched
        tail = q_out.view(num_tokens, num_q_heads, head_dim)[..., rot_dim:]
        assert torch.equal(tail, query.reshape(num_tokens, num_q_heads, head_dim)[..., rot_dim:])


def _check_norm_rope_store(rot_dim: int, dtype: torch.dtype, device: torch.device,
                           atol: float, num_kv_heads: int = 2, head_dim: int = 32,
                           is_neox: bool = True) -> None:
    """Qwen3's attention input in one kernel: per-head q/k RMSNorm, rotary, then k and v into
    the paged cache at their slots (one padding token with slot -1 stores nothing)."""
    num_tokens, num_q_heads, block_size = 5, 6, 4
    gen = torch.Generator().manual_seed(3)
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=gen).to(dtype).to(device)
    query, key, value = qkv.split([q_size, kv_size, kv_size], dim=-1)  # strided views
    q_w = (1 + torch.randn(head_dim, generator=gen)).to(dtype).to(device)
    k_w = (1 + torch.randn(head_dim, generator=gen)).to(dtype).to(device)
    positions = torch.tensor([0, 1, 7, 30, 63], dtype=torch.int64, device=device)
    slots = torch.tensor([9, 2, -1, 23, 12], dtype=torch.int64, device=device)
    cos_sin = _cos_sin_cache(64, rot_dim).to(device)
    caches = [torch.randn(8, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
              .to(device) for _ in range(2)]
    ref_caches = [c.clone() for c in caches]
    fused = {"q_weight": q_w, "k_weight": k_w, "eps": 1e-6, "value": value,
             "slot_mapping": slots}
    q_out, k_out = apply_rotary_emb_triton(positions, query, key, cos_sin, head_dim, is_neox,
                                           k_cache=caches[0], v_cache=caches[1], **fused)
    q_ref, k_ref = apply_rotary_emb_ref(positions, query.float(), key.float(), cos_sin, head_dim,
                                        is_neox, k_cache=ref_caches[0], v_cache=ref_caches[1],
                                        **fused)
    torch.testing.assert_close(q_out.float(), q_ref.float(), atol=atol, rtol=0)
    torch.testing.assert_close(k_out.float(), k_ref.float(), atol=atol, rtol=0)
    torch.testing.assert_close(caches[0].float(), ref_caches[0].float(), atol=atol, rtol=0)
    assert torch.equal(caches[1], ref_caches[1])  # values are copied exactly
    flat_k = caches[0].view(-1, num_kv_heads, head_dim)
    assert torch.equal(flat_k[23], k_out[3].view(num_kv_heads, head_dim))
    untouched = [s for s in range(32) if s not in (9, 2, 23, 12)]
    before = ref_caches[0].view(-1, num_kv_heads, head_dim)
    assert torch.equal(flat_k[untouched], before[untouched])


@pytest.mark.parametrize("loads_first", ["1", "0"])
@pytest.mark.parametrize("rot_dim", [32, 16])
def test_rotary_fused_with_qk_norm_and_kv_store(monkeypatch: pytest.MonkeyPatch, rot_dim: int,
                                                loads_first: str) -> None:
    # q, k and v read together after the wait, or (BASTION_ROTARY_LOADS_FIRST=0) each after
    # the stores before it.
    monkeypatch.setenv("BASTION_ROTARY_LOADS_FIRST", loads_first)
    _check_norm_rope_store(rot_dim, torch.float32, CPU, atol=1e-5)


def test_rotary_fused_gptj_style_odd_heads_and_head_dim() -> None:
    # Interleaved pairs, 3 KV heads (padded to 4 inside the kernel), head dim 24 with 12 rotary.
    _check_norm_rope_store(12, torch.float32, CPU, atol=1e-5, num_kv_heads=3, head_dim=24,
                           is_neox=False)


# ----------------------------------------------------------------------------- sampling (CPU)


def test_sample_greedy_rows_are_argmax_first_index_on_ties() -> None:
    logits = torch.randn(5, 37)
    logits[1, 3] = logits[1, 30] = logits[1].max() + 1  # a tie: the first index wins
    logits[2] = float("-inf")  # nothing allowed: token 0, as torch.argmax gives
    logits[3, 36] = 50.0  # the last column, in the second 32-wide chunk
    zeros = torch.zeros(5)
    tokens = sample_tokens_triton(logits, zeros, torch.arange(5))
    assert tokens.tolist() == logits.argmax(dim=-1).tolist()
    assert tokens[1] == 3 and tokens[3] == 36
    # Rows read in three pieces of 16 (3 and 30 sit in different pieces; 36 in the short last
    # one): the same tokens.
    assert sample_tokens_triton(logits, zeros, torch.arange(5), num_splits=3).tolist() == \
        tokens.tolist()


def test_sample_draws_follow_softmax_over_temperature() -> None:
    # 500 rows of the same logits, each with its own seed: the token frequencies must match
    # softmax(x / T) within 0.07 (3 standard deviations; T = 1 instead of 0.7 would be off by
    # 0.1; fixed seeds: the outcome is deterministic, not flaky). One token is masked (-inf)
    # and must never be drawn; a greedy row in the batch stays an argmax.
    x = torch.tensor([2.0, 1.0, 0.5, float("-inf"), 0.0, -1.0, 1.5, 0.2])
    n, temp = 500, 0.7
    logits = x.expand(n, -1).clone()
    temperature = torch.full((n,), temp)
    temperature[0] = 0.0
    seeds = torch.arange(n, dtype=torch.int64) * 7919 + 11
    tokens = sample_tokens_triton(logits, temperature, seeds)
    assert tokens[0] == 0
    freq = torch.bincount(tokens[1:], minlength=8).float() / (n - 1)
    expected = torch.softmax(x / temp, dim=-1)
    assert freq[3] == 0
    assert (freq - expected).abs().max() < 0.07, (freq, expected)
    # The same seeds give the same tokens; other seeds give other draws.
    few = slice(0, 40)
    again = sample_tokens_triton(logits[few], temperature[few], seeds[few])
    assert torch.equal(again, tokens[few])
    assert not torch.equal(sample_tokens_triton(logits[few], temperature[few], seeds[few] + 1),
                           tokens[few])


def test_sample_draws_do_not_depend_on_how_a_row_is_split() -> None:
    # A token's noise depends on its index, not on the piece of the row it was read in: rows
    # of 100 tokens in one piece, in two of 64 and in seven of 16 draw the same tokens.
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(40, 100, generator=gen)
    temperature = torch.full((40,), 0.8)
    temperature[::5] = 0.0
    seeds = torch.randint(0, 1 << 62, (40,), generator=gen)
    draws = [sample_tokens_triton(logits, temperature, seeds, num_splits=n) for n in (1, 3, 7)]
    assert torch.equal(draws[0], draws[1]) and torch.equal(draws[0], draws[2])
    assert torch.equal(draws[0][::5], logits[::5].argmax(dim=-1))
    assert not torch.equal(draws[0], logits.argmax(dim=-1))


def test_sampler_takes_the_fused_pass_only_for_plain_unseeded_batches(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The Sampler's GPU branch, run on the CPU through the interpreted kernel: a plain batch
    # (greedy and temperature rows) takes it, with greedy rows exact; a batch with a seeded row
    # does not, so a seeded request's noise never depends on its companions.
    from bastion.core import sampler as sampler_mod
    from bastion.ipc.messages import SamplingParams

    calls: list[tuple[list[float], int]] = []

    def fused(logits, temperature, seeds):  # type: ignore[no-untyped-def]
        calls.append((temperature.tolist(), seeds.shape[0]))
        return sample_tokens_triton(logits, temperature, seeds)

    monkeypatch.setattr(sampler_mod, "use_triton", lambda *t: True)
    monkeypatch.setattr(sampler_mod, "_fused_sampler", lambda: fused)
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(0))

    def draw(params: list[SamplingParams], seeded: bool = False) -> list[int]:
        gens = [torch.Generator().manual_seed(9) if seeded and i == 0 else None
                for i in range(len(params))]
        meta = sampler_mod.SamplingMetadata.build(
            params, [[0]] * len(params), [[0]] * len(params), gens, [None] * len(params),
            CPU, 40)
        return sampler_mod.Sampler()(logits[: len(params)], meta).sampled_token_ids.tolist()

    plain = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7),
             SamplingParams(temperature=1.3)]
    tokens = draw(plain)
    assert calls == [([0.0, pytest.approx(0.7), pytest.approx(1.3)], 3)]
    assert tokens[0] == int(logits[0].argmax())
    draw([SamplingParams(temperature=0.8, seed=9)] + plain[1:], seeded=True)
    draw([SamplingParams(temperature=0.7, top_p=0.9)] + plain[1:])
    assert len(calls) == 1  # neither the seeded nor the top-p batch took the fused pass
    assert sampler_mod.greedy_tokens(logits).tolist() == logits.argmax(dim=-1).tolist()


# ----------------------------------------------------------------------------- activation (CPU)


def test_silu_and_mul_multiple_column_blocks() -> None:
    x = torch.randn(3, 2 * 1500)  # I = 1500 spans two 1024-wide column blocks
    torch.testing.assert_close(silu_and_mul_triton(x), silu_and_mul_ref(x), atol=1e-6, rtol=1e-6)


def test_grammar_bitmask_rows_mask_their_logits_rows_only() -> None:
    """Bitmask rows in fill order, mapped to permuted logits rows (one logits row has no
    grammar and stays as it was); a vocabulary past one program's 4096 tokens and not a
    multiple of 32, so the last word is partial."""
    from bastion.core.structured_output.bitmask import apply_token_bitmask_reference

    gen = torch.Generator().manual_seed(11)
    vocab = 4096 + 70
    logits = torch.randn(4, vocab, generator=gen)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, -(-vocab // 32)), generator=gen,
                            dtype=torch.int64).to(torch.int32)
    bitmask[1] = -1  # a row that allows everything
    rows = [2, 0, 3]
    out = logits.clone()
    apply_bitmask_rows_triton(out, bitmask, torch.tensor([1, -1, 0, 2], dtype=torch.int32))
    reference = logits.clone()
    apply_token_bitmask_reference(reference, bitmask, rows)
    assert torch.equal(out, reference)
    assert torch.equal(out[1], logits[1]) and torch.equal(out[0], logits[0])
    assert torch.isinf(out[2]).sum() == torch.isinf(reference[2]).sum() > 1000


@pytest.mark.parametrize("num_splits", [1, 3])
def test_sampling_under_a_bitmask_equals_sampling_masked_logits(num_splits) -> None:
    """The sampling kernel reading grammar bitmasks (row map with a row that has none; greedy
    and random rows; a vocabulary past one word boundary) draws exactly the tokens it draws
    from logits masked first by the mask kernel, with the same seeds; and greedy rows draw the
    argmax of the masked logits."""
    from bastion.core.structured_output.bitmask import apply_token_bitmask_reference

    gen = torch.Generator().manual_seed(5)
    vocab = 1000 + 7
    logits = torch.randn(5, vocab, generator=gen)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, -(-vocab // 32)), generator=gen,
                            dtype=torch.int64).to(torch.int32)
    bitmask[2] = 0
    bitmask[2, 3] = 1 << 9  # one token allowed: 3 * 32 + 9
    mask_rows = torch.tensor([2, -1, 0, 1, -1], dtype=torch.int32)
    temperature = torch.tensor([0.0, 0.0, 0.0, 0.8, 1.3])
    seeds = torch.arange(5) * 7919
    masked = logits.clone()
    apply_token_bitmask_reference(masked, bitmask, [2, 3, 0])
    tokens = sample_tokens_triton(logits, temperature, seeds, num_splits=num_splits,
                                  mask=bitmask, mask_rows=mask_rows)
    assert tokens.tolist() == sample_tokens_triton(masked, temperature, seeds,
                                                   num_splits=num_splits).tolist()
    assert tokens[0].item() == 3 * 32 + 9
    assert tokens[:3].tolist() == masked[:3].argmax(dim=-1).tolist()
    allowed = ((bitmask[mask_rows[3]][tokens[3] // 32] >> (tokens[3] % 32)) & 1).item()
    assert allowed == 1


# ----------------------------------------------------------------------------- real shapes (GPU)

_DEV = torch.device("cuda") if HAS_CUDA else CPU


@pytest.mark.parametrize("num_experts,top_k,renormalize", [(8, 2, True), (60, 1, False),
                                                             (128, 8, True)])
@pytest.mark.parametrize("num_tokens", [1, 37])
def test_moe_routing_matches_softmax_topk(num_experts: int, top_k: int, renormalize: bool,
                                          num_tokens: int) -> None:
    logits = torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(3))
    weights, ids = moe_routing_triton(logits, top_k, renormalize)
    ref_w, ref_ids = select_experts_ref(logits, top_k, renormalize)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids.long(), ref_ids)
    torch.testing.assert_close(weights, ref_w, rtol=1e-6, atol=1e-7)


def test_moe_routing_breaks_ties_towards_the_lower_expert() -> None:
    """Equal probabilities go to the lowest expert ids first (torch.topk on the CPU makes no
    such promise, so the reference cannot judge ties)."""
    logits = torch.zeros(2, 16)
    logits[0, [3, 9, 12]] = 2.0  # three tied leaders, then thirteen tied at 0
    logits[1, [15, 0]] = 1.0
    weights, ids = moe_routing_triton(logits, 4, False)
    assert ids.tolist() == [[3, 9, 12, 0], [0, 15, 1, 2]]
    assert weights[0, 0] == weights[0, 2] and weights[1, 2] == weights[1, 3]


@pytest.mark.parametrize("num_tokens,num_real", [(1, 1), (1, 0), (37, 30)])
def test_moe_routing_rows_past_the_real_tokens_choose_no_expert(num_tokens: int,
                                                                num_real: int) -> None:
    """A CUDA graph's padding rows (at or past the device scalar of the step's real tokens)
    get id -1 and choose nothing; the real rows are routed as without the scalar."""
    logits = torch.randn(num_tokens, 128, generator=torch.Generator().manual_seed(4))
    weights, ids = moe_routing_triton(logits, 8, True,
                                      torch.tensor([num_real], dtype=torch.int32))
    ref_w, ref_ids = select_experts_ref(logits, 8, True)
    assert torch.equal(ids[:num_real].long(), ref_ids[:num_real])
    assert torch.equal(ids[num_real:], torch.full_like(ids[num_real:], -1))
    torch.testing.assert_close(weights, ref_w, rtol=1e-6, atol=1e-7)


def _check_align(ids: torch.Tensor, block_m: int, num_local: int, expert_offset: int) -> None:
    """``moe_align_triton``'s output for ``ids``: each local expert's pairs (exactly those,
    in any order) in a span padded with the sentinel to a multiple of ``block_m``, experts in
    order, every block of a span naming its expert and the blocks past the end -1."""
    sorted_ids, block_experts, num_sorted = moe_align_triton(ids, block_m, num_local,
                                                             expert_offset=expert_offset)
    flat = ids.reshape(-1).tolist()
    sorted_ids, block_experts = sorted_ids.tolist(), block_experts.tolist()
    total = int(num_sorted.item())
    assert total % block_m == 0 and total <= len(sorted_ids)
    by_expert: dict[int, list[int]] = {}
    for p, e in enumerate(flat):
        by_expert.setdefault(e - expert_offset, []).append(p)
    at = 0
    for local in range(num_local):
        expected = by_expert.get(local, [])
        rows = -(-len(expected) // block_m) * block_m
        span = sorted_ids[at:at + rows]
        assert sorted(p for p in span if p != len(flat)) == expected
        assert span.count(len(flat)) == rows - len(expected)  # the sentinel pads
        assert block_experts[at // block_m:(at + rows) // block_m] == [local] * (rows // block_m)
        at += rows
    assert at == total
    assert set(block_experts[total // block_m:]) <= {-1}


@pytest.mark.parametrize("relaxed", ["0", "1"])
@pytest.mark.parametrize("block_m", [16, 64])
def test_moe_align_groups_pairs_by_local_expert_padded_to_the_block(
        block_m: int, relaxed: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BASTION_MOE_ALIGN_RELAXED", relaxed)
    gen = torch.Generator().manual_seed(5)
    # 8 global experts, this rank holds 2..5; ids outside (and -1: padding rows) go nowhere.
    ids = torch.randint(0, 8, (45, 2), generator=gen, dtype=torch.int32)
    ids[40:] = -1
    ids[ids == 3] = 2  # local expert 1 (global 3) gets no pair
    _check_align(ids, block_m, 4, 2)


@gpu
@requires_cuda
@pytest.mark.parametrize("relaxed", ["0", "1"])
@pytest.mark.parametrize("num_tokens,block_m", [(256, 64), (16384, 128)])
def test_gpu_moe_align_at_qwen3_30b_shape(num_tokens: int, block_m: int, relaxed: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen3-30B-A3B's routing (top-8 of 128) at a decode batch and a prefill chunk: the
    pairs grouped exactly, with the slots taken by either kind of atomic (many programs' worth
    of pairs race for each expert's cursor)."""
    monkeypatch.setenv("BASTION_MOE_ALIGN_RELAXED", relaxed)
    logits = torch.randn(num_tokens, 128, device="cuda",
                         generator=torch.Generator(device="cuda").manual_seed(num_tokens))
    ids = logits.topk(8, dim=-1).indices.to(torch.int32)
    ids[-3:] = -1  # padding rows of a captured batch
    _check_align(ids, block_m, 128, 0)
    _check_align(ids, block_m, 64, 64)  # the second of two expert-parallel ranks


@pytest.mark.parametrize("num_experts,top_k,num_tokens", [
    (4, 1, 1), (8, 2, 1), (8, 2, 70), (16, 8, 33), (8, 8, 5)])
def test_fused_moe_matches_reference(num_experts: int, top_k: int, num_tokens: int) -> None:
    gen = torch.Generator().manual_seed(num_experts * 100 + num_tokens)
    hidden, inter = 48, 40  # not multiples of the K tile: the masked loop
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter ** 0.5
    weights, ids = select_experts_ref(torch.randn(num_tokens, num_experts, generator=gen),
                                      top_k, True)
    config = grouped_moe_config(num_tokens, top_k, num_experts)
    config = {**config, "up": {**config["up"], "BLOCK_SIZE_K": 32},
              "down": {**config["down"], "BLOCK_SIZE_K": 32}}
    out = fused_moe_triton(x, w13, w2, weights, ids.int(), config=config)
    torch.testing.assert_close(out, fused_moe_ref(x, w13, w2, weights, ids), rtol=1e-5,
                               atol=1e-5)


_GEMV_TILES = {"up": {"BLOCK_SIZE_N": 16, "BLOCK_SIZE_K": 32, "num_warps": 4, "num_stages": 1},
               "down": {"BLOCK_SIZE_N": 8, "BLOCK_SIZE_K": 32, "num_warps": 4, "num_stages": 1}}


@pytest.mark.parametrize("num_experts,top_k,num_tokens", [
    (4, 1, 1), (8, 2, 1), (16, 8, 1), (8, 8, 3), (8, 2, 9)])
def test_fused_moe_gemv_matches_reference(num_experts: int, top_k: int, num_tokens: int) -> None:
    """The matrix-vector path: tiles that do not divide the sizes (masked columns and K),
    one token, tokens sharing experts, and every expert chosen by some token (top-8 of 8)."""
    gen = torch.Generator().manual_seed(num_experts * 10 + top_k + num_tokens)
    hidden, inter = 72, 40
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter ** 0.5
    weights, ids = select_experts_ref(torch.randn(num_tokens, num_experts, generator=gen),
                                      top_k, True)
    out = fused_moe_triton(x, w13, w2, weights, ids.int(), config={"gemv": _GEMV_TILES})
    torch.testing.assert_close(out, fused_moe_ref(x, w13, w2, weights, ids), rtol=1e-5,
                               atol=1e-5)


def test_fused_moe_gemv_expert_parallel_slices_and_padding_rows() -> None:
    """As the grouped path: two ranks' halves sum to the whole, and a token with no expert on
    a rank (or a padding row, id -1) gets exactly zero there, with no zero fill."""
    gen = torch.Generator().manual_seed(12)
    num_tokens, hidden, inter, num_experts = 4, 64, 24, 8  # 2 K steps of the up tile
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter ** 0.5
    weights, ids = select_experts_ref(torch.randn(num_tokens, num_experts, generator=gen), 2,
                                      True)
    ids = ids.int()
    ids[0] = torch.tensor([0, 1], dtype=torch.int32)  # only rank 0's experts
    ids[-1] = -1  # a padding row
    config = {"gemv": _GEMV_TILES}
    low = fused_moe_triton(x, w13[:4], w2[:4], weights, ids, expert_offset=0, config=config)
    high = fused_moe_triton(x, w13[4:], w2[4:], weights, ids, expert_offset=4, config=config)
    assert torch.count_nonzero(high[0]) == 0
    assert torch.count_nonzero(low[-1]) == 0 and torch.count_nonzero(high[-1]) == 0
    torch.testing.assert_close(low + high, fused_moe_ref(x, w13, w2, weights, ids), rtol=1e-5,
                               atol=1e-5)


def test_fused_moe_gemv_tiles_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """``BASTION_MOE_GEMV_CONFIG`` (in-model tile sweeps) replaces the table's up tile and
    keeps its down tile; the kernels run in those tiles and still match the reference; a
    malformed value is refused with the variable's name."""
    from bastion.ops.triton import fused_moe_gemv as g

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 48, generator=gen)
    w13 = torch.randn(4, 2 * 24, 48, generator=gen) / 48 ** 0.5
    w2 = torch.randn(4, 48, 24, generator=gen) / 24 ** 0.5
    weights, ids = select_experts_ref(torch.randn(2, 4, generator=gen), 2, True)
    monkeypatch.setenv("BASTION_MOE_GEMV_CONFIG", "up=4,16,2,1")
    up, down = g._tiles({"up": _GEMV_TILES["up"], "down": _GEMV_TILES["down"]})
    assert up == {"BLOCK_SIZE_N": 4, "BLOCK_SIZE_K": 16, "num_warps": 2, "num_stages": 1}
    assert down == _GEMV_TILES["down"]
    out = fused_moe_triton(x, w13, w2, weights, ids.int(), config={"gemv": _GEMV_TILES})
    torch.testing.assert_close(out, fused_moe_ref(x, w13, w2, weights, ids), rtol=1e-5,
                               atol=1e-5)
    monkeypatch.setenv("BASTION_MOE_GEMV_CONFIG", "up=4,16")
    with pytest.raises(ValueError, match="BASTION_MOE_GEMV_CONFIG"):
        fused_moe_triton(x, w13, w2, weights, ids.int(), config={"gemv": _GEMV_TILES})


@pytest.mark.parametrize("rows,n,k,block_k,bias", [
    (1, 40, 96, 32, False), (1, 37, 100, 32, True), (2, 37, 80, 32, True), (3, 16, 64, 64, False),
    (4, 9, 100, 64, True)])
def test_gemv_matches_linear(rows: int, n: int, k: int, block_k: int, bias: bool) -> None:
    """The decode-rows matmul: column tiles past N, K not a multiple of the tile (the masked
    loop) and exact multiples (the unmasked one), a bias, a float32 output."""
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    x = torch.randn(rows, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    out = gemv_triton(x, w, b, {"BLOCK_N": 8, "BLOCK_K": block_k, "num_warps": 4})
    torch.testing.assert_close(out, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-4)
    half = gemv_triton(x.half(), w.half(), None, {"BLOCK_N": 4, "BLOCK_K": block_k,
                                                   "num_warps": 4}, out_dtype=torch.float32)
    assert half.dtype == torch.float32
    torch.testing.assert_close(half, x.half().float() @ w.half().float().t(), rtol=1e-4,
                               atol=1e-3)


@pytest.fixture
def gemv_launches(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """The keyword arguments of every matrix-vector launch, on a device that would prefetch
    (``use_prefetch`` true); a launch asking for the L2 prefetch (inline PTX, which the
    interpreter cannot run) is recorded and not run."""
    from bastion.ops.triton import gemv as g

    launches: list[dict] = []
    kernel = g._gemv_kernel

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append({"grid": grid, **kwargs})
                if not kwargs["PREFETCH"]:
                    kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(g, "_gemv_kernel", Recorder())
    monkeypatch.setattr(g, "use_prefetch", lambda device, num_bytes: True)
    return launches


@pytest.mark.parametrize("one_row", [True, False])
@pytest.mark.parametrize("n,k,whole_k,block_n", [(40, 96, 128, 8), (20, 2048, 2048, 8),
                                                   (12, 3072, 4096, 4), (9, 4096, 4096, 4)])
def test_gemv_whole_k_tile(monkeypatch: pytest.MonkeyPatch, gemv_launches: list[dict], n: int,
                           k: int, whole_k: int, block_n: int, one_row: bool) -> None:
    """``BASTION_GEMV_WHOLE_K``: a one-row product that would prefetch its weights launches
    with K in one step (K rounded up to a power of two, masked past K) and at most 32 KB of
    bf16 weights a program, without the L2 prefetch, through the one-row kernel (or, with
    ``BASTION_GEMV_ONE_ROW=0``, the general one), and still matches, bias included; off, it
    keeps the table's tile and prefetches."""
    from bastion.ops.triton.gemv import gemv_triton

    monkeypatch.setenv("BASTION_GEMV_ONE_ROW", "1" if one_row else "0")
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(1, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    config = {"BLOCK_N": 8, "BLOCK_K": 32, "num_warps": 4}
    monkeypatch.setenv("BASTION_GEMV_WHOLE_K", "1")
    b = torch.randn(n, generator=gen).bfloat16()
    out = gemv_triton(x, w, b, config, out_dtype=torch.float32)
    torch.testing.assert_close(out, x.float() @ w.float().t() + b.float(), rtol=1e-4, atol=1e-3)
    launch = gemv_launches[-1]
    assert (launch["BLOCK_K"], launch["BLOCK_N"], launch["PREFETCH"]) == (whole_k, block_n, False)
    assert launch["ONE_ROW"] == one_row
    assert launch["grid"] == (-(-n // block_n),) and launch["EVEN_K"] == (k == whole_k)
    monkeypatch.setenv("BASTION_GEMV_WHOLE_K", "0")
    gemv_triton(x, w, None, config)
    assert (gemv_launches[-1]["BLOCK_K"], gemv_launches[-1]["PREFETCH"]) == (32, True)
    assert not gemv_launches[-1]["ONE_ROW"]


def test_gemv_whole_k_keeps_the_tile_past_4096_or_two_rows(monkeypatch: pytest.MonkeyPatch,
                                                           gemv_launches: list[dict]) -> None:
    from bastion.ops.triton.gemv import gemv_triton

    monkeypatch.setenv("BASTION_GEMV_WHOLE_K", "1")
    config = {"BLOCK_N": 8, "BLOCK_K": 1024, "num_warps": 4}
    gemv_triton(torch.randn(1, 4100).bfloat16(), torch.randn(3, 4100).bfloat16(), None, config)
    gemv_triton(torch.randn(2, 512).bfloat16(), torch.randn(3, 512).bfloat16(), None, config)
    assert [(launch["BLOCK_K"], launch["PREFETCH"]) for launch in gemv_launches] == [
        (1024, True), (1024, True)]


def test_fused_moe_expert_parallel_slices_and_padding_rows() -> None:
    """Two ranks' halves of the experts sum to the whole; a rank none of whose experts a token
    chose, and rows with id -1, add exactly zero."""
    gen = torch.Generator().manual_seed(11)
    num_tokens, hidden, inter, num_experts = 20, 32, 32, 8
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter ** 0.5
    weights, ids = select_experts_ref(torch.randn(num_tokens, num_experts, generator=gen), 2,
                                      True)
    ids = ids.int()
    ids[:5] = torch.tensor([0, 1], dtype=torch.int32)  # only rank 0's experts
    ids[-3:] = -1  # padding rows
    low = fused_moe_triton(x, w13[:4], w2[:4], weights, ids, expert_offset=0)
    high = fused_moe_triton(x, w13[4:], w2[4:], weights, ids, expert_offset=4)
    assert torch.count_nonzero(high[:5]) == 0
    assert torch.count_nonzero(low[-3:]) == 0 and torch.count_nonzero(high[-3:]) == 0
    torch.testing.assert_close(low + high, fused_moe_ref(x, w13, w2, weights, ids), rtol=1e-5,
                               atol=1e-5)


@gpu
@requires_cuda
@pytest.mark.parametrize("num_splits", [None, 1])
def test_gpu_attention_decode_qwen3_shape(num_splits: int | None) -> None:
    q_lens = [1] * 64
    ctx_lens = [
        int(c) for c in torch.randint(1, 2048, (64,), generator=torch.Generator().manual_seed(0))
    ]
    _check_attention(q_lens, ctx_lens, 16, 8, 128, 16, num_splits, torch.bfloat16, _DEV, atol=2e-2)


@gpu
@requires_cuda
# One token takes the matrix-vector kernels, which the grouped path's switch does not touch.
@pytest.mark.parametrize("num_tokens,grouped_pdl", [(1, "0")] + [
    (n, pdl) for n in (8, 256, 3000) for pdl in ("0", "1")])
def test_gpu_fused_moe_qwen3_30b_shape_bf16_under_a_graph(
        num_tokens: int, grouped_pdl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen3-30B-A3B's expert shapes (128 experts of 768, hidden 2048, top-8) in bf16:
    routing, align and both products captured in one CUDA graph (no host sync anywhere) and
    replayed on new inputs, against the reference on the same bf16 weights; with
    ``grouped_pdl`` the grouped path's kernels (from 8 tokens) launch programmatically
    behind the routing kernel and one another."""
    monkeypatch.setenv("BASTION_MOE_GROUPED_PDL", grouped_pdl)
    dev = torch.device("cuda")
    num_experts, inter, hidden, top_k = 128, 768, 2048, 8
    gen = torch.Generator(device=dev).manual_seed(num_tokens)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, device=dev, generator=gen)
           / hidden ** 0.5).bfloat16()
    w2 = (torch.randn(num_experts, hidden, inter, device=dev, generator=gen)
          / inter ** 0.5).bfloat16()
    x = torch.randn(num_tokens, hidden, device=dev, generator=gen).bfloat16()
    logits = torch.randn(num_tokens, num_experts, device=dev, generator=gen).bfloat16()

    def step() -> torch.Tensor:
        weights, ids = moe_routing_triton(logits, top_k, True)
        return fused_moe_triton(x, w13, w2, weights, ids)

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    x.copy_(torch.randn(num_tokens, hidden, device=dev, generator=gen))
    logits.copy_(torch.randn(num_tokens, num_experts, device=dev, generator=gen))
    out.fill_(float("nan"))
    graph.replay()
    weights, ids = select_experts_ref(logits, top_k, True)
    ref = fused_moe_ref(x, w13, w2, weights, ids).float()
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err < 1e-2, err


@gpu
@requires_cuda
@pytest.mark.parametrize("rows", [1, 2, 4])
def test_gpu_gemv_decode_rows_bf16(rows: int) -> None:
    """The decode-rows matmul as the linear layers call it on CUDA (``ops.linear``), at
    Qwen3-30B-A3B's qkv and o shapes and its router's float32 output, against float32
    products; where ``gemv_config`` leaves a shape to cuBLAS (qkv's 5120 columns from two
    rows on) ``gemv`` must say so with None."""
    from bastion.ops.linear import gemv, gemv_config

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(rows)
    x = torch.randn(rows, 2048, device=dev, generator=gen).bfloat16()
    for n, out_dtype in ((5120, None), (2048, None), (128, torch.float32)):
        w = (torch.randn(n, 2048, device=dev, generator=gen) / 2048 ** 0.5).bfloat16()
        out = gemv(x, w, out_dtype=out_dtype)
        if gemv_config(rows, n, 2048) is None:
            assert out is None
            continue
        assert out is not None and out.dtype == (out_dtype or torch.bfloat16)
        ref = x.float() @ w.float().t()
        assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2


@gpu
@requires_cuda
def test_gpu_decode_chain_same_bits_whatever_the_launch_overlap(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Four MoE decoder layers' kernels for one token (norm, QKV-sized and o-sized products,
    norm, float32 router, routing, both expert kernels), distinct weights per layer, replayed
    from a CUDA graph: without programmatic dependent launch, with each kernel releasing the
    next after its wait, and releasing it as it starts with the weight tiles prefetched into
    L2 (ops/triton/pdl.py), and with the weights read evict-first from L2 or not, give the same
    bits as the mode of the same arithmetic: only when kernels start and what L2 keeps may
    change. A graph replayed again gives the same bits too. The early modes' one-row products
    read K in one step (``BASTION_GEMV_WHOLE_K``), whose float32 sums run in another order
    than the stepped K of the modes without early release, so they are compared with the first
    early mode; the early mode with K in steps (the same sums as without programmatic launch)
    is compared with the mode without it, so a kernel reading before its wait what the one
    before it still writes shows in either group. A failure names, per mode, the first kernel
    output (layer and name) whose bits differ."""
    from bastion.ops.linear import gemv

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    hidden, num_experts, inter, top_k = 2048, 128, 768, 8

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, device=dev, generator=gen) / shape[-1] ** 0.5).bfloat16()

    layers = [dict(norm=rand(hidden) + 1, qkv=rand(5120, hidden), o=rand(hidden, 4096),
                   norm2=rand(hidden) + 1, router=rand(num_experts, hidden),
                   w13=rand(num_experts, 2 * inter, hidden), w2=rand(num_experts, hidden, inter))
              for _ in range(4)]
    x0 = torch.randn(1, hidden, device=dev, generator=gen).bfloat16()

    def step(x: torch.Tensor, trace: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
        res = torch.zeros_like(x)
        for i, w in enumerate(layers):
            h, res = fused_add_rms_norm_triton(x, res, w["norm"], 1e-6)
            qkv = gemv(h, w["qkv"])
            o = gemv(qkv[:, :4096].contiguous(), w["o"])
            h2, res = fused_add_rms_norm_triton(o, res, w["norm2"], 1e-6)
            logits = gemv(h2, w["router"], out_dtype=torch.float32)
            weights, ids = moe_routing_triton(logits, top_k, True)
            x = fused_moe_triton(h2, w["w13"], w["w2"], weights, ids)
            trace += [(f"layer {i} {name}", t) for name, t in (
                ("norm", h), ("qkv", qkv), ("o", o), ("norm2", h2), ("router", logits),
                ("weights", weights), ("ids", ids), ("experts", x))]
        out = x + res
        trace.append(("out", out))
        return out

    modes = ("off", "late", "early+prefetch", "early+prefetch, K in steps",
             "early+prefetch, normal L2 priority",
             # Last, once every other graph has run: the first two graphs replayed again.
             "off, replayed again", "early+prefetch, replayed again")
    traces: dict[str, list[tuple[str, torch.Tensor]]] = {}
    graphs = {}  # mode -> (graph, its input kept alive for a later replay, its trace)
    for mode in modes:
        monkeypatch.setenv("BASTION_PDL", "0" if mode.startswith("off") else "1")
        monkeypatch.setenv("BASTION_PDL_EARLY", "1" if mode.startswith("early") else "0")
        monkeypatch.setenv("BASTION_L2_PREFETCH", "1")
        monkeypatch.setenv("BASTION_L2_EVICT_FIRST", "0" if "normal" in mode else "1")
        monkeypatch.setenv("BASTION_GEMV_WHOLE_K", "0" if "K in steps" in mode else "1")
        again = mode.removesuffix(", replayed again")
        if again != mode:  # that mode's graph, replayed once more
            graph, _, trace = graphs[again]
        else:
            static = x0.clone()
            step(static, [])
            graph, trace = torch.cuda.CUDAGraph(), []
            with torch.cuda.graph(graph):
                step(static, trace)
            graphs[mode] = graph, static, trace
        for _ in range(3):
            graph.replay()
        traces[mode] = [(name, t.clone()) for name, t in trace]
    assert torch.isfinite(traces["off"][-1][1]).all()

    def first_difference(mode: str, reference: str) -> str | None:
        for (name, a), (_, b) in zip(traces[mode], traces[reference]):
            if not torch.equal(a, b):
                where = (a != b).nonzero()[0].tolist()
                return (f"{mode}: {name} first differs from {reference} at {where}: "
                        f"{a[tuple(where)].item()} against {b[tuple(where)].item()}")
        return None

    # For the log, not asserted: where the whole-K sums first round otherwise.
    print(first_difference("early+prefetch", "off") or "early+prefetch: the bits of off")
    differences = []
    for mode in modes:
        if mode in ("off", "early+prefetch"):
            continue
        whole_k = mode.startswith("early") and "K in steps" not in mode
        difference = first_difference(mode, "early+prefetch" if whole_k else "off")
        if difference is not None:
            differences.append(difference)
    assert not differences, "\n".join(differences)


@gpu
@requires_cuda
def test_gpu_attention_mixed_prefill_qwen3_shape() -> None:
    q_lens = [512, 300, 1, 1, 77, 1]
    ctx_lens = [0, 700, 1000, 5, 64, 3000]
    _check_attention(q_lens, ctx_lens, 16, 8, 128, 16, None, torch.bfloat16, _DEV, atol=2e-2)


@gpu
@requires_cuda
def test_gpu_elementwise_kernels_bf16() -> None:
    dt = torch.bfloat16
    x, res = (torch.randn(256, 1024, device=_DEV, dtype=dt) for _ in range(2))
    w = torch.randn(1024, device=_DEV, dtype=dt)
    torch.testing.assert_close(
        rms_norm_triton(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), atol=3e-2, rtol=2e-2
    )
    out, new_res = fused_add_rms_norm_triton(x, res, w, 1e-6)
    ref_out, ref_res = fused_add_rms_norm_ref(x.clone(), res.clone(), w, 1e-6)
    torch.testing.assert_close(new_res, ref_res, atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(out, ref_out, atol=6e-2, rtol=2e-2)
    g = torch.randn(256, 2 * 3072, device=_DEV, dtype=dt)
    torch.testing.assert_close(silu_and_mul_triton(g), silu_and_mul_ref(g), atol=3e-2, rtol=2e-2)
    pos = torch.randint(0, 4096, (256,), device=_DEV)
    cache = _cos_sin_cache(4096, 128).to(_DEV)
    q, k = (
        torch.randn(256, 16 * 128, device=_DEV, dtype=dt),
        torch.randn(256, 8 * 128, device=_DEV, dtype=dt),
    )
    q_out, k_out = apply_rotary_emb_triton(pos, q, k, cache, 128)
    q_ref, k_ref = apply_rotary_emb_ref(pos, q.clone(), k.clone(), cache, 128)
    torch.testing.assert_close(q_out, q_ref, atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(k_out, k_ref, atol=3e-2, rtol=2e-2)


@gpu
@requires_cuda
@pytest.mark.parametrize("rot_dim", [32, 16])
def test_gpu_rotary_fused_with_qk_norm_and_kv_store_bf16(rot_dim: int) -> None:
    # bf16 against the float32 reference: the kernel rounds the normed heads to bf16 before
    # rotating them, as the unfused kernels did.
    _check_norm_rope_store(rot_dim, torch.bfloat16, _DEV, atol=6e-2)


@gpu
@requires_cuda
def test_gpu_sampler_fused_path_real_vocab() -> None:
    from bastion.core.sampler import Sampler, SamplingMetadata, greedy_tokens, make_generator
    from bastion.ipc.messages import SamplingParams

    gen = torch.Generator(device=_DEV).manual_seed(0)
    logits = torch.randn(256, 151936, device=_DEV, generator=gen).to(torch.bfloat16)
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))
    # 20000 draws from one row's softmax(x / 0.6) match it within 0.01 (3 std).
    x = torch.randn(16, device=_DEV, generator=gen)
    many = x.expand(20000, -1).contiguous()
    temps = torch.full((20000,), 0.6, device=_DEV)
    seeds = torch.randint(0, 1 << 62, (20000,), device=_DEV, generator=gen)
    freq = torch.bincount(sample_tokens_triton(many, temps, seeds), minlength=16).float() / 20000
    assert (freq - torch.softmax(x / 0.6, dim=-1)).abs().max() < 0.01
    # Through the Sampler: a seeded row's token depends on its seed and logits only, not on its
    # companions (a batch with a seeded row stays on the torch path).
    params = [SamplingParams(temperature=0.8, seed=5), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0)]

    def draw(rows: list[int]) -> list[int]:
        meta = SamplingMetadata.build(
            [params[r] for r in rows], [[0]] * len(rows), [[0]] * len(rows),
            [make_generator(5, _DEV) if r == 0 else None for r in rows], [None] * len(rows),
            _DEV, logits.shape[1])
        assert meta.draws_plainly
        return Sampler()(logits[rows], meta).sampled_token_ids.tolist()

    first = draw([0, 1, 2])
    assert first[1] == int(logits[1].argmax())
    assert draw([2, 0])[1] == first[0] == draw([0])[0]


def test_attention_config_from_the_environment_keeps_unset_fields(
        monkeypatch: pytest.MonkeyPatch) -> None:
    mod = _K["unified_attention"]
    default = mod.KernelConfig(64, 4, 3, 16)
    env = "BASTION_DECODE_ATTENTION_CONFIG"
    monkeypatch.delenv(env, raising=False)
    assert mod._config(env, default) == default
    monkeypatch.setenv(env, "32,2,2")
    assert mod._config(env, default) == mod.KernelConfig(32, 2, 2, 16)
    monkeypatch.setenv(env, "32,2,2,64")
    assert mod._config(env, default) == mod.KernelConfig(32, 2, 2, 64)
    for bad in ("32,2", "32,2,2,64,1", "a,b,c"):
        monkeypatch.setenv(env, bad)
        with pytest.raises(ValueError, match=env):
            mod._config(env, default)


@gpu
@requires_cuda
def test_gpu_grammar_bitmask_applier_matches_the_reference() -> None:
    """The runner's applier on a GPU: Qwen3's vocabulary, bitmask rows for a permuted subset
    of the logits rows, applied twice through the same pinned buffers (once copied in, once
    filled in place as the runner does); the rows without a grammar stay as they were."""
    import numpy as np

    from bastion.core.structured_output.bitmask import (
        GrammarBitmaskApplier,
        apply_token_bitmask_reference,
    )

    gen = torch.Generator().manual_seed(2)
    vocab, words = 151936, 4748
    applier = GrammarBitmaskApplier()
    for step in range(2):
        logits = torch.randn(8, vocab, generator=gen).to(_DEV)
        bitmask = torch.randint(-2**31, 2**31 - 1, (3, words), generator=gen,
                                dtype=torch.int64).to(torch.int32)
        rows = bitmask.numpy()
        if step == 1:
            rows = applier.buffer(3, words, logits.device, num_logits_rows=8)
            np.copyto(rows, bitmask.numpy())
        out = logits.clone()
        applier.apply(out, rows, [5, 0, 3])
        reference = logits.clone()
        apply_token_bitmask_reference(reference, bitmask.to(_DEV), [5, 0, 3])
        assert torch.equal(out, reference)
        assert torch.equal(out[1], logits[1])
