"""The fused CPU decode path (core/models/cpu_decode.py, ops/cpu/decoder_layers.c): one C call
through every decoder layer of an int4 Llama model and its final norm, against the op-by-op
path it replaces (each op through its own C kernel). The fused call links those kernels' own
objects, so the comparison is exact: hidden states, KV caches and greedy tokens bit for bit.
From DENSE_MIN_ROWS rows up the op-by-op path's linear layers take the dense bfloat16 GEMM and
the fused call keeps the int4 kernel: there each row is exact against op-by-op steps of fewer
rows.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from bastion.core.config import ModelConfig
from bastion.core.forward_context import build_attention_metadata, set_forward_context
from bastion.core.loader import load_model, resolve_model
from bastion.core.models.layers.quantization import (
    DENSE_MIN_ROWS,
    UNQUANTIZED,
    Int4WeightOnlyMethod,
)
from bastion.core.models.llama import LlamaForCausalLM
from bastion.ops.cpu import decoder_layers, quant_gemv4
from bastion.ops.cpu.decoder_layers import DecoderStack
from tests.conftest import tiny_config
from tests.test_model_parity import PagedDriver

BLOCK_SIZE = 4

requires_vnni = pytest.mark.skipif(
    not quant_gemv4.is_available(),
    reason="the fused decode call links the int4 kernel: needs a C compiler and AVX-512 VNNI")


@pytest.fixture(autouse=True)
def _kernels_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BASTION_CPU_KERNELS", raising=False)
    monkeypatch.delenv("BASTION_CPU_FUSED_DECODE", raising=False)


@pytest.fixture
def fused_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The row count of every fused call that runs."""
    calls: list[int] = []
    run = DecoderStack.run
    monkeypatch.setattr(DecoderStack, "run",
                        lambda self, hidden, *a: calls.append(hidden.shape[0]) or run(
                            self, hidden, *a))
    return calls


