"""The sampler: each parameter's effect on small hand-built logits, with exact expectations."""

from __future__ import annotations

import math

import pytest
import torch

from bastion.core.sampler import (
    LogprobsTensors,
    Sampler,
    SamplingMetadata,
    apply_logit_bias,
    apply_min_p,
    apply_min_tokens,
    apply_penalties,
    apply_top_k_top_p,
    make_generator,
)
from bastion.ipc.messages import SamplingParams

CPU = torch.device("cpu")
NEG_INF = float("-inf")
# The random path, seeds and logprobs also run on a GPU when there is one (same code, CUDA RNG).
DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])]


def build(params: list[SamplingParams], vocab_size: int, *,
          prompts: list[list[int]] | None = None, outputs: list[list[int]] | None = None,
          generators: list[torch.Generator | None] | None = None,
          eos: list[int | None] | None = None,
          device: torch.device | str = CPU) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(
        params,
        prompts if prompts is not None else [[] for _ in range(n)],
        outputs if outputs is not None else [[] for _ in range(n)],
        generators if generators is not None else [None] * n,
        eos if eos is not None else [None] * n,
        torch.device(device), vocab_size)


def sample(logits: torch.Tensor, params: list[SamplingParams], **kw) -> torch.Tensor:
    out = Sampler()(logits, build(params, logits.shape[1], device=logits.device, **kw))
    return out.sampled_token_ids.cpu()


def frequencies(tokens: torch.Tensor, vocab_size: int) -> list[float]:
    return (torch.bincount(tokens, minlength=vocab_size).float() / tokens.numel()).tolist()


def log_probs(*probs: float) -> list[float]:
    return [math.log(p) for p in probs]


# --- greedy and temperature ------------------------------------------------------------------


def test_greedy_is_argmax_and_skips_random_work() -> None:
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.9], [5.0, 4.9, 0.0, -2.0], [-3.0, -2.0, -1.0, -1.5]])
    # top_k / top_p / min_p on a greedy row must not matter.
    params = [SamplingParams(temperature=0.0, top_k=2, top_p=0.5, min_p=0.5)] * 3
    meta = build(params, 4)
    assert meta.all_greedy and meta.top_k is None and meta.top_p is None and meta.min_p is None
    before = logits.clone()
    out = Sampler()(logits, meta)
    assert out.sampled_token_ids.tolist() == [1, 0, 2]
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.logprobs is None
    assert torch.equal(logits, before)  # the caller's logits are never written


@pytest.mark.parametrize("device", DEVICES)
def test_temperature_reshapes_distribution_per_row(device: str) -> None:
    torch.manual_seed(0)
    n = 4000
    logits = torch.tensor([[0.0, 1.0, 2.0]], device=device).repeat(2 * n, 1)
    params = [SamplingParams(temperature=0.5)] * n + [SamplingParams(temperature=2.0)] * n
    tokens = sample(logits, params)
    cold = torch.softmax(torch.tensor([0.0, 2.0, 4.0]), dim=0).tolist()  # logits / 0.5
    hot = torch.softmax(torch.tensor([0.0, 0.5, 1.0]), dim=0).tolist()  # logits / 2
    assert frequencies(tokens[:n], 3) == pytest.approx(cold, abs=0.025)
    assert frequencies(tokens[n:], 3) == pytest.approx(hot, abs=0.025)


def test_mixed_greedy_and_random_rows() -> None:
    torch.manual_seed(1)
    logits = torch.tensor([[0.0, 1.0, 0.5]]).repeat(400, 1)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)] * 200
    tokens = sample(logits, params)
    assert tokens[0::2].tolist() == [1] * 200
    assert set(tokens[1::2].tolist()) == {0, 1, 2}


# --- top-k, top-p, min-p ---------------------------------------------------------------------


def test_top_k_one_equals_greedy() -> None:
    torch.manual_seed(2)
    logits = torch.randn(64, 100)
    tokens = sample(logits, [SamplingParams(temperature=1.0, top_k=1)] * 64)
    assert torch.equal(tokens, logits.argmax(dim=-1))


