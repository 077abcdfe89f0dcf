"""The sampler: logits of one step -> one token per row (plus logprobs when asked).

Order of operations (vLLM V1's, with its default "raw" logprobs mode):

1. logprobs = log_softmax of the *unmodified* logits, when any row asked for them;
2. min_tokens: EOS (unless ``ignore_eos``) and ``stop_token_ids`` get -inf while a request has
   produced fewer than ``min_tokens`` tokens; then ``logit_bias`` is added (one scatter-add for
   every biased entry of the batch);
3. repetition penalty over prompt + output tokens, then frequency and presence penalties over the
   output tokens;
4. greedy rows (temperature 0) take the argmax of the penalised logits;
5. other rows: temperature, min_p, top-k, top-p, then the exponential race
   ``argmax(probs / Exp(1))``, which is an exact draw from ``probs`` without a CDF search.

On a GPU, a batch with no processor before the draw (steps 2-3 and min_p, top-k, top-p unused,
no logprobs) and no seeded row takes one fused Triton pass instead (``ops/triton/sample.py``):
the same race in log space with Philox noise, reading the logits once in their own dtype.

NOTE: a seeded row draws its noise from its own ``torch.Generator`` (one per request, kept by the
caller across steps), so its tokens depend only on its own logits and seed, never on its
position in the batch or on its companions. Unseeded rows share the global RNG.

The sampler never changes the caller's ``logits`` tensor in place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from bastion.ipc.messages import SamplingParams
from bastion.ops._dispatch import triton_launcher, use_triton
from bastion.ops.cpu.argmax import argmax_rows

if TYPE_CHECKING:
    from bastion.core.structured_output.bitmask import DeviceMask

# Tokens that must never be picked get this value; -inf keeps softmax exact (probability 0).
_MASKED = float("-inf")


class LogprobsTensors(NamedTuple):
    """Per row: the sampled token first, then the ``k`` most likely tokens (k = max asked).

    Rows that asked for fewer than ``k`` (or none) carry ``k`` columns anyway; the caller slices.
    """

    token_ids: torch.Tensor  # int64 [N, 1 + k]
    logprobs: torch.Tensor  # float32 [N, 1 + k]
    ranks: torch.Tensor  # int64 [N]: rank of the sampled token (1 = most likely)


class SamplerOutput(NamedTuple):
    sampled_token_ids: torch.Tensor  # int64 [N]
    logprobs: LogprobsTensors | None  # when any request asked for logprobs


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """The per-request generator a seeded request keeps for its whole life (create it once)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


