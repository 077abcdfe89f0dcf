"""The CPU's C kernels (ops/cpu) against the torch code they replace: decode attention over
the paged cache, rotary + KV store, greedy argmax; their bounds checks; and the build: cached by
source, flags, compiler and CPU, safe to race, and a clean fallback without a compiler, after a
failed build or with BASTION_CPU_KERNELS=0.

Attention's tolerance: the kernel is built with -ffast-math (reassociated float32 sums, glibc's
vector expf), so it agrees with the reference to float32 rounding of a softmax over a few hundred
keys: rtol 1e-5, atol 1e-6. Rotary + store and argmax are exact (bit for bit)."""

from __future__ import annotations

import logging
import os
import random
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from bastion.core.forward_context import build_attention_metadata
from bastion.ops import attention as attention_ops
from bastion.ops import cpu
from bastion.ops.activation import silu_and_mul, silu_and_mul_ref
from bastion.ops.attention import paged_attention, paged_attention_ref
from bastion.ops.cpu import activation as cpu_activation
from bastion.ops.cpu import argmax as cpu_argmax
from bastion.ops.cpu import load_cpu_kernel, quant_gemv4
from bastion.ops.cpu import paged_attention as cpu_attention
from bastion.ops.cpu import rms_norm as cpu_rms_norm
from bastion.ops.cpu import rotary as cpu_rotary
from bastion.ops.cpu.argmax import argmax_rows
from bastion.ops.layernorm import (
    fused_add_rms_norm,
    fused_add_rms_norm_ref,
    rms_norm,
    rms_norm_ref,
)
from bastion.ops.rotary import apply_rotary_emb, apply_rotary_emb_ref

has_compiler = pytest.mark.skipif(cpu._compiler() is None, reason="no C compiler")


@pytest.fixture(autouse=True)
def _kernels_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test here starts with the kernels on, whatever the caller's environment says."""
    monkeypatch.delenv("BASTION_CPU_KERNELS", raising=False)


@pytest.fixture
def fresh_builds():
    """Forget which compiler and libraries this process found, before and after the test (a
    test that changes $CC, $PATH or the cache folder must not leave its answer behind)."""
    def forget() -> None:
        for cached in (cpu._compiler, cpu._load, cpu._bind, cpu.bind_vectorized):
            cached.cache_clear()
        cpu._unavailable.clear()

    forget()
    yield
    forget()