def test_top_k_mask_is_exact_per_row_even_with_ties() -> None:
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0, 0.0],
                           [1.0, 1.0, 1.0, 5.0, 1.0],  # ties at the cut: exactly k survive
                           [0.0, 1.0, 2.0, 3.0, 4.0]])
    masked = apply_top_k_top_p(logits, torch.tensor([2, 3, 0]), None)
    assert masked[0].tolist() == [NEG_INF, 4.0, 3.0, NEG_INF, NEG_INF]
    assert masked[1, 3].item() == 5.0 and torch.isfinite(masked[1]).sum().item() == 3
    assert masked[2].tolist() == logits[2].tolist()  # k = 0: off


@pytest.mark.parametrize("device", DEVICES)
def test_top_k_never_samples_outside_top_k(device: str) -> None:
    torch.manual_seed(3)
    n = 4000
    # Nearly flat logits, shuffled: without top-k every token would show up.
    base = torch.tensor([0.3, 0.0, 0.5, 0.1, 0.4, 0.2], device=device)
    logits = base.repeat(2 * n, 1)
    params = [SamplingParams(top_k=2)] * n + [SamplingParams(top_k=4)] * n
    tokens = sample(logits, params)
    assert set(tokens[:n].tolist()) == {2, 4}
    assert set(tokens[n:].tolist()) == {2, 4, 0, 5}
    renorm = torch.softmax(torch.tensor([0.5, 0.4]), dim=0).tolist()
    freqs = frequencies(tokens[:n], 6)
    assert [freqs[2], freqs[4]] == pytest.approx(renorm, abs=0.025)


def test_top_p_keeps_minimal_nucleus() -> None:
    probs = [0.5, 0.3, 0.15, 0.05]
    # Vocabulary order shuffled so that the scatter back from sorted order is exercised.
    perm = [2, 0, 3, 1]
    logits = torch.tensor([[log_probs(*probs)[j] for j in perm]] * 6)
    # p = 1e-9 rounds 1 - p to 1.0: the most likely token must survive anyway.
    top_p = torch.tensor([0.45, 0.7, 0.85, 0.99, 1.0, 1e-9])
    kept = torch.isfinite(apply_top_k_top_p(logits, None, top_p))
    kept_orig = [{perm[j] for j in range(4) if kept[i, j]} for i in range(6)]
    assert kept_orig == [{0}, {0, 1}, {0, 1, 2}, {0, 1, 2, 3}, {0, 1, 2, 3}, {0}]


def test_top_p_renormalises_after_top_k() -> None:
    logits = torch.tensor([log_probs(0.5, 0.3, 0.15, 0.05)] * 2)
    # Alone, p = 0.83 needs three tokens (0.5 + 0.3 < 0.83); after top-k=3 the survivors are
    # renormalised (0.526 + 0.316 >= 0.83), so two suffice.
    masked = apply_top_k_top_p(logits, torch.tensor([0, 3]), torch.tensor([0.83, 0.83]))
    assert torch.isfinite(masked).tolist() == [[True, True, True, False],
                                               [True, True, False, False]]


@pytest.mark.parametrize("device", DEVICES)
def test_top_p_sampling_stays_in_nucleus(device: str) -> None:
    torch.manual_seed(4)
    n = 4000
    logits = torch.tensor([log_probs(0.5, 0.3, 0.15, 0.05)] * n, device=device)
    tokens = sample(logits, [SamplingParams(top_p=0.7)] * n)
    assert set(tokens.tolist()) == {0, 1}
    assert frequencies(tokens, 4)[:2] == pytest.approx([0.625, 0.375], abs=0.025)


def test_min_p_removes_tokens_below_fraction_of_max() -> None:
    logits = torch.tensor([log_probs(0.5, 0.3, 0.12, 0.08)] * 3)
    masked = apply_min_p(logits, torch.tensor([0.2, 0.7, 0.0]))
    assert torch.isfinite(masked).tolist() == [[True, True, True, False],  # < 0.1 goes
                                               [True, False, False, False],  # < 0.35 goes
                                               [True, True, True, True]]  # 0 = off
    torch.manual_seed(5)
    tokens = sample(torch.tensor([log_probs(0.5, 0.3, 0.12, 0.08)] * 4000),
                    [SamplingParams(min_p=0.2)] * 4000)
    assert set(tokens.tolist()) == {0, 1, 2}


# --- penalties and min_tokens ----------------------------------------------------------------


