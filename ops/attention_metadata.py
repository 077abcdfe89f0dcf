"""Where a step's tokens live in the paged KV cache: the metadata every attention kernel reads.

It belongs to ops/ (the kernels' contract); ``bastion.core.forward_context`` hands one per step
to the model's attention layers.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Where one step's tokens live in the paged KV cache.

    The new tokens of sequence ``i`` are the LAST ``q_len_i`` tokens of its context, at positions
    ``seq_len_i - q_len_i ... seq_len_i - 1``; attention is causal over the whole context.
    """

    slot_mapping: torch.Tensor  # int64 [T]: block_id * block_size + offset; -1 = padding, not stored
    query_start_loc: torch.Tensor  # int32 [B+1]: cumulative new-token counts, on the model device
    seq_lens: torch.Tensor  # int32 [B]: context length INCLUDING the new tokens
    block_tables: torch.Tensor  # int32 [B, max_blocks_per_seq]: physical block ids, padded with 0
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: list[int]  # the same as Python lists, for the CPU reference loops
    seq_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    @functools.cached_property
    def decode_seq_ids(self) -> list[int]:
        """The sequences with exactly one new token, in order (found once a step, shared by
        the layers)."""
        qsl = self.query_start_loc_cpu
        return [i for i, (a, b) in enumerate(itertools.pairwise(qsl)) if b - a == 1]

    @property
    def num_decode_seqs(self) -> int:
        return len(self.decode_seq_ids)

    @functools.cached_property
    def max_decode_seq_len(self) -> int:
        """The longest context of a decode sequence (0 without one): what a decode kernel's
        scratch must hold, often far less than ``max_seq_len`` in a step with a long prefill."""
        lens = self.seq_lens_cpu
        return max((lens[i] for i in self.decode_seq_ids), default=0)


def build_attention_metadata(query_lens: Sequence[int], seq_lens: Sequence[int],
                             block_tables: Sequence[Sequence[int]], block_size: int,
                             device: torch.device | str = "cpu") -> AttentionMetadata:
    """Build metadata from plain lists (tests, dummy runs, the CPU runner).

    The slot of each new token follows from its position and the sequence's block table.
    """
    if not (len(query_lens) == len(seq_lens) == len(block_tables)):
        raise ValueError("query_lens, seq_lens and block_tables must have one entry per sequence")
    starts = [0]
    slots: list[int] = []
    for q_len, seq_len, table in zip(query_lens, seq_lens, block_tables):
        if not 0 < q_len <= seq_len or len(table) * block_size < seq_len:
            raise ValueError(f"bad sequence: q_len={q_len} seq_len={seq_len} blocks={len(table)}")
        starts.append(starts[-1] + q_len)
        for pos in range(seq_len - q_len, seq_len):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    width = max((len(t) for t in block_tables), default=0)
    padded = [list(t) + [0] * (width - len(t)) for t in block_tables]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device).view(len(padded), width),
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        query_start_loc_cpu=starts,
        seq_lens_cpu=list(seq_lens),
    )