def _cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
           seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def _scattered_tables(seq_lens: list[int], block_size: int, num_blocks: int,
                      shared: int) -> list[list[int]]:
    """Shuffled block ids; sequences 0 and 1 share their first ``shared`` blocks (a cached
    prefix), the rest own theirs."""
    free = list(range(num_blocks))
    random.Random(1).shuffle(free)
    tables = []
    for i, length in enumerate(seq_lens):
        n = -(-length // block_size)
        table = tables[0][:shared] if i == 1 else []
        tables.append(table + [free.pop() for _ in range(n - len(table))])
    return tables


def _decode_step(seq_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
                 block_size: int, pad_value: int = 0):
    """A decode step over scattered blocks; each table row padded past its sequence's blocks
    with ``pad_value`` (the runner pads with 0; anything else must not be read either)."""
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 7
    tables = _scattered_tables(seq_lens, block_size, num_blocks, shared=2)
    k_cache, v_cache = _cache(num_blocks, block_size, num_kv_heads, head_dim)
    meta = build_attention_metadata([1] * len(seq_lens), seq_lens, tables, block_size)
    for i, table in enumerate(tables):
        meta.block_tables[i, len(table):] = pad_value
    query = torch.randn(len(seq_lens), num_heads, head_dim,
                        generator=torch.Generator().manual_seed(2))
    return query, k_cache, v_cache, meta


# ------------------------------------------------------------------------- the build


@has_compiler
def test_every_kernel_builds_and_the_start_up_line_names_them() -> None:
    assert all(load_cpu_kernel(name) is not None for name in cpu.KERNELS)
    line = cpu.describe_cpu_path(torch.float32)
    assert line.startswith("C kernels paged_attention, rotary, argmax, quant_gemv, quant_gemv4, "
                           "rms_norm, activation, decoder_layers (OpenMP, "
                           f"{torch.get_num_threads()} threads;"), line
    assert "torch references" not in line
    line = cpu.describe_cpu_path(torch.bfloat16)
    assert line.startswith("C kernels argmax (OpenMP"), line
    assert line.endswith("; torch references for paged_attention, rotary, quant_gemv, "
                         "quant_gemv4, rms_norm, activation, decoder_layers (bfloat16 "
                         "activations)")


@has_compiler
@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux's /proc")
def test_the_kernels_share_torchs_openmp_runtime() -> None:
    """One libgomp in the process: a second runtime's idle threads would spin against
    torch's on the same cores."""
    assert load_cpu_kernel("paged_attention") is not None
    maps = Path("/proc/self/maps").read_text().splitlines()
    runtimes = {os.path.realpath(line.split()[-1]) for line in maps
                if "libgomp" in line.rsplit("/", 1)[-1]}
    assert len(runtimes) == 1, runtimes


def test_kernels_can_be_turned_off_at_any_call(monkeypatch) -> None:
    monkeypatch.setenv("BASTION_CPU_KERNELS", "0")
    assert load_cpu_kernel("paged_attention") is None
    assert cpu_attention._kernel() is None and cpu_rotary._kernel() is None
    assert cpu_argmax._kernel() is None
    assert cpu.describe_cpu_path(torch.float32) == "torch references (BASTION_CPU_KERNELS=0)"
    k_cache, v_cache = _cache(4, 4, 1, 8)
    assert not cpu_attention.can_run(torch.randn(1, 2, 8), k_cache, v_cache)
    monkeypatch.delenv("BASTION_CPU_KERNELS")
    assert (cpu_attention._kernel() is not None) == (cpu._compiler() is not None)


def test_without_a_compiler_every_kernel_falls_back_with_one_warning(
        monkeypatch, tmp_path, caplog, fresh_builds) -> None:
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no cc, no gcc
    monkeypatch.setenv("BASTION_CACHE_DIR", str(tmp_path / "cache"))
    caplog.set_level(logging.INFO, logger="bastion.ops.cpu")
    assert [load_cpu_kernel(name) for name in cpu.KERNELS] == [None] * len(cpu.KERNELS)
    assert cpu.describe_cpu_path(torch.float32) == "torch references (no C compiler)"
    warnings = [r.getMessage() for r in caplog.records
                if r.levelno >= logging.WARNING and r.name.startswith("bastion")]
    assert len(warnings) == 1 and "no C compiler" in warnings[0], warnings
    # Every op still answers, through its reference.
    query, k_cache, v_cache, meta = _decode_step([5, 11], 4, 2, 8, 4)
    assert not cpu_attention.can_run(query, k_cache, v_cache)
    assert torch.equal(paged_attention(query, k_cache, v_cache, meta, 0.5),
                       paged_attention_ref(query, k_cache, v_cache, meta, 0.5))
    logits = torch.randn(3, 100)
    assert torch.equal(argmax_rows(logits), logits.argmax(-1))
    assert not (tmp_path / "cache").exists()


def test_a_failed_build_falls_back_with_a_warning(monkeypatch, tmp_path, caplog,
                                                  fresh_builds) -> None:
    monkeypatch.setenv("BASTION_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    assert load_cpu_kernel("paged_attention") is None
    assert "CPU kernel paged_attention unavailable" in caplog.text
    assert "using the torch reference" in caplog.text
    assert cpu.describe_cpu_path(torch.float32) == "torch references (its build failed)"
    assert list(tmp_path.rglob("*")) == [tmp_path / "cpu-kernels"]  # no library, no temp


@has_compiler
def test_without_march_native_the_kernel_builds_for_the_default_target(
        monkeypatch, tmp_path, fresh_builds) -> None:
    """A compiler that rejects -march=native (an Arm gcc of some versions, a cross compiler)
    still gets the kernels, built for its default target."""
    real = cpu._compiler()
    wrapper = tmp_path / "cc-without-native"
    wrapper.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        case " $* " in *" -march=native "*) echo "cc: error: no native" >&2; exit 1;; esac
        exec {' '.join(real)} "$@"
        """))
    wrapper.chmod(0o755)
    cpu._compiler.cache_clear()
    monkeypatch.setenv("CC", str(wrapper))
    monkeypatch.setenv("BASTION_CACHE_DIR", str(tmp_path / "cache"))
    assert load_cpu_kernel("argmax") is not None
    assert len(list((tmp_path / "cache").rglob("argmax-*.so"))) == 1
    logits = torch.randn(4, 1000)
    assert torch.equal(argmax_rows(logits), logits.argmax(-1))


@has_compiler
def test_the_cache_is_keyed_by_the_cpus_features(monkeypatch, tmp_path, fresh_builds) -> None:
    """A cache folder shared with a machine of other CPU features (-march=native) holds one
    library per machine; neither is handed the other's."""
    monkeypatch.setenv("BASTION_CACHE_DIR", str(tmp_path))
    assert load_cpu_kernel("argmax") is not None
    cpu._load.cache_clear()
    monkeypatch.setattr(cpu, "_cpu_flags", lambda: "flags\t\t: fpu sse sse2")
    assert load_cpu_kernel("argmax") is not None
    assert len(list(tmp_path.rglob("argmax-*.so"))) == 2


@has_compiler
def test_a_linked_kernel_is_rebuilt_when_a_part_it_links_changes(monkeypatch, tmp_path,
                                                                  fresh_builds) -> None:
    """decoder_layers links the op kernels' objects: a change to one of them (here its flags)
    is a new library, and the part is compiled with its own flags, not the caller's."""
    monkeypatch.setenv("BASTION_CACHE_DIR", str(tmp_path))
    assert "rms_norm" in cpu.LINKED["decoder_layers"]
    assert load_cpu_kernel("decoder_layers") is not None
    cpu._load.cache_clear()
    monkeypatch.setitem(cpu.KERNELS, "rms_norm", ("-ffp-contract=off", "-DBASTION_PROBE=1"))
    commands = []
    run = subprocess.run
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: commands.append(cmd) or run(cmd, **kw))
    assert load_cpu_kernel("decoder_layers") is not None
    assert len(list(tmp_path.rglob("decoder_layers-*.so"))) == 2
    [rms] = [c for c in commands if any(a.endswith("rms_norm.c") for a in c)]
    [own] = [c for c in commands if any(a.endswith("decoder_layers.c") for a in c)]
    assert "-DBASTION_PROBE=1" in rms and "-DBASTION_PROBE=1" not in own