@dataclass
class SamplingMetadata:
    """Per-row sampling state for one step, already on the logits' device.

    Optional tensors are ``None`` when no row needs that step, so common batches skip the work.
    """

    temperature: torch.Tensor  # float32 [N]; greedy rows hold 1.0 (their random draw is unused)
    is_greedy: torch.Tensor  # bool [N]
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None  # int64 [N], 0 = off
    top_p: torch.Tensor | None  # float32 [N], 1.0 = off
    min_p: torch.Tensor | None  # float32 [N], 0.0 = off
    generators: dict[int, torch.Generator]  # row -> generator, for seeded non-greedy rows
    vocab_size: int
    # Penalties: token id lists are padded with ``vocab_size`` (a column dropped after scatter).
    prompt_token_ids: torch.Tensor | None = None  # int64 [N, Lp]; only with repetition penalty
    output_token_ids: torch.Tensor | None = None  # int64 [N, Lo]
    repetition_penalties: torch.Tensor | None = None  # float32 [N]
    frequency_penalties: torch.Tensor | None = None  # float32 [N]
    presence_penalties: torch.Tensor | None = None  # float32 [N]
    min_tokens_mask: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, token ids) -> -inf
    max_num_logprobs: int | None = None
    # (rows, token ids, biases), flattened over every row that has a logit_bias.
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def no_penalties(self) -> bool:
        return self.repetition_penalties is None and self.frequency_penalties is None

    @property
    def draws_plainly(self) -> bool:
        """No row changes its logits before the draw or asks for logprobs: each row is an
        argmax (greedy) or a draw from ``softmax(logits / T)``."""
        return (self.no_penalties and self.presence_penalties is None
                and self.min_tokens_mask is None and self.max_num_logprobs is None
                and self.logit_bias is None
                and self.top_k is None and self.top_p is None and self.min_p is None)

    @classmethod
    def build(cls, params: list[SamplingParams], prompt_token_ids: list[list[int]],
              output_token_ids: list[list[int]], generators: list[torch.Generator | None],
              eos_token_ids: list[int | None], device: torch.device,
              vocab_size: int) -> SamplingMetadata:
        """Gather one step's rows. All lists are aligned with the logits' rows.

        ``generators[i]`` is the request's own generator (see ``make_generator``) or ``None`` for
        an unseeded request; it must live on ``device`` and persist across steps.
        """
        num_rows = len(params)
        if not (len(prompt_token_ids) == len(output_token_ids) == len(generators)
                == len(eos_token_ids) == num_rows):
            raise ValueError("SamplingMetadata.build: all per-row lists must have the same length")
        device = torch.device(device)
        greedy = [p.is_greedy for p in params]
        # Greedy rows ignore every random-path parameter; neutral values let them skip work.
        temps = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
        top_ks = [0 if g or p.top_k <= 0 or p.top_k >= vocab_size else p.top_k
                  for p, g in zip(params, greedy)]
        top_ps = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
        min_ps = [0.0 if g else p.min_p for p, g in zip(params, greedy)]
        asked = [p.logprobs for p in params if p.logprobs is not None]
        meta = cls(
            temperature=_to_device(temps, torch.float32, device),
            is_greedy=_to_device(greedy, torch.bool, device),
            all_greedy=all(greedy),
            all_random=bool(greedy) and not any(greedy),  # an empty batch is all greedy
            top_k=_to_device(top_ks, torch.int64, device) if any(top_ks) else None,
            top_p=_to_device(top_ps, torch.float32, device) if any(p < 1.0 for p in top_ps)
            else None,
            min_p=_to_device(min_ps, torch.float32, device) if any(min_ps) else None,
            generators={i: gen for i, gen in enumerate(generators)
                        if gen is not None and not greedy[i]},
            vocab_size=vocab_size,
            min_tokens_mask=_build_min_tokens_mask(params, output_token_ids, eos_token_ids,
                                                   device, vocab_size),
            max_num_logprobs=max(asked) if asked else None,
            logit_bias=_build_logit_bias(params, device, vocab_size),
        )
        _add_penalties(meta, params, prompt_token_ids, output_token_ids, device)
        return meta


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # Pinned host memory lets the copy overlap with the model's forward on a GPU.
    pin = device.type == "cuda"
    return torch.tensor(values, dtype=dtype, pin_memory=pin).to(device, non_blocking=pin)


def _pad(rows: list[list[int]], pad_id: int, device: torch.device) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    pin = device.type == "cuda"
    padded = torch.full((len(rows), width), pad_id, dtype=torch.int64, pin_memory=pin)
    # Row-wise numpy assignment is ~4x faster than torch.tensor() on a padded list of lists.
    view = padded.numpy()
    for i, row in enumerate(rows):
        view[i, :len(row)] = row
    return padded.to(device, non_blocking=pin)