def _int4(linear: nn.Module, gen: torch.Generator) -> None:
    """Random int4 weights (codes, bfloat16 scales and zeros) in place of the dense one."""
    n, k = linear.weight.shape
    codes = torch.randint(0, 16, (n, k), generator=gen)
    scale = torch.rand(n, k // 32, generator=gen) * 0.02 + 0.005
    zero = (torch.rand(n, k // 32, generator=gen) - 0.5) * 0.02
    linear.quant_method = Int4WeightOnlyMethod(codes, scale, zero)
    linear.weight = None


def _tiny_int4_model(**overrides: object) -> LlamaForCausalLM:
    """Three Llama layers of hidden 128 (4 query heads of 32, 2 KV heads), MLP 256, every
    linear layer int4, random norm weights and embeddings."""
    config = tiny_config("llama", hidden_size=128, head_dim=32, intermediate_size=256,
                         num_hidden_layers=3,
                         **overrides)
    model = LlamaForCausalLM(config, torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    for name, module in model.named_modules():
        if name.endswith("_proj"):
            _int4(module, gen)
        if name.endswith("norm"):
            module.weight.data = 1 + 0.2 * torch.randn(module.weight.shape, generator=gen)
    model.model.embed_tokens.weight.data = torch.randn(model.model.embed_tokens.weight.shape,
                                                       generator=gen)
    return model


def _step(model: nn.Module, caches: list[tuple[torch.Tensor, torch.Tensor]], seq_lens: list[int],
          tables: list[list[int]], fused: bool, monkeypatch: pytest.MonkeyPatch,
          max_rows: int | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One decode step (one new token per sequence, at position seq_len - 1) over copies of
    ``caches``, or with ``max_rows`` as many steps of that many sequences at most, one after
    the other: the output hidden [M, H] and every cache after it."""
    monkeypatch.setenv("BASTION_CPU_FUSED_DECODE", "1" if fused else "0")
    for attn, (k, v) in zip(model.attention_layers(), caches):
        attn.k_cache, attn.v_cache = k.clone(), v.clone()
    ids = torch.tensor([(7 + 31 * i) % 320 for i in range(len(seq_lens))])
    rows = []
    for lo in range(0, len(seq_lens), max_rows or len(seq_lens)):
        part = slice(lo, lo + (max_rows or len(seq_lens)))
        meta = build_attention_metadata([1] * len(seq_lens[part]), seq_lens[part], tables[part],
                                        BLOCK_SIZE)
        with torch.no_grad(), set_forward_context(meta):
            rows.append(model(ids[part], torch.tensor(seq_lens[part]) - 1))
    return torch.cat(rows), [c for a in model.attention_layers() for c in (a.k_cache, a.v_cache)]


def _random_caches(model: nn.Module, num_blocks: int, gen: torch.Generator
                   ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, BLOCK_SIZE, 2, 32)
    return [(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
            for _ in model.attention_layers()]


@requires_vnni
@pytest.mark.parametrize("seq_lens", [
    [1],  # the first token
    [13],  # four blocks, the last one part-filled
    [9, 1, 4, 17, 5],  # five sequences, lengths on and off block boundaries
    [16] * (DENSE_MIN_ROWS - 1),  # the most rows the fused call takes
])
def test_a_fused_step_is_the_op_by_op_step_bit_for_bit(seq_lens: list[int], fused_calls,
                                                       monkeypatch) -> None:
    model = _tiny_int4_model()
    num_blocks = 48
    gen = torch.Generator().manual_seed(1)
    caches = _random_caches(model, num_blocks, gen)
    free = torch.randperm(num_blocks, generator=gen).tolist()  # scattered blocks
    tables = [[free.pop() for _ in range(-(-n // BLOCK_SIZE))] for n in seq_lens]
    want, want_caches = _step(model, caches, seq_lens, tables, False, monkeypatch)
    assert fused_calls == []
    got, got_caches = _step(model, caches, seq_lens, tables, True, monkeypatch)
    assert fused_calls == [len(seq_lens)]
    assert torch.equal(got, want)
    assert all(torch.equal(g, w) for g, w in zip(got_caches, want_caches))
    # The step did store its keys and values (each cache moved at the new tokens' slots).
    assert all(not torch.equal(g, c) for g, c in zip(got_caches, (c for p in caches for c in p)))


@requires_vnni
@pytest.mark.parametrize("num_rows", [DENSE_MIN_ROWS, 12, decoder_layers.MAX_ROWS])
def test_a_fused_step_past_the_dense_threshold_is_op_by_op_steps_of_fewer_rows(
        num_rows: int, fused_calls, monkeypatch) -> None:
    """Each row of a fused step of 8-16 rows (the int4 kernel in chunks of 8) is the row the
    op-by-op path gives in steps of at most DENSE_MIN_ROWS - 1 sequences (the int4 kernel)."""
    model = _tiny_int4_model()
    gen = torch.Generator().manual_seed(2)
    caches = _random_caches(model, 80, gen)
    free = torch.randperm(80, generator=gen).tolist()
    seq_lens = [1 + (5 * i) % 19 for i in range(num_rows)]
    tables = [[free.pop() for _ in range(-(-n // BLOCK_SIZE))] for n in seq_lens]
    want, want_caches = _step(model, caches, seq_lens, tables, False, monkeypatch,
                              max_rows=DENSE_MIN_ROWS - 1)
    assert fused_calls == []
    got, got_caches = _step(model, caches, seq_lens, tables, True, monkeypatch)
    assert fused_calls == [num_rows]
    assert torch.equal(got, want)
    assert all(torch.equal(g, w) for g, w in zip(got_caches, want_caches))


@requires_vnni
def test_steps_it_does_not_take_run_op_by_op(fused_calls, monkeypatch) -> None:
    model = _tiny_int4_model()
    driver = PagedDriver(model, num_blocks=64, block_size=BLOCK_SIZE)
    many = decoder_layers.MAX_ROWS + 1
    tables = [[driver.free_blocks.pop() for _ in range(2)] for _ in range(many)]
    ids = torch.arange(many)

    def forward(query_lens: list[int], seq_lens: list[int], num_seqs: int) -> None:
        meta = build_attention_metadata(query_lens, seq_lens, tables[:num_seqs], BLOCK_SIZE)
        with torch.no_grad(), set_forward_context(meta):
            model(ids[:sum(query_lens)], torch.tensor(
                [p for q, n in zip(query_lens, seq_lens) for p in range(n - q, n)]))

    forward([1] * many, [5] * many, many)  # more rows than it takes
    forward([3], [3], 1)  # a prefill
    forward([1, 2], [4, 6], 2)  # a mixed step
    monkeypatch.setenv("BASTION_CPU_KERNELS", "0")  # the torch references everywhere
    forward([1], [5], 1)
    monkeypatch.setenv("BASTION_CPU_KERNELS", "1")
    monkeypatch.setenv("BASTION_CPU_FUSED_DECODE", "0")
    forward([1], [5], 1)
    assert fused_calls == []
    monkeypatch.setenv("BASTION_CPU_FUSED_DECODE", "1")
    forward([1], [5], 1)
    assert fused_calls == [1]
    # Without a forward context (no caches to attend over) it never runs either.
    with torch.no_grad():
        model(ids[:1], torch.zeros(1, dtype=torch.long))
    assert fused_calls == [1]


@requires_vnni
@pytest.mark.parametrize("change", [None, "no caches", "qkv bias", "qk norm", "lora",
                                    "dense weight", "int8 levels in one layer"])
def test_models_it_does_not_compute_exactly_keep_their_own_path(change: str | None) -> None:
    model = _tiny_int4_model()
    layer = model.model.layers[1]
    if change != "no caches":
        PagedDriver(model, num_blocks=8, block_size=BLOCK_SIZE)
    if change == "qkv bias":
        layer.self_attn.qkv_proj.bias = nn.Parameter(torch.zeros(256), requires_grad=False)
    elif change == "qk norm":  # Qwen3
        layer.self_attn.q_norm = nn.Identity()
    elif change == "lora":
        layer.mlp.down_proj.lora = object()
    elif change == "dense weight":
        layer.mlp.down_proj.quant_method = UNQUANTIZED
    elif change == "int8 levels in one layer":
        layer.mlp.down_proj.quant_method.q4_levels = 1
    meta = build_attention_metadata([1], [1], [[1]], BLOCK_SIZE)
    stack = model.model.fused_decode.stack_for(torch.zeros(1, 128), meta)
    assert (stack is not None) == (change is None)


@requires_vnni
def test_a_step_pointing_outside_its_tables_is_refused(monkeypatch) -> None:
    model = _tiny_int4_model()
    PagedDriver(model, num_blocks=8, block_size=BLOCK_SIZE)
    meta = build_attention_metadata([1], [5], [[1, 2]], BLOCK_SIZE)
    with torch.no_grad(), set_forward_context(meta):
        with pytest.raises(ValueError, match="point outside the tables"):
            model(torch.tensor([3]), torch.tensor([10_000]))  # past the rotary table
        meta.block_tables[0, 1] = 99  # past the cache's 8 blocks
        with pytest.raises(ValueError, match="point outside the tables"):
            model(torch.tensor([3]), torch.tensor([4]))


@pytest.fixture(scope="module")
def embedded_int4() -> nn.Module:
    config = ModelConfig(model=None, device="cpu", dtype="float32", quantization="gguf")
    return load_model(config, resolve_model(config))


@requires_vnni
def test_the_embedded_model_decodes_the_same_tokens_fused(embedded_int4, fused_calls,
                                                          monkeypatch) -> None:
    """32 greedy tokens of three prompts (decode steps of 3, then 2, then 1 rows as the
    staggered sequences finish), fused against op by op: the same tokens."""
    prompts = [[1000 + 37 * i for i in range(n)] for n in (40, 23, 9)]
    monkeypatch.setenv("BASTION_CPU_FUSED_DECODE", "0")
    want = PagedDriver(embedded_int4, num_blocks=64, block_size=16).generate(
        prompts, 32, chunk=64, stagger=3)
    assert fused_calls == []
    monkeypatch.setenv("BASTION_CPU_FUSED_DECODE", "1")
    got = PagedDriver(embedded_int4, num_blocks=64, block_size=16).generate(
        prompts, 32, chunk=64, stagger=3)
    assert got == want
    assert {1, 2, 3} <= set(fused_calls) and len(fused_calls) >= 31