_RACER = """
import sys, time
from pathlib import Path
from bastion.ops import cpu
ready, go = Path(sys.argv[1]), Path(sys.argv[2])
ready.touch()
while not go.exists():
    time.sleep(0.005)
print(cpu.load_cpu_kernel("rotary") is not None)
"""


@has_compiler
def test_processes_building_at_once_each_load_a_whole_library(tmp_path) -> None:
    """Two processes that find an empty cache build together (each in its own temporary
    folder, renamed into place); both load, one library stays, no temporary is left."""
    cache = tmp_path / "cache"
    env = {**os.environ, "BASTION_CACHE_DIR": str(cache), "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("BASTION_CPU_KERNELS", None)
    procs = [subprocess.Popen([sys.executable, "-c", _RACER, str(tmp_path / f"ready{i}"),
                               str(tmp_path / "go")], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        while not all((tmp_path / f"ready{i}").exists() for i in range(2)):
            assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
            time.sleep(0.01)
        (tmp_path / "go").touch()
        results = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], results
    assert [out.strip() for out, _ in results] == ["True", "True"], results
    assert [p.name[:7] for p in (cache / "cpu-kernels").iterdir()] == ["rotary-"]


# ------------------------------------------------------------------------- decode attention


@has_compiler
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [
    (9, 3, 64, 16),  # SmolLM2-135M: GQA 3, head size 64
    (4, 2, 16, 16),  # the tiny llama / qwen2 test models
    (4, 2, 32, 16),  # the tiny qwen3 test model
    (4, 4, 32, 8),  # MHA
    (8, 1, 16, 4),  # one KV head for eight query heads
    (6, 2, 80, 1),  # one-token blocks, a head size off the powers of two
])
def test_decode_matches_reference_over_scattered_and_shared_blocks(
        num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> None:
    """Lengths on and either side of a block boundary, a 1-token context, a long one; two
    sequences reading the same prefix blocks; tables padded with 0 past their blocks."""
    seq_lens = [2 * block_size + 3, 2 * block_size + 1, 1, block_size, block_size + 1, 397, 64]
    query, k_cache, v_cache, meta = _decode_step(seq_lens, num_heads, num_kv_heads, head_dim,
                                                 block_size)
    assert torch.equal(meta.block_tables[0, :2], meta.block_tables[1, :2])
    assert cpu_attention.can_run(query, k_cache, v_cache)
    scale = head_dim ** -0.5
    out = paged_attention(query, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(out, paged_attention_ref(query, k_cache, v_cache, meta, scale),
                               rtol=1e-5, atol=1e-6)


@has_compiler
def test_decode_never_reads_a_table_entry_past_its_last_block() -> None:
    """Padding entries that would point outside the cache (-1, a huge id) are not read."""
    seq_lens = [1, 17, 33, 5]
    for pad in (-1, 2**31 - 1):
        query, k_cache, v_cache, meta = _decode_step(seq_lens, 9, 3, 64, 16, pad_value=pad)
        out = paged_attention(query, k_cache, v_cache, meta, 0.125)
        meta.block_tables.clamp_(min=0, max=k_cache.shape[0] - 1)
        torch.testing.assert_close(out, paged_attention_ref(query, k_cache, v_cache, meta,
                                                            0.125), rtol=1e-5, atol=1e-6)


@has_compiler
def test_decode_is_the_same_on_one_thread_and_two() -> None:
    """Each OpenMP thread has its own scratch row; a task's sums do not depend on the thread
    count, so neither does the result, bit for bit."""
    query, k_cache, v_cache, meta = _decode_step([300, 7, 64, 129, 1, 40], 9, 3, 64, 16)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 5):
            torch.set_num_threads(n)
            outs.append(paged_attention(query, k_cache, v_cache, meta, 0.125))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@has_compiler
@pytest.mark.parametrize("corrupt,what", [
    (lambda m, n: m.block_tables.__setitem__((1, 0), n), "a block id past the cache"),
    (lambda m, n: m.block_tables.__setitem__((2, 1), -3), "a negative block id"),
    (lambda m, n: m.seq_lens.__setitem__(0, 10_000), "a length past the scratch and table"),
    (lambda m, n: m.seq_lens.__setitem__(3, 0), "an empty context"),
    (lambda m, n: m.query_start_loc.__setitem__(2, 99), "a query row past the step"),
])
def test_decode_refuses_a_step_that_points_outside_its_buffers(corrupt, what: str) -> None:
    query, k_cache, v_cache, meta = _decode_step([20, 33, 40, 5], 4, 2, 16, 16)
    corrupt(meta, k_cache.shape[0])
    with pytest.raises(ValueError, match="point outside the cache"):
        paged_attention(query, k_cache, v_cache, meta, 0.25)


@has_compiler
def test_mixed_step_takes_prefill_rows_from_the_reference_and_zeroes_padding() -> None:
    """Decodes between a prefill from scratch and a chunk over a cached prefix, then two padding
    rows that belong to no sequence."""
    block_size, num_heads, num_kv_heads, head_dim = 4, 6, 2, 8
    seq_lens, query_lens = [7, 9, 13, 20, 3], [1, 9, 5, 1, 1]
    tables = _scattered_tables(seq_lens, block_size, 40, shared=0)
    k_cache, v_cache = _cache(40, block_size, num_kv_heads, head_dim)
    meta = build_attention_metadata(query_lens, seq_lens, tables, block_size)
    assert meta.decode_seq_ids == [0, 3, 4] and meta.max_decode_seq_len == 20
    query = torch.randn(sum(query_lens) + 2, num_heads, head_dim)
    out = paged_attention(query, k_cache, v_cache, meta, 0.3)
    expected = paged_attention_ref(query, k_cache, v_cache, meta, 0.3)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(out[1:15], expected[1:15])  # the prefill rows: the same code
    assert not out[-2:].any()


def test_without_the_kernel_every_row_takes_the_reference(monkeypatch) -> None:
    query, k_cache, v_cache, meta = _decode_step([5, 11], 4, 2, 8, 4)
    monkeypatch.setattr(cpu_attention, "_kernel", lambda: None)
    calls = []
    reference = attention_ops.paged_attention_ref
    monkeypatch.setattr(attention_ops, "paged_attention_ref",
                        lambda *a: calls.append(1) or reference(*a))
    out = paged_attention(query, k_cache, v_cache, meta, 0.5)
    assert calls and torch.equal(out, reference(query, k_cache, v_cache, meta, 0.5))


def test_bfloat16_and_float16_take_the_reference() -> None:
    k_cache, v_cache = _cache(4, 4, 1, 8)
    for dtype in (torch.bfloat16, torch.float16):
        assert not cpu_attention.can_run(torch.randn(1, 2, 8, dtype=dtype), k_cache.to(dtype),
                                         v_cache.to(dtype))
        logits = torch.randn(2, 50).to(dtype)
        assert torch.equal(argmax_rows(logits), logits.argmax(-1))


# ------------------------------------------------------------------------- argmax


@has_compiler
def test_argmax_is_torchs_on_ties_nans_infinities_and_strided_rows(monkeypatch) -> None:
    calls = []
    kernel = cpu_argmax._kernel()
    assert kernel is not None
    monkeypatch.setattr(cpu_argmax, "_kernel", lambda: lambda *a: calls.append(1) or kernel(*a))
    logits = torch.randn(9, 49152, generator=torch.Generator().manual_seed(3))
    logits[1, [7, 4000]] = 1e9  # a tie: the first index
    logits[2, [300, 20]] = float("nan")  # NaN beats everything: the first NaN
    logits[3] = float("-inf")
    logits[4, :100] = float("-inf")  # masked tokens (a grammar) before the maximum
    logits[5, 64] = float("inf")
    logits[6, -1] = 1e9  # the last column, past the last full chunk of 64
    logits[7, 1:] = logits[7, 0]  # all equal
    for rows in (logits, logits[:, :1000], logits[::2], logits[:1, :1]):  # strided, 1 x 1
        assert torch.equal(argmax_rows(rows), rows.argmax(dim=-1))
    assert len(calls) == 4
    assert argmax_rows(logits[:, ::2]).tolist() == logits[:, ::2].argmax(dim=-1).tolist()
    assert argmax_rows(torch.empty(0, 5)).shape == (0,)
    assert len(calls) == 4  # column-strided and empty logits: torch's argmax


# ------------------------------------------------------------------------- rotary + store


def _rotary_inputs(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int,
                   rotary_dim: int):
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=g)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim,
                         num_kv_heads * head_dim], dim=-1)
    freqs = torch.outer(torch.arange(512.0), 1e4 ** -(torch.arange(0, rotary_dim, 2) / rotary_dim))
    return q, k, v, torch.cat([freqs.cos(), freqs.sin()], dim=-1)


