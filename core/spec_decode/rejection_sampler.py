"""Verification of draft tokens against one target forward over every drafted position.

A request with ``d`` drafts brings ``d + 1`` logits rows: row ``j`` is the target's prediction
after the last known token and drafts ``0..j-1``. Each row goes through the same processors as
plain sampling (min_tokens and penalties reading the outputs *plus the drafts before it*, then
temperature, min_p, top-k, top-p), so an accepted run is exactly what plain decoding would
have produced.

- Greedy rows accept drafts while they equal the argmax, then emit the argmax (one token more).
- Random rows use rejection sampling (Leviathan et al., 2023): draft ``x`` with draft
  probability ``q(x)`` is accepted with probability ``min(1, p(x) / q(x))``; on the first
  rejection a token is drawn from ``max(0, p - q)`` renormalised and the run ends; with every
  draft accepted one more token is drawn from the last row. Each emitted token is then
  distributed exactly as the target's ``p``. An n-gram draft is deterministic, so ``q`` is one-hot
  at the draft: acceptance with probability ``p(x)``, and the residual is ``p`` without ``x``.

NOTE: a seeded request draws its acceptance uniforms, then its residual or bonus draw, from its
own generator in that order, so its tokens are reproducible from its seed.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from bastion.core.sampler import (
    SamplingMetadata,
    apply_logit_bias,
    apply_min_p,
    apply_min_tokens,
    apply_penalties,
    apply_top_k_top_p,
    compute_logprobs,
    random_sample,
)
from bastion.ipc.messages import Logprobs, SamplingParams


class VerifyRequest(NamedTuple):
    """One request's rows of a verify step."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None
    eos_token_id: int | None
    draft_token_ids: list[int]
    # The proposer's distribution each draft was drawn from [len(drafts), V]; None: one-hot
    # (a deterministic proposer such as ngram, or a greedy draft model).
    draft_probs: torch.Tensor | None = None


class VerifyOutput(NamedTuple):
    token_ids: list[list[int]]  # per request: accepted drafts, then one token more
    logprobs: list[Logprobs | None]


def rejection_sample(probs: torch.Tensor, draft_token_ids: list[int],
                     draft_probs: torch.Tensor | None = None,
                     generator: torch.Generator | None = None) -> list[int]:
    """One request's emitted tokens from target ``probs`` [d + 1, V] and its ``d`` drafts.

    ``draft_probs`` [d, V] is the proposer's distribution each draft was drawn from; ``None``
    means deterministic drafts (one-hot ``q``).
    """
    num_drafts = len(draft_token_ids)
    gens = {0: generator} if generator is not None else {}
    if num_drafts:
        uniforms = torch.rand(num_drafts, generator=generator, device=probs.device).tolist()
        rows = torch.arange(num_drafts, device=probs.device)
        drafts = torch.tensor(draft_token_ids, device=probs.device)
        p_draft = probs[rows, drafts]
        q_draft = draft_probs[rows, drafts] if draft_probs is not None else torch.ones_like(
            p_draft)
        ratios = (p_draft / q_draft).tolist()
    emitted: list[int] = []
    for j in range(num_drafts):
        if uniforms[j] < ratios[j]:
            emitted.append(draft_token_ids[j])
            continue
        if draft_probs is not None:
            residual = (probs[j] - draft_probs[j]).clamp_(min=0.0)
        else:
            residual = probs[j].clone()
            residual[draft_token_ids[j]] = 0.0
        total = residual.sum()
        # A zero residual means p <= q everywhere, i.e. p == q: then every draft is accepted
        # and this branch is not reached except by rounding; p itself is then the right law.
        dist = residual / total if total > 0 else probs[j]
        emitted.append(int(random_sample(dist.unsqueeze(0), gens)[0]))
        return emitted
    emitted.append(int(random_sample(probs[num_drafts].unsqueeze(0), gens)[0]))
    return emitted