def test_presence_penalty_applies_once_per_output_token() -> None:
    logits = torch.tensor([[2.0, 1.9, 0.5]] * 2)
    params = [SamplingParams(temperature=0.0, presence_penalty=0.5),
              SamplingParams(temperature=0.0)]
    meta = build(params, 3, prompts=[[1], [1]], outputs=[[0, 0], [0, 0]])
    # Token 0 lost 0.5 once despite appearing twice; prompt token 1 is untouched.
    assert apply_penalties(logits, meta)[0].tolist() == pytest.approx([1.5, 1.9, 0.5], abs=1e-6)
    assert Sampler()(logits, meta).sampled_token_ids.tolist() == [1, 0]


def test_frequency_penalty_scales_with_count() -> None:
    logits = torch.tensor([[3.0, 2.5, 2.0]] * 2)
    params = [SamplingParams(temperature=0.0, frequency_penalty=0.4),
              SamplingParams(temperature=0.0, frequency_penalty=0.6)]
    meta = build(params, 3, outputs=[[0, 0, 1], [0, 0, 1]])
    penalised = apply_penalties(logits, meta)
    assert penalised[0].tolist() == pytest.approx([2.2, 2.1, 2.0], abs=1e-6)
    assert penalised[1].tolist() == pytest.approx([1.8, 1.9, 2.0], abs=1e-6)
    assert Sampler()(logits, meta).sampled_token_ids.tolist() == [0, 2]


def test_repetition_penalty_divides_positive_multiplies_negative() -> None:
    logits = torch.tensor([[2.0, -1.0, 1.5, 1.2, -0.5]])
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.5)]
    meta = build(params, 5, prompts=[[0, 0]], outputs=[[1]])
    # Prompt token 0: 2.0 / 1.5; output token 1: -1.0 * 1.5; the rest untouched.
    assert apply_penalties(logits, meta)[0].tolist() == pytest.approx(
        [2.0 / 1.5, -1.5, 1.5, 1.2, -0.5], abs=1e-6)
    assert Sampler()(logits, meta).sampled_token_ids.tolist() == [2]
    plain = build([SamplingParams(temperature=0.0)], 5, prompts=[[0, 0]], outputs=[[1]])
    assert plain.no_penalties
    assert Sampler()(logits, plain).sampled_token_ids.tolist() == [0]


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    eos, stop = 3, 1
    logits = torch.tensor([[0.0, 4.0, 1.0, 5.0, 2.0]] * 4)
    params = [SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[stop]),
              SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[stop]),
              SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[stop],
                             ignore_eos=True),
              SamplingParams(temperature=0.0, stop_token_ids=[stop])]
    outputs = [[7], [7, 8], [7], []]
    meta = build(params, 5, outputs=outputs, eos=[eos] * 4)
    masked = apply_min_tokens(logits, meta)
    assert masked[0].tolist() == [0.0, NEG_INF, 1.0, NEG_INF, 2.0]  # 1 < 2 tokens: both masked
    assert masked[1].tolist() == logits[1].tolist()  # min_tokens reached
    assert masked[2].tolist() == [0.0, NEG_INF, 1.0, 5.0, 2.0]  # ignore_eos: only stop ids
    assert masked[3].tolist() == logits[3].tolist()  # min_tokens = 0
    assert Sampler()(logits, meta).sampled_token_ids.tolist() == [4, 3, 3, 3]


def test_logit_bias_adds_per_row_after_min_tokens_and_leaves_logprobs_raw() -> None:
    logits = torch.tensor([[0.0, 4.0, 1.0, 5.0, 2.0]] * 4)
    params = [SamplingParams(temperature=0.0, logit_bias={2: 100.0}),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, logit_bias={3: -100.0, 0: 0.5}, logprobs=1),
              # min_tokens masks EOS first; a positive bias cannot bring it back.
              SamplingParams(temperature=0.0, min_tokens=1, logit_bias={3: 100.0})]
    meta = build(params, 5, eos=[None, None, None, 3])
    assert meta.logit_bias is not None and meta.logit_bias[0].tolist() == [0, 2, 2, 3]
    biased = apply_logit_bias(logits, meta)
    assert biased[0].tolist() == [0.0, 4.0, 101.0, 5.0, 2.0]
    assert biased[1].tolist() == logits[1].tolist()
    assert biased[2].tolist() == [0.5, 4.0, 1.0, -95.0, 2.0]
    assert logits[0].tolist() == [0.0, 4.0, 1.0, 5.0, 2.0]  # not in place
    out = Sampler()(logits, meta)
    assert out.sampled_token_ids.tolist() == [2, 3, 1, 1]
    # vLLM's raw logprobs: the sampled token's logprob is from the unbiased logits.
    assert out.logprobs.logprobs[2, 0].item() == pytest.approx(logits[2].log_softmax(-1)[1].item())
    assert not meta.draws_plainly
    assert build([SamplingParams(temperature=0.0, logit_bias={7: 1.0})], 5).logit_bias is None