@has_compiler
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,rotary_dim", [
    (9, 3, 64, 64),  # SmolLM2
    (9, 3, 64, 32),  # partial rotary
    (4, 2, 16, 16),  # the tiny test models
])
def test_rotary_and_store_are_the_references_bit_for_bit(
        num_heads: int, num_kv_heads: int, head_dim: int, rotary_dim: int) -> None:
    """Queries, keys and values as strided views of one fused QKV output; a padding token
    (slot -1) stores nothing."""
    q, k, v, cos_sin = _rotary_inputs(5, num_heads, num_kv_heads, head_dim, rotary_dim)
    positions = torch.tensor([0, 17, 300, 5, 0])
    slots = torch.tensor([3, 40, 41, 9, -1])
    caches = [torch.zeros(4, 16, num_kv_heads, head_dim) for _ in range(4)]
    fused = {"value": v, "slot_mapping": slots}
    assert cpu_rotary.can_run(q, k, True, fused)
    out = apply_rotary_emb(positions, q, k, cos_sin, head_dim, k_cache=caches[0],
                           v_cache=caches[1], **fused)
    ref = apply_rotary_emb_ref(positions, q, k, cos_sin, head_dim, k_cache=caches[2],
                               v_cache=caches[3], **fused)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert int(caches[0].view(-1, num_kv_heads * head_dim).any(-1).sum()) == 4
    without_store = apply_rotary_emb(positions, q, k, cos_sin, head_dim)
    assert torch.equal(without_store[0], ref[0]) and torch.equal(without_store[1], ref[1])


