"""Decode under CUDA graphs: one graph per batch-size bucket over persistent static buffers.

A decode step launches a few hundred small kernels (28 layers x ~12 ops for Qwen3-0.6B); on a
GPU their launch cost exceeds their run time. Replaying a graph captured once per bucket turns
them into one launch. A graph bakes in every pointer it touches, so its inputs live in static
device buffers that each step refills in place: the step's values are written into pinned host
staging buffers and copied over with non-blocking transfers, then the bucket's graph is replayed.

Padding a batch of ``b`` sequences up to its bucket ``B``: rows ``b..B-1`` become zero-length
sequences (``query_start_loc`` stays at ``b``, ``seq_lens`` 0) whose one token has slot -1, so the
KV store skips it and the attention kernel's spare programs exit. Their hidden rows are junk
that no later op mixes into real rows (every op after attention is row-wise); callers read only
the first ``b`` rows.

Speculative decoding's verify steps feed each sequence its last token and ``k`` drafts: a runner
built with ``query_len = k + 1`` captures batches of exactly that many tokens per sequence (a
sequence with fewer drafts is padded up to them with slot -1 tokens after its real ones; causal
attention keeps them out of its real rows).

Without capture (the CPU, or ``capture()`` not called) ``run`` executes the same padded batch
eagerly, which lets the staging and padding logic be tested anywhere.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
from bastion.core.forward_context import AttentionMetadata, set_forward_context
from bastion.core.staging import StagingRing
from torch import nn

logger = logging.getLogger(__name__)


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to ``max_num_seqs`` (which is always included)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    sizes.append(max_num_seqs)
    return sorted(set(sizes))


class DecodeInputs(NamedTuple):
    """One decode step on the host: ``q`` new tokens per sequence (the runner's
    ``query_len``; 1 for plain decode), sequence after sequence in batch order."""

    input_ids: np.ndarray  # int64 [b * q]
    positions: np.ndarray  # int64 [b * q]: consecutive per sequence, from its cached length
    slot_mapping: np.ndarray  # int64 [b * q]; -1: a padding token, not stored
    block_tables: np.ndarray  # int32 [b, w], w <= max_blocks_per_seq
    # Row of the previous step's sampled tokens that holds this row's input (its token was
    # still on the device when the step was prepared), or -1 when ``input_ids`` has it.
    pending_rows: np.ndarray | None = None  # int64 [b]
    # Context length of each sequence including its q new tokens; None: its last position + 1.
    # (A verify step's padding tokens repeat their sequence's last real position.)
    seq_lens: np.ndarray | None = None  # int64 [b]


def _seq_lens(inputs: DecodeInputs, q: int) -> np.ndarray:
    if inputs.seq_lens is not None:
        return inputs.seq_lens
    return inputs.positions[q - 1::q] + 1


class _Layout(NamedTuple):
    """Where a step's inputs sit in one flat buffer (bytes), so that one copy moves them all:
    int64 rows (ids, positions, slots, rows of in-flight tokens), int32 (seq_lens then
    query_start_loc), then the step's block table, ``b x width`` int32, packed."""

    n: int  # sequences (the largest bucket)
    q: int  # tokens per sequence
    i32_at: int
    bt_at: int
    size: int

    @classmethod
    def of(cls, n: int, q: int, max_blocks_per_seq: int) -> _Layout:
        i32_at = 4 * n * q * 8
        bt_at = i32_at + -(-(2 * n + 1) * 4 // 8) * 8
        return cls(n, q, i32_at, bt_at, bt_at + n * max_blocks_per_seq * 4)

    def views(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(int64 [4, n * q], int32 [2n + 1], int32 [n * max_blocks_per_seq]) over ``flat``."""
        n, q = self.n, self.q
        return (flat[:self.i32_at].view(torch.int64).view(4, n * q),
                flat[self.i32_at:self.i32_at + (2 * n + 1) * 4].view(torch.int32),
                flat[self.bt_at:self.size].view(torch.int32))


class _HostStaging:
    """One (pinned) host buffer a step is written into before its copy."""

    def __init__(self, layout: _Layout, pin: bool) -> None:
        self.flat = torch.zeros(layout.size, dtype=torch.uint8, pin_memory=pin)
        self.i64, self.i32, self.bt = layout.views(self.flat)


class CUDAGraphRunner:
    """Runs decode batches of up to ``max(capture_sizes)`` sequences, ``query_len`` tokens each,
    through ``model``.

    ``model(input_ids, positions)`` must read attention metadata from the forward context and
    return hidden states [T, H]. The KV caches must be allocated before ``capture()`` (the graphs
    hold their addresses) and must not be reallocated afterwards.
    """

    def __init__(self, model: nn.Module, capture_sizes: list[int], max_blocks_per_seq: int,
                 block_size: int, device: torch.device, query_len: int = 1,
                 head: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 prev_tokens: torch.Tensor | None = None) -> None:
        self.model = model
        # hidden -> logits, captured in the graph behind the model (``run(logits=True)``).
        self.head = head
        # The previous step's sampled tokens (int64, at least as many as any step samples),
        # which its sampler wrote: rows whose input token was still in flight read theirs
        # from it, inside the graph (plain decode only).
        self.prev_tokens = prev_tokens if query_len == 1 else None
        self.query_len = query_len
        self.capture_sizes = sorted(capture_sizes)
        self.max_num_seqs = self.capture_sizes[-1]
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_size = block_size
        self.device = device
        n = self.max_num_seqs
        pin = device.type == "cuda"
        # Every input of a step goes over in one host-to-device copy (``_Layout``); the block
        # table then moves into its place in one copy on the device. Two host buffers
        # alternate (see StagingRing).
        q = query_len
        self._layout = layout = _Layout.of(n, q, max_blocks_per_seq)
        self._host = StagingRing(lambda: _HostStaging(layout, pin), device)
        self._dev_flat = torch.zeros(layout.size, dtype=torch.uint8, device=device)
        self._dev_i64, self._dev_i32, self._dev_bt_packed = layout.views(self._dev_flat)
        self._dev_bt = torch.zeros((n, max_blocks_per_seq), dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        # Plain sampling of each bucket's logits (greedy, or drawn at each row's temperature),
        # captured apart from the forward (a grammar step's bitmask is filled while the forward
        # runs): (bucket, masked, drawn) -> (graph, tokens).
        self._samplers: dict[tuple[int, bool, bool],
                             tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._temperature: torch.Tensor | None = None  # float32 [n], a drawing graph's input
        self._temperature_host: StagingRing[torch.Tensor] | None = None
        self.mask_target: torch.Tensor | None = None  # where a masked sampling graph reads
        self.mask_words = 0  # ... bitmask rows of this many int32 words
        self._last_size: int | None = None  # the bucket the last ``run`` replayed
        self._pool: object | None = None

    def bucket(self, num_seqs: int) -> int | None:
        """The smallest capture size that holds ``num_seqs``; None when none does."""
        for size in self.capture_sizes:
            if size >= num_seqs:
                return size
        return None

    def can_run(self, num_seqs: int, num_block_columns: int) -> bool:
        return self.bucket(num_seqs) is not None and num_block_columns <= self.max_blocks_per_seq

    @property
    def is_captured(self) -> bool:
        return bool(self.graphs)

    # ------------------------------------------------------------------------- buffers

    def _metadata(self, size: int, seq_lens_cpu: list[int] | None = None) -> AttentionMetadata:
        """Metadata over the first ``size`` rows of the static buffers.

        The CPU lists matter only to the torch reference kernels (eager runs); the Triton path
        reads the device tensors, so a graph captured with placeholder lists stays valid.
        """
        n, q = self.max_num_seqs, self.query_len
        if seq_lens_cpu is None:
            qsl_cpu, lens_cpu = list(range(0, (size + 1) * q, q)), [q] * size
        else:
            b = sum(1 for s in seq_lens_cpu if s > 0)
            qsl_cpu = list(range(0, (b + 1) * q, q)) + [b * q] * (size - b)
            lens_cpu = seq_lens_cpu
        return AttentionMetadata(
            slot_mapping=self._dev_i64[2, :size * q],
            query_start_loc=self._dev_i32[n:n + size + 1],
            seq_lens=self._dev_i32[:size],
            block_tables=self._dev_bt[:size],
            max_query_len=q,
            max_seq_len=self.max_blocks_per_seq * self.block_size,
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=lens_cpu,
        )

    def _stage(self, inputs: DecodeInputs, size: int) -> None:
        """Write one step (padded to ``size``) into pinned memory, then copy it over."""
        host = self._host.acquire()
        q = self.query_len
        t = len(inputs.input_ids)  # b * q
        b = t // q
        n = self.max_num_seqs
        i64 = host.i64.numpy()
        i64[0, :t], i64[1, :t], i64[2, :t] = inputs.input_ids, inputs.positions, inputs.slot_mapping
        i64[3, :t] = -1 if inputs.pending_rows is None else inputs.pending_rows
        i64[0:2, t:size * q] = 0
        i64[2:4, t:size * q] = -1
        i32 = host.i32.numpy()
        i32[:b] = _seq_lens(inputs, q)
        i32[b:size] = 0
        i32[n:n + b + 1] = np.arange(0, (b + 1) * q, q, dtype=np.int32)
        i32[n + b + 1:n + size + 1] = b * q
        width = inputs.block_tables.shape[1]
        num_bt = b * width
        host.bt[:num_bt].numpy()[:] = inputs.block_tables.reshape(-1)
        end = self._layout.bt_at + num_bt * 4
        self._dev_flat[:end].copy_(host.flat[:end], non_blocking=True)
        # Rows past ``b`` keep stale ids: their sequences are empty, so nothing reads them.
        self._dev_bt[:b, :width].copy_(self._dev_bt_packed[:num_bt].view(b, width))
        self._host.copied()

    def _patch_pending(self, size: int) -> None:
        """Input ids of rows whose token the previous step sampled, read on the device."""
        rows = self._dev_i64[3, :size]
        ids = self._dev_i64[0, :size]
        ids.copy_(torch.where(rows >= 0, self.prev_tokens[rows.clamp(min=0)], ids))

    # ------------------------------------------------------------------------- run

    def _forward(self, size: int, meta: AttentionMetadata, head_rows: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden, logits of the first ``head_rows`` rows, all by default; None without a
        head or with ``head_rows`` 0) of the staged step."""
        if self.prev_tokens is not None:
            self._patch_pending(size)
        with set_forward_context(meta):
            hidden = self.model(*self.staged_inputs(size))
        if self.head is None or head_rows == 0:
            return hidden, None
        return hidden, self.head(hidden if head_rows is None else hidden[:head_rows])

    def staged_inputs(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The (input ids, positions) device buffers of a ``size``-sequence step, as staged."""
        num_tokens = size * self.query_len
        return self._dev_i64[0, :num_tokens], self._dev_i64[1, :num_tokens]

    def eager_metadata(self, inputs: DecodeInputs, size: int) -> AttentionMetadata:
        """The metadata of the step last staged from ``inputs`` (for an eager forward over the
        same buffers, such as a draft model's shadow of a verify step)."""
        q = self.query_len
        b = len(inputs.input_ids) // q
        seq_lens = _seq_lens(inputs, q).tolist() + [0] * (size - b)
        return self._metadata(size, seq_lens)

    @torch.inference_mode()
    def capture(self, pool: object | None = None) -> None:
        """Capture one graph per capture size, largest first so smaller ones reuse its pool.
        ``pool``: another runner's memory pool to share (their graphs never run at once)."""
        if self.device.type != "cuda":
            raise RuntimeError("CUDA graphs need a CUDA device")
        self._pool = pool
        start = time.perf_counter()
        # Valid do-nothing inputs: every row is padding (no sequence, slot -1).
        n = self.max_num_seqs
        self._dev_i64.zero_()
        self._dev_i64[2].fill_(-1)
        self._dev_i32.zero_()
        torch.cuda.synchronize(self.device)
        for size in reversed(self.capture_sizes):
            meta = self._metadata(size)
            self._forward(size, meta)  # warm-up: Triton compiles, cuBLAS picks its kernels
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = self._forward(size, meta)  # hidden (and logits) of every row
            if self._pool is None:
                self._pool = graph.pool()
            self.graphs[size] = graph
            self._outputs[size] = out
        torch.cuda.synchronize(self.device)
        logger.info("captured %d CUDA graphs (batch sizes %d..%d, %d tokens per sequence) in "
                    "%.2f s", len(self.graphs), self.capture_sizes[0], n, self.query_len,
                    time.perf_counter() - start)

    @property
    def pool(self) -> object | None:
        return self._pool

    def recapture(self) -> None:
        """Capture the forward graphs again into the same pool (each new one replaces its old
        one), then the plain sampling graphs behind them if there were any (they read the
        forward graphs' logits), so that an in-process A/B benchmark's switches read at launch
        (``bastion.envs``) take effect."""
        had_sampling = bool(self._samplers)
        self.capture(pool=self._pool)
        if had_sampling:
            self._samplers.clear()
            self.capture_sampling(with_mask=self.mask_target is not None)

    def run(self, inputs: DecodeInputs, min_size: int = 0, logits: bool = False) -> torch.Tensor:
        """Hidden states [b * q, H] of one decode step (graph replay when captured), or with
        ``logits`` (a runner built with a head) its logits [b * q, vocab]. Rows with
        ``pending_rows >= 0`` read their input token from ``prev_tokens``. ``min_size``: run
        at least this bucket (a coupled DP group's agreed size); ``b`` may then be 0."""
        q = self.query_len
        t = len(inputs.input_ids)
        if t % q:
            raise ValueError(f"a step of this runner feeds {q} tokens per sequence; got {t}")
        if logits and self.head is None:
            raise ValueError("this runner was built without a head: it has no logits")
        b = t // q
        size = self.bucket(max(b, min_size))
        if size is None or inputs.block_tables.shape[1] > self.max_blocks_per_seq:
            raise ValueError(f"decode batch of {b} sequences x {inputs.block_tables.shape[1]} "
                             f"blocks exceeds the captured {self.max_num_seqs} x "
                             f"{self.max_blocks_per_seq}")
        if inputs.pending_rows is not None and self.prev_tokens is None and (
                inputs.pending_rows >= 0).any():
            raise ValueError("rows read in-flight tokens, but this runner has no prev_tokens")
        self._stage(inputs, size)
        graph = self.graphs.get(size)
        self._last_size = size if graph is not None else None
        if graph is not None:
            graph.replay()
            hidden, out = self._outputs[size]
        else:  # eager: the head over the real rows only
            hidden, out = self._forward(size, self.eager_metadata(inputs, size),
                                        t if logits else 0)
        return out[:t] if logits else hidden[:t]

    @torch.inference_mode()
    def capture_sampling(self, with_mask: bool = False) -> None:
        """Capture, per bucket, the plain sampling of its logits, the tokens also written to
        ``prev_tokens`` (a runner built with a head and prev_tokens, captured): one graph
        greedy, one drawing each row at its temperature (0: greedy) with seeds from the global
        RNG, as the Sampler's fused path does. ``with_mask``: both again under the grammar
        bitmask staged in ``mask_target``: int32, a row map of ``max_num_seqs`` entries (-1: no
        mask; padding rows too), then up to ``max_num_seqs`` bitmask rows of ``mask_words``
        words (``GrammarBitmaskApplier.upload`` lays them out so)."""
        from bastion.core.sampler import greedy_tokens, plain_tokens, warm_greedy_args
        from bastion.core.structured_output.bitmask import DeviceMask

        if self.head is None or self.prev_tokens is None or not self.graphs:
            raise RuntimeError("sampling graphs need a captured runner with a head and "
                               "prev_tokens")
        n = self.max_num_seqs
        vocab_size = self._outputs[n][1].shape[1]
        words = -(-vocab_size // 32)
        mask_target = None
        if with_mask:
            mask_target = torch.full((n + n * words,), -1, dtype=torch.int32, device=self.device)
        warm_greedy_args(n, self.device)  # its buffers outside the graphs' pool
        self._temperature = torch.ones(n, dtype=torch.float32, device=self.device)
        self._temperature_host = StagingRing(
            lambda: torch.zeros(n, dtype=torch.float32, pin_memory=True), self.device)
        start = time.perf_counter()
        for size in sorted(self.graphs, reverse=True):
            logits = self._outputs[size][1]
            variants: list[DeviceMask | None] = [None]
            if mask_target is not None:
                variants.append(DeviceMask(mask_target[n:n + n * words].view(n, words),
                                           mask_target[:size]))
            for mask in variants:
                for drawn in (False, True):
                    def sample(mask=mask, drawn=drawn, logits=logits, size=size):
                        if drawn:
                            return plain_tokens(logits, self._temperature[:size], mask)
                        return greedy_tokens(logits, mask)

                    sample()  # warm-up
                    torch.cuda.synchronize(self.device)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self._pool):
                        tokens = sample()
                        self.prev_tokens[:size].copy_(tokens)
                    self._samplers[(size, mask is not None, drawn)] = (graph, tokens)
        torch.cuda.synchronize(self.device)
        self.mask_target, self.mask_words = mask_target, words
        logger.info("captured plain sampling for %d buckets%s in %.2f s", len(self.graphs),
                    " (and under a grammar bitmask)" if mask_target is not None else "",
                    time.perf_counter() - start)

    def sample_plain(self, num_rows: int, masked: bool,
                     temperatures: list[float] | None = None) -> torch.Tensor | None:
        """The tokens [num_rows] of the step ``run`` last replayed, by its captured sampling
        graph: greedy, or with ``temperatures`` each row drawn at its own (0: greedy); under
        the bitmask staged in ``mask_target`` when ``masked``. A fixed buffer, rewritten by
        the next sampling; None when no graph was captured for the step."""
        drawn = temperatures is not None
        entry = (self._samplers.get((self._last_size, masked, drawn))
                 if self._last_size is not None else None)
        if entry is None:
            return None
        if drawn:
            host = self._temperature_host.acquire()
            host.numpy()[:num_rows] = temperatures
            self._temperature[:num_rows].copy_(host[:num_rows], non_blocking=True)
            self._temperature_host.copied()
        graph, tokens = entry
        graph.replay()
        return tokens[:num_rows]