def _build_min_tokens_mask(params: list[SamplingParams], output_token_ids: list[list[int]],
                           eos_token_ids: list[int | None], device: torch.device,
                           vocab_size: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    rows: list[int] = []
    cols: list[int] = []
    for i, (p, out, eos) in enumerate(zip(params, output_token_ids, eos_token_ids)):
        if len(out) >= p.min_tokens:
            continue
        banned = set(p.stop_token_ids)
        if eos is not None and not p.ignore_eos:
            banned.add(eos)
        for tok in sorted(banned):
            if tok < vocab_size:
                rows.append(i)
                cols.append(tok)
    if not rows:
        return None
    return _to_device(rows, torch.int64, device), _to_device(cols, torch.int64, device)


def _build_logit_bias(params: list[SamplingParams], device: torch.device, vocab_size: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    rows: list[int] = []
    cols: list[int] = []
    biases: list[float] = []
    for i, p in enumerate(params):
        for tok, bias in (p.logit_bias or {}).items():
            if tok < vocab_size:  # the API checked ids against the tokenizer's vocabulary
                rows.append(i)
                cols.append(tok)
                biases.append(bias)
    if not rows:
        return None
    return (_to_device(rows, torch.int64, device), _to_device(cols, torch.int64, device),
            _to_device(biases, torch.float32, device))


def _add_penalties(meta: SamplingMetadata, params: list[SamplingParams],
                   prompt_token_ids: list[list[int]], output_token_ids: list[list[int]],
                   device: torch.device) -> None:
    reps = [p.repetition_penalty for p in params]
    freqs = [p.frequency_penalty for p in params]
    pres = [p.presence_penalty for p in params]
    has_rep = any(r != 1.0 for r in reps)
    has_freq_pres = any(freqs) or any(pres)
    if not (has_rep or has_freq_pres):
        return
    meta.output_token_ids = _pad(output_token_ids, meta.vocab_size, device)
    if has_rep:
        meta.prompt_token_ids = _pad(prompt_token_ids, meta.vocab_size, device)
        meta.repetition_penalties = _to_device(reps, torch.float32, device)
    if has_freq_pres:
        meta.frequency_penalties = _to_device(freqs, torch.float32, device)
        meta.presence_penalties = _to_device(pres, torch.float32, device)


# ---------------------------------------------------------------------------------------------
# logits processors (each returns a new tensor; none writes into its input)
# ---------------------------------------------------------------------------------------------


def apply_min_tokens(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    if meta.min_tokens_mask is None:
        return logits
    rows, cols = meta.min_tokens_mask
    return logits.index_put((rows, cols), torch.tensor(_MASKED, device=logits.device))


def apply_logit_bias(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    if meta.logit_bias is None:
        return logits
    rows, cols, biases = meta.logit_bias
    # NOTE: (row, id) pairs are unique (one dict per row), so accumulate only adds to the logit.
    return logits.index_put((rows, cols), biases, accumulate=True)


def _token_counts(token_ids: torch.Tensor, num_rows: int, vocab_size: int) -> torch.Tensor:
    """int32 [N, V] occurrence counts; the padding id ``vocab_size`` lands in a dropped column."""
    counts = torch.zeros(num_rows, vocab_size + 1, dtype=torch.int32, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=torch.int32))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Repetition (HF/vLLM: positive logits divided, negative multiplied, over prompt + output),
    then frequency (times the count) and presence (once) over the output tokens (OpenAI)."""
    if meta.no_penalties:
        return logits
    num_rows, vocab_size = logits.shape
    assert meta.output_token_ids is not None
    output_counts = _token_counts(meta.output_token_ids, num_rows, vocab_size)
    output_mask = output_counts > 0
    if meta.repetition_penalties is not None:
        assert meta.prompt_token_ids is not None
        seen = output_mask | (_token_counts(meta.prompt_token_ids, num_rows, vocab_size) > 0)
        penalty = torch.where(seen, meta.repetition_penalties.unsqueeze(1), 1.0)
        logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    if meta.frequency_penalties is not None:
        assert meta.presence_penalties is not None
        logits = (logits - meta.frequency_penalties.unsqueeze(1) * output_counts
                  - meta.presence_penalties.unsqueeze(1) * output_mask)
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the row's top probability.

    Done on logits: p_i / p_max = exp(l_i - l_max), so no softmax is needed; min_p = 0 gives a
    threshold of -inf and keeps everything.
    """
    max_logits = logits.amax(dim=-1, keepdim=True)
    threshold = max_logits + torch.log(min_p).unsqueeze(1)
    return logits.masked_fill(logits < threshold, _MASKED)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask all but each row's top ``k`` tokens, then all but the minimal nucleus of mass >= p.

    ``top_k`` int [N] (0 = off), ``top_p`` float [N] (1.0 = off); either may be ``None``. One
    ascending sort serves both. Top-k is by position in the sort, so exactly k tokens survive even
    with ties; top-p renormalises over the top-k survivors (vLLM's semantics) and always keeps
    the most likely token.
    """
    if top_k is None and top_p is None:
        return logits
    vocab_size = logits.shape[1]
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        k = torch.where(top_k <= 0, vocab_size, top_k.clamp(max=vocab_size))
        position = torch.arange(vocab_size, device=logits.device).unsqueeze(0)
        sorted_logits = sorted_logits.masked_fill(position < (vocab_size - k).unsqueeze(1),
                                                  _MASKED)
    if top_p is not None:
        cum_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Ascending: a token goes when everything up to and including it is <= 1 - p of the mass,
        # i.e. the kept tokens above it still hold >= p.
        drop = cum_probs <= (1.0 - top_p).unsqueeze(1)
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, _MASKED)
    return torch.empty_like(logits).scatter_(1, sorted_ids, sorted_logits)


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One draw per row from ``probs`` by the exponential race: argmax(probs / Exp(1) noise)."""
    # Exp(1) = -log(1 - U): uniform draws then one log are 5x faster on a CPU than
    # ``exponential_`` (16 x 49k: 4 ms against 20 ms), the same on a GPU.
    noise = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        noise.uniform_()
    # NOTE: the only per-row Python loop: a seeded row's noise must come from its own generator.
    for row, gen in generators.items():
        noise[row].uniform_(generator=gen)
    noise = noise.neg_().log1p_().neg_()
    # Exp(1) can round to 0; a floor keeps 0/0 (a masked token) from becoming NaN.
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return probs.div(noise).argmax(dim=-1)


def compute_logprobs(logprobs: torch.Tensor, sampled: torch.Tensor,
                     num_logprobs: int) -> LogprobsTensors:
    """The sampled token's logprob and rank, then the top ``num_logprobs`` in descending order."""
    sampled = sampled.unsqueeze(1)
    sampled_logprobs = logprobs.gather(1, sampled)
    ranks = (logprobs > sampled_logprobs).sum(dim=-1) + 1
    top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)
    return LogprobsTensors(token_ids=torch.cat([sampled, top_ids], dim=1),
                           logprobs=torch.cat([sampled_logprobs, top_logprobs], dim=1),
                           ranks=ranks)


def _fused_sampler() -> Callable[..., torch.Tensor] | None:
    return triton_launcher("sample", "sample_tokens_triton")


def greedy_tokens(logits: torch.Tensor, mask: DeviceMask | None = None) -> torch.Tensor:
    """``argmax`` of each row (the first index on ties), among the tokens its grammar allows
    where ``mask`` has a bitmask for it; on a GPU one read of the logits in their own dtype
    (35 against 54 us for torch's argmax at 256 x 152k bf16 on an H200; 5.6 against 12 us at
    14 rows), the bitmask read in the same pass; on the CPU a C kernel (0.15 against 1.4 ms for
    torch's argmax at 16 x 49k float32 on one core)."""
    fused = _fused_sampler() if use_triton(logits) else None
    if fused is None:
        if mask is not None:
            mask.apply(logits)
        return argmax_rows(logits)
    temperature, seeds = _greedy_args(logits.shape[0], logits.device)
    return fused(logits, temperature, seeds, **_mask_args(mask))


# Per device: zero temperatures (float32) and seeds (int64) for the fused kernel's greedy
# rows, grown as needed and never written (two allocations fewer a step).
_GREEDY_ARGS: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def warm_greedy_args(num_rows: int, device: torch.device) -> None:
    """Allocate the greedy rows' arguments for ``num_rows`` rows now (before a graph capture,
    so that they do not live in its pool)."""
    _greedy_args(num_rows, device)


def _greedy_args(num_rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    args = _GREEDY_ARGS.get(device)
    if args is None or args[0].shape[0] < num_rows:
        size = max(num_rows, 256)
        args = _GREEDY_ARGS[device] = (torch.zeros(size, dtype=torch.float32, device=device),
                                       torch.zeros(size, dtype=torch.int64, device=device))
    return args[0][:num_rows], args[1][:num_rows]


def plain_tokens(logits: torch.Tensor, temperature: torch.Tensor,
                 mask: DeviceMask | None = None) -> torch.Tensor:
    """One token per row on a GPU, in one read of the logits: the argmax where ``temperature``
    (float32 [N]) is 0, else a draw from ``softmax(logits / T)`` with Philox noise from seeds
    drawn from the global RNG, among the tokens ``mask`` allows (the Sampler's fused path)."""
    fused = _fused_sampler()
    if fused is None:
        raise RuntimeError("plain_tokens needs the fused sampling kernel (Triton on a GPU)")
    return fused(logits, temperature, _row_seeds(logits.shape[0], logits.device),
                 **_mask_args(mask))


def _mask_args(mask: DeviceMask | None) -> dict[str, torch.Tensor]:
    return {} if mask is None else {"mask": mask.bitmask, "mask_rows": mask.mask_rows}


def _row_seeds(num_rows: int, device: torch.device) -> torch.Tensor:
    """One Philox seed per row for this step, from the global RNG."""
    return torch.randint(0, 1 << 62, (num_rows,), dtype=torch.int64, device=device)


class Sampler:
    """Turns float32 logits [N, V] into one token per row; see the module docstring for order."""

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata,
                 mask: DeviceMask | None = None) -> SamplerOutput:
        """``mask``: the grammar rows' bitmasks, read by the fused kernel or applied to the
        logits before anything else reads them."""
        if logits.dim() != 2 or logits.shape[1] != meta.vocab_size:
            raise ValueError(f"Sampler expects logits [N, {meta.vocab_size}], got "
                             f"{tuple(logits.shape)} (slice off lm_head padding first)")
        # NOTE: not with seeded rows: their noise must come from one path whatever the batch
        # around them (the fused kernel's Philox noise differs from the generator's draws).
        plain = meta.draws_plainly and not meta.generators
        fused = _fused_sampler() if plain and use_triton(logits) else None
        if fused is not None:
            # One read of the logits on the GPU; the same distribution as ``sample`` below
            # (the noise comes from Philox instead of torch's generator).
            temperature = meta.temperature.masked_fill(meta.is_greedy, 0.0)
            return SamplerOutput(plain_tokens(logits, temperature, mask), None)
        if mask is not None:
            mask.apply(logits)
        logits = logits.float()
        raw_logprobs = (logits.log_softmax(dim=-1) if meta.max_num_logprobs is not None
                        else None)
        logits = apply_logit_bias(apply_min_tokens(logits, meta), meta)
        logits = apply_penalties(logits, meta)
        sampled = self.sample(logits, meta)
        lp = None
        if raw_logprobs is not None:
            assert meta.max_num_logprobs is not None
            lp = compute_logprobs(raw_logprobs, sampled, meta.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=lp)

    @staticmethod
    def sample(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Greedy rows take the argmax; the rest go through the random path."""
        greedy = None if meta.all_random else logits.argmax(dim=-1)
        if meta.all_greedy:
            assert greedy is not None
            return greedy
        logits = logits / meta.temperature.unsqueeze(1)
        if meta.min_p is not None:
            logits = apply_min_p(logits, meta.min_p)
        logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
        sampled = random_sample(logits.softmax(dim=-1), meta.generators)
        if greedy is None:
            return sampled
        return torch.where(meta.is_greedy, greedy, sampled)