@pytest.mark.parametrize("bias", [{1: 100.5}, {1: float("nan")}, {-1: 1.0}])
def test_logit_bias_out_of_range_is_refused(bias: dict) -> None:
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=bias)


# --- seeds -----------------------------------------------------------------------------------


def _seeded_run(seed: int, row: int, companions: torch.Tensor, target: torch.Tensor,
                global_seed: int, device: str, steps: int = 6) -> list[int]:
    """Sample ``steps`` tokens for a seeded row placed at ``row`` among unseeded companions."""
    torch.manual_seed(global_seed)
    logits = torch.cat([companions[:row], target.unsqueeze(0), companions[row:]]).to(device)
    params = [SamplingParams(temperature=0.8)] * logits.shape[0]
    params[row] = SamplingParams(temperature=0.8, seed=seed)
    gens: list[torch.Generator | None] = [None] * logits.shape[0]
    gens[row] = make_generator(seed, device)
    if row > 0:  # a second seeded companion must not disturb the first
        gens[0] = make_generator(seed + 1, device)
    meta = build(params, logits.shape[1], generators=gens, device=device)
    return [Sampler()(logits, meta).sampled_token_ids[row].item() for _ in range(steps)]


@pytest.mark.parametrize("device", DEVICES)
def test_seed_reproducible_across_batch_position_and_companions(device: str) -> None:
    g = torch.Generator().manual_seed(6)
    vocab = 1000
    target = 0.3 * torch.randn(vocab, generator=g)
    first = _seeded_run(1234, 0, torch.randn(3, vocab, generator=g), target, 0, device)
    again = _seeded_run(1234, 4, torch.randn(7, vocab, generator=g), target, 99, device)
    alone = _seeded_run(1234, 0, torch.empty(0, vocab), target, 5, device)
    other = _seeded_run(4321, 0, torch.randn(3, vocab, generator=g), target, 0, device)
    assert first == again == alone
    assert len(set(first)) > 1  # the generator advances between steps
    assert other != first


# --- logprobs --------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_raw_log_softmax_with_ranks_and_sorted_top_k(device: str) -> None:
    logits = torch.tensor([[1.0, 3.0, 0.5, 2.0, -1.0, 0.0],
                           [0.2, 0.1, 4.0, 3.5, 1.0, 0.0],
                           [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]], device=device)
    eos = 2
    params = [SamplingParams(temperature=0.0, logprobs=3),
              # min_tokens forbids the favourite (EOS), so the second-best is sampled: rank 2.
              SamplingParams(temperature=0.0, logprobs=0, min_tokens=1),
              SamplingParams(temperature=1.0, top_k=1)]  # asked for none: still gets k columns
    meta = build(params, 6, eos=[eos] * 3, device=device)
    out = Sampler()(logits, meta)
    assert out.sampled_token_ids.tolist() == [1, 3, 5]
    assert out.logprobs is not None
    lp = LogprobsTensors(*(t.cpu() for t in out.logprobs))
    expected = torch.log_softmax(logits, dim=-1).cpu()  # raw: before min_tokens masked token 2
    assert lp.token_ids.shape == (3, 4) and lp.logprobs.shape == (3, 4)
    assert lp.token_ids.tolist() == [[1, 1, 3, 0], [3, 2, 3, 4], [5, 5, 4, 3]]
    assert torch.equal(lp.logprobs, expected.gather(1, lp.token_ids))
    assert lp.ranks.tolist() == [1, 2, 1]
    assert lp.token_ids.dtype == torch.int64 and lp.logprobs.dtype == torch.float32
