"""Drafting with a smaller model of the same vocabulary.

The draft model keeps its own paged KV cache, indexed by the *target's* block ids: every target
forward is shadowed by a draft forward over the same tokens, positions and slots, so a block's
draft KV is valid exactly when its target KV is (prefix-cache hits included), and it is freed
with the request's blocks. After verification the draft proposes ``k`` tokens one position at a
time from the request's last token; those writes land in the lookahead slots the scheduler
allocated past the step's tokens and are scratch (the next shadow forward rewrites them).

Under async scheduling the scheduler allocates a step's slots before it knows how many drafts
the step in flight accepts, as if all were: the worker's real positions never lie past them,
so its shadow and lookahead writes stay inside the request's blocks, and a fold that gives
rejected slots back keeps the lookahead of the step still in flight (scheduler
``_update_spec``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from bastion.core.config import ConfigError, EngineConfig
from bastion.core.forward_context import AttentionMetadata, set_forward_context
from bastion.core.loader import load_model, resolve_model
from bastion.core.sampler import random_sample

if TYPE_CHECKING:
    from bastion.core.model_runner import CachedRequestState


class Drafts(NamedTuple):
    token_ids: list[list[int]]  # per request
    probs: list[torch.Tensor | None]  # per request [len(drafts), V]; None when drawn greedily


class DraftModelProposer:
    def __init__(self, config: EngineConfig, target_vocab_size: int) -> None:
        spec = config.speculative
        self.num_tokens = spec.num_speculative_tokens
        # NOTE: a dummy target (benchmarks) gets a dummy draft: random weights from the
        # draft's config.json and the target's seed.
        load_format = "dummy" if config.model.load_format == "dummy" else "auto"
        model_config = config.model.__class__(
            model=spec.model, load_format=load_format, dtype=config.model.dtype,
            device=config.model.device, seed=config.model.seed, skip_tokenizer_init=True,
            enforce_eager=True)
        resolved = resolve_model(model_config)
        vocab_size = resolved.hf_config.vocab_size
        if vocab_size != target_vocab_size:
            raise ConfigError(f"speculative_config model {spec.model!r} has a vocabulary of "
                              f"{vocab_size} tokens but the target's has {target_vocab_size}; "
                              "a draft model must share the target's vocabulary")
        self.model = load_model(model_config, resolved)
        self.dtype = model_config.torch_dtype
        self.block_size = config.cache.block_size

    def kv_cache_bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return sum(2 * self.block_size * layer.num_kv_heads * layer.head_dim * elem
                   for layer in self.model.attention_layers())

    def allocate_kv_cache(self, num_blocks: int, device: torch.device) -> None:
        for layer in self.model.attention_layers():
            shape = (num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim)
            layer.k_cache = torch.zeros(shape, dtype=self.dtype, device=device)
            layer.v_cache = torch.zeros(shape, dtype=self.dtype, device=device)

    def shadow(self, input_ids: torch.Tensor, positions: torch.Tensor,
               meta: AttentionMetadata) -> None:
        """The target's flat batch through the draft, for its KV only."""
        with set_forward_context(meta):
            self.model(input_ids, positions)

    def propose(self, states: list[CachedRequestState], max_model_len: int) -> Drafts:
        """Up to ``k`` tokens per request, each drawn from the draft's distribution under the
        request's temperature (argmax when greedy), as many as its allocated blocks hold."""
        device = self.model_device
        bs = self.block_size
        starts = [len(s.token_ids) - 1 for s in states]
        limits = [min(self.num_tokens, s.num_blocks * bs - p, max_model_len - p)
                  for s, p in zip(states, starts)]
        tokens: list[list[int]] = [[] for _ in states]
        probs: list[list[torch.Tensor]] = [[] for _ in states]
        last = [s.token_ids[-1] for s in states]
        for j in range(max(limits, default=0)):
            active = [i for i, m in enumerate(limits) if j < m]
            positions = np.array([starts[i] + j for i in active], dtype=np.int64)
            ids = torch.tensor([last[i] for i in active], dtype=torch.long, device=device)
            meta = self._decode_metadata([states[i] for i in active], positions)
            pos = torch.from_numpy(positions).to(device)
            with set_forward_context(meta):
                hidden = self.model(ids, pos)
            logits = self.model.compute_logits(hidden).float()
            for row, i in enumerate(active):
                params = states[i].params
                if params.is_greedy:
                    token = int(logits[row].argmax())
                else:
                    q = (logits[row] / params.temperature).softmax(dim=-1)
                    gen = states[i].generator
                    token = int(random_sample(q.unsqueeze(0), {0: gen} if gen else {})[0])
                    probs[i].append(q)
                tokens[i].append(token)
                last[i] = token
        return Drafts(tokens, [torch.stack(p) if p else None for p in probs])

    @property
    def model_device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _decode_metadata(self, states: list[CachedRequestState],
                         positions: np.ndarray) -> AttentionMetadata:
        from bastion.core.model_runner import _block_table, _slot_mapping

        device = self.model_device
        num = len(states)
        table = _block_table(states, positions // self.block_size + 1)
        slots = _slot_mapping(table, np.arange(num), positions, self.block_size)
        lens = (positions + 1).tolist()
        qsl = list(range(num + 1))
        return AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(device),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
            block_tables=torch.from_numpy(table).to(device),
            max_query_len=1, max_seq_len=max(lens), query_start_loc_cpu=qsl, seq_lens_cpu=lens)