def _is_plain_greedy(params: SamplingParams) -> bool:
    return (params.is_greedy and params.logprobs is None and params.min_tokens == 0
            and params.repetition_penalty == 1.0 and params.frequency_penalty == 0.0
            and params.presence_penalty == 0.0 and not params.logit_bias)


def _accept_greedy(best_ids: list[int], requests: list[VerifyRequest]) -> list[list[int]]:
    """Drafts while they equal the target's argmax, then the argmax after the last of them."""
    token_ids, row = [], 0
    for req in requests:
        emitted = []
        for draft in req.draft_token_ids:
            if draft != best_ids[row + len(emitted)]:
                break
            emitted.append(draft)
        emitted.append(best_ids[row + len(emitted)])
        token_ids.append(emitted)
        row += len(req.draft_token_ids) + 1
    return token_ids


def verify(logits: torch.Tensor, requests: list[VerifyRequest]) -> VerifyOutput:
    """Emitted tokens of every request from ``logits`` [sum(d_i + 1), V], rows in request
    order (each request's ``d_i + 1`` rows consecutive)."""
    device, vocab_size = logits.device, logits.shape[-1]
    if all(_is_plain_greedy(req.params) for req in requests):
        return VerifyOutput(_accept_greedy(logits.argmax(dim=-1).tolist(), requests),
                            [None] * len(requests))
    params, prompts, outputs, gens, eos, owners = [], [], [], [], [], []
    for i, req in enumerate(requests):
        for j in range(len(req.draft_token_ids) + 1):
            params.append(req.params)
            prompts.append(req.prompt_token_ids)
            outputs.append(req.output_token_ids + req.draft_token_ids[:j])
            gens.append(None)  # each request's generator is used once per request, below
            eos.append(req.eos_token_id)
            owners.append(i)
    meta = SamplingMetadata.build(params, prompts, outputs, gens, eos, device, vocab_size)
    logits = logits.float()
    raw_logprobs = logits.log_softmax(dim=-1) if meta.max_num_logprobs is not None else None
    logits = apply_penalties(apply_logit_bias(apply_min_tokens(logits, meta), meta), meta)
    greedy_ids = logits.argmax(dim=-1).tolist() if not meta.all_random else None
    probs = None
    if not meta.all_greedy:
        scaled = logits / meta.temperature.unsqueeze(1)
        if meta.min_p is not None:
            scaled = apply_min_p(scaled, meta.min_p)
        probs = apply_top_k_top_p(scaled, meta.top_k, meta.top_p).softmax(dim=-1)

    token_ids: list[list[int]] = []
    row = 0
    for req in requests:
        num_rows = len(req.draft_token_ids) + 1
        if req.params.is_greedy:
            emitted = _accept_greedy(greedy_ids[row:row + num_rows], [req])[0]
        else:
            emitted = rejection_sample(probs[row:row + num_rows], req.draft_token_ids,
                                       req.draft_probs, req.generator)
        token_ids.append(emitted)
        row += num_rows

    logprobs: list[Logprobs | None] = [None] * len(requests)
    if raw_logprobs is not None:
        rows, ids, starts = [], [], []
        row = 0
        for req, emitted in zip(requests, token_ids):
            starts.append(len(rows))
            rows.extend(range(row, row + len(emitted)))
            ids.extend(emitted)
            row += len(req.draft_token_ids) + 1
        lp = compute_logprobs(raw_logprobs[torch.tensor(rows, device=device)],
                              torch.tensor(ids, device=device), meta.max_num_logprobs)
        top_ids, top_lps, ranks = (t.tolist() for t in lp)
        for i, (req, emitted) in enumerate(zip(requests, token_ids)):
            k = req.params.logprobs
            if k is None:
                continue
            span = range(starts[i], starts[i] + len(emitted))
            logprobs[i] = Logprobs([top_ids[r][:k + 1] for r in span],
                                   [top_lps[r][:k + 1] for r in span], [ranks[r] for r in span])
    return VerifyOutput(token_ids, logprobs)