@has_compiler
@pytest.mark.parametrize("positions,slots", [([0, 512], [0, 1]), ([-1, 3], [0, 1]),
                                             ([0, 3], [0, 64])])
def test_rotary_refuses_a_position_or_slot_outside_its_tables(positions, slots) -> None:
    q, k, v, cos_sin = _rotary_inputs(2, 4, 2, 16, 16)
    k_cache, v_cache = torch.zeros(4, 16, 2, 16), torch.zeros(4, 16, 2, 16)
    with pytest.raises(ValueError, match="position outside|KV slot past"):
        apply_rotary_emb(torch.tensor(positions), q, k, cos_sin, 16, value=v, k_cache=k_cache,
                         v_cache=v_cache, slot_mapping=torch.tensor(slots))


def test_rotary_with_qk_norms_takes_the_reference() -> None:
    q, k = torch.randn(2, 16), torch.randn(2, 8)
    assert not cpu_rotary.can_run(q, k, True, {"q_weight": torch.ones(8)})
    assert not cpu_rotary.can_run(q, k, False, {})
    assert not cpu_rotary.can_run(q.bfloat16(), k.bfloat16(), True, {})


# ------------------------------------------------------------------------- RMSNorm, SiLU-and-mul


@has_compiler
@pytest.mark.parametrize("num_rows", [1, 3, 17])  # 17: the rows split over threads
def test_rms_norm_is_the_reference_up_to_an_ulp_alone_and_fused(num_rows: int) -> None:
    """SmolLM2's width, rows that are views of a wider tensor; the residual sum is exact."""
    g = torch.Generator().manual_seed(5)
    wide = torch.randn(num_rows, 2 * 576, generator=g) * 3
    x, residual = wide[:, :576], torch.randn(num_rows, 576, generator=g)
    weight = torch.rand(576, generator=g) + 0.5
    assert cpu_rms_norm.can_run(x, weight)
    out = rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(out, rms_norm_ref(x, weight, 1e-5), rtol=3e-7, atol=0)
    normed, summed = fused_add_rms_norm(x, residual, weight, 1e-5)
    ref_normed, ref_summed = fused_add_rms_norm_ref(x, residual, weight, 1e-5)
    assert torch.equal(summed, ref_summed)
    torch.testing.assert_close(normed, ref_normed, rtol=3e-7, atol=0)
    assert not cpu_rms_norm.can_run(x.bfloat16(), weight.bfloat16())
    assert rms_norm(x[:0], weight, 1e-5).shape == (0, 576)
    # Per-head norms (Qwen3's q/k norm) come as [T, H, D]; the fused form keeps the shape too.
    heads = wide.view(num_rows, 16, 72)
    torch.testing.assert_close(rms_norm(heads, weight[:72], 1e-5),
                               rms_norm_ref(heads, weight[:72], 1e-5), rtol=3e-7, atol=0)
    normed3, summed3 = fused_add_rms_norm(heads, heads * 0.5, weight[:72], 1e-5)
    ref3 = fused_add_rms_norm_ref(heads, heads * 0.5, weight[:72], 1e-5)
    assert summed3.shape == heads.shape and torch.equal(summed3, ref3[1])
    # NOTE: at 72 wide the scale's float rounding (the kernel's 1/sqrtf against torch's rsqrt)
    # shows as up to 3 ulps; the same before the launcher took 3-D rows without reshaping.
    torch.testing.assert_close(normed3, ref3[0], rtol=4e-7, atol=0)


@has_compiler
@pytest.mark.parametrize("num_rows", [1, 2, 17])
def test_silu_and_mul_is_the_reference_within_float32_rounding(num_rows: int) -> None:
    g = torch.Generator().manual_seed(6)
    x = torch.randn(num_rows, 2 * 1536, generator=g) * 4
    x[0, :4] = torch.tensor([0.0, -100.0, 100.0, -0.0])  # exp's ends: silu -> 0 and -> a
    assert cpu_activation.can_run(x)
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_ref(x), rtol=2e-6, atol=1e-7)
    strided = x[:, : 2 * 512]
    torch.testing.assert_close(silu_and_mul(strided), silu_and_mul_ref(strided), rtol=2e-6,
                               atol=1e-7)


# ------------------------------------------------------------------------- int4 x float32 rows


def _int4_weights(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes 0..15 and bfloat16 scales and zeros of both signs (Q4_1-like ranges)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g)
    scale = (torch.rand(n, k // 32, generator=g) * 0.02).to(torch.bfloat16)
    zero = ((torch.rand(n, k // 32, generator=g) - 0.5) * 0.1).to(torch.bfloat16)
    return codes, scale, zero


def _int4_term_magnitudes(codes: torch.Tensor, scale: torch.Tensor,
                          zero: torch.Tensor) -> torch.Tensor:
    """``|s| q + |z - 8 s|`` [N, K]: what each x_k is multiplied by in the kernel's two terms
    (the scale of their float32 rounding; ``|w|`` itself can be far smaller)."""
    s, z = (t.double().repeat_interleave(32, 1) for t in (scale, zero))
    return s.abs() * codes.double() + (z - 8 * s).abs()


def _decode_rows(rows: int, k: int, seed: int) -> torch.Tensor:
    """Rows with a spread of magnitudes, one all-zero group (d = 0), one group whose values are
    all but one tiny (the int8 digits' whole range) and one of 3e-37, as views of a wider
    tensor."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k + 7, generator=g)[:, 3 : 3 + k] * torch.logspace(-2, 1, k)
    x[:, 32:64] = 0
    x[:, 64:96] = 1e-4
    x[:, 64] = 30
    x[:, 96:128] = 3e-37  # 32512 / max |x| would overflow: quantized to 0, summed exactly
    return x


@has_compiler
@pytest.mark.parametrize("levels", [2, 1])
@pytest.mark.parametrize("k", [96, 576, 608, 1536])  # 3, 18, 19 and 48 groups: tiles of 16, 8, 16, 2
def test_int4_gemv_is_its_quantized_math_in_float64(k: int, levels: int) -> None:
    """Every row count the kernel takes (1-8), against ``q4_gemv_ref``: the same activation
    quantization (float32 steps, ties to even) and then exact sums. What is left is float32
    rounding of the kernel's sums: bounded by 2^-22 of the sum of its terms' magnitudes."""
    if not quant_gemv4.can_run(torch.ones(1, k)):
        pytest.skip("the C int4 kernel needs AVX-512 VNNI")
    n = 48
    codes, scale, zero = _int4_weights(n, k, seed=k)
    packed = quant_gemv4.pack_q4(codes, scale, zero)
    assert packed.shape == (n, 20 * k // 32)
    magnitudes = _int4_term_magnitudes(codes, scale, zero)
    for rows in range(1, quant_gemv4.MAX_ROWS + 1):
        x = _decode_rows(rows, k, seed=rows)
        got = quant_gemv4.q4_gemv(x, packed, k, levels).double()
        ref = quant_gemv4.q4_gemv_ref(x, codes, scale, zero, levels)
        bound = x.double().abs() @ magnitudes.t() * 2**-22
        assert ((got - ref).abs() <= bound).all(), (rows, (got - ref).abs().max())


@has_compiler
@pytest.mark.parametrize("levels", [2, 1])
def test_int4_gemv_is_the_dequantized_product_within_the_activations_rounding(
        levels: int) -> None:
    """Against ``x @ W^T`` in float64 with the dequantized weight: the zero term uses the
    exact sum of x, so the only error is ``s sum q (x - d xq)``, at most half a step d of each
    group's activations times ``|s| sum q``, plus float32 rounding."""
    k, n = 576, 64
    if not quant_gemv4.can_run(torch.ones(1, k)):
        pytest.skip("the C int4 kernel needs AVX-512 VNNI")
    codes, scale, zero = _int4_weights(n, k, seed=1)
    packed = quant_gemv4.pack_q4(codes, scale, zero)
    s, z = (t.double().repeat_interleave(32, 1) for t in (scale, zero))
    weight = (codes.double() - 8) * s + z
    x = _decode_rows(7, k, seed=2)
    got = quant_gemv4.q4_gemv(x, packed, k, levels).double()
    exact = x.double() @ weight.t()
    _, d = quant_gemv4.quantize_rows_ref(x, levels)
    step = d.double().repeat_interleave(32, 1)  # [M, K]
    bound = 0.5 * (1 + 1e-6) * step @ (s.abs() * codes.double()).t()
    bound += x.double().abs() @ _int4_term_magnitudes(codes, scale, zero).t() * 2**-20
    assert ((got - exact).abs() <= bound).all()
    # 16-bit activations are 256 times finer than int8 ones: the error shrinks with them.
    assert (got - exact).abs().max() < (2e-4 if levels == 2 else 3e-2) * exact.abs().max()


@has_compiler
def test_int4_gemv_refuses_what_it_does_not_take() -> None:
    if not quant_gemv4.can_run(torch.ones(1, 96)):
        pytest.skip("the C int4 kernel needs AVX-512 VNNI")
    codes, scale, zero = _int4_weights(48, 96, seed=0)
    packed = quant_gemv4.pack_q4(codes, scale, zero)
    for bad in (torch.ones(9, 96), torch.ones(1, 64), torch.ones(2, 192)[:, ::2],
                torch.ones(1, 96, dtype=torch.float64)):
        with pytest.raises(ValueError, match="int4 GEMV takes"):
            quant_gemv4.q4_gemv(bad, packed, 96)
    with pytest.raises(ValueError, match="levels must be 1"):
        quant_gemv4.q4_gemv(torch.ones(1, 96), packed, 96, levels=3)
    with pytest.raises(ValueError, match="N must be a multiple of 16"):
        quant_gemv4.pack_q4(codes[:40], scale[:40], zero[:40])  # 3 groups: tiles of 16 rows
    assert not quant_gemv4.can_run(torch.ones(8 + 1, 96))
    assert not quant_gemv4.can_run(torch.ones(1, 96, dtype=torch.bfloat16))


@has_compiler
def test_int4_gemv_is_the_same_on_one_thread_and_two() -> None:
    """The tiles split over threads; each output's sums are one thread's, in one order."""
    k = 576
    if not quant_gemv4.can_run(torch.ones(1, k)):
        pytest.skip("the C int4 kernel needs AVX-512 VNNI")
    packed = quant_gemv4.pack_q4(*_int4_weights(96, k, seed=3))
    x = _decode_rows(3, k, seed=4)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = quant_gemv4.q4_gemv(x, packed, k)
        torch.set_num_threads(2)
        two = quant_gemv4.q4_gemv(x, packed, k)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(one, two)
