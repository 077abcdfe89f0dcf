"""Per-request KV block bookkeeping with prefix caching by chain hashes."""

from __future__ import annotations

from typing import NamedTuple

from bastion.core.block_pool import BlockPool, KVCacheBlock
from bastion.core.request import Request


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...],
               extra_keys: tuple = ()) -> int:
    """Chain hash of one full block: the parent's hash, the block's tokens and extra keys.

    NOTE: Python's hash of a tuple of ints is deterministic across processes (only str/bytes
    hashing is randomised), so every process computes the same chain.
    """
    return hash((parent_hash, token_ids, extra_keys))


class ComputedBlocks(NamedTuple):
    blocks: list[KVCacheBlock]
    num_tokens: int


class KVCacheManager:
    """Maps requests to blocks. ``allocate_slots`` is the only way blocks are handed out."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are already in the prefix index, so a decode
        # step indexes only the block it just filled instead of walking the whole table.
        self.num_indexed_blocks: dict[str, int] = {}
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which served from the cache

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, [])]

    def _update_hashes(self, request: Request) -> None:
        num_full = request.num_tokens // self.block_size
        hashes = request.block_hashes
        # NOTE: the adapter changes every layer's keys and values, so it is part of each
        # block's hash: blocks are never shared between adapters (or with the base model).
        extra_keys = (request.lora_id,) if request.lora_id else ()
        while len(hashes) < num_full:
            i = len(hashes)
            tokens = tuple(request.all_token_ids[i * self.block_size:(i + 1) * self.block_size])
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens, extra_keys))

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """Longest cached prefix of full blocks. At least one token is always left to compute,
        since the last prompt position must run through the model to give logits."""
        # NOTE: a request that asked for prompt logprobs computes every prompt position (vLLM
        # skips the cache for it too): a cached block has no logits.
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return ComputedBlocks([], 0)
        self._update_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        self.prefix_queries += request.num_tokens
        self.prefix_hits += len(hits) * self.block_size
        return ComputedBlocks(hits, len(hits) * self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed: ComputedBlocks | None = None) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens of ``request`` after its computed ones.

        Returns the ids of newly allocated blocks (prefix hits first), or ``None`` when the pool
        cannot supply them; then nothing changes.
        """
        blocks = self.req_blocks.get(request.request_id, [])
        hits = computed.blocks if computed else []
        num_computed = request.num_computed_tokens + (computed.num_tokens if computed else 0)
        num_needed = -(-(num_computed + num_new_tokens) // self.block_size)
        num_new_blocks = num_needed - len(blocks) - len(hits)
        if num_new_blocks <= 0 and not hits:  # the common decode step: room in the last block
            self._cache_full_blocks(request, blocks, num_computed + num_new_tokens)
            return []
        # Free hits are about to be taken out of the free queue: they cannot also be allocated.
        num_evictable_hits = sum(1 for b in hits if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_evictable_hits:
            return None
        self.pool.touch(hits)
        new_blocks = self.pool.allocate(max(num_new_blocks, 0))
        blocks = self.req_blocks.setdefault(request.request_id, blocks)
        blocks.extend(hits)
        blocks.extend(new_blocks)
        self._cache_full_blocks(request, blocks, num_computed + num_new_tokens)
        return [b.block_id for b in hits] + [b.block_id for b in new_blocks]

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock],
                           num_tokens: int) -> None:
        # NOTE: blocks are indexed as soon as their tokens are scheduled. A request scheduled
        # later in the same step may hit them: within a layer every KV store runs before any
        # attention read, so the content is there when it is read.
        if not self.enable_caching:
            return
        num_full = num_tokens // self.block_size
        start = self.num_indexed_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        self._update_hashes(request)
        # NOTE: a block holding a token not sampled yet (async scheduling) has no hash until
        # the token arrives; it is indexed by a later step.
        num_full = min(num_full, len(request.block_hashes))
        for i in range(start, num_full):
            self.pool.cache_block(blocks[i], request.block_hashes[i])
        self.num_indexed_blocks[request.request_id] = num_full

    def trim(self, request: Request, num_tokens: int) -> int:
        """Give back the tail blocks past the first ``num_tokens`` tokens of ``request`` (the
        slots of rejected draft tokens); returns how many blocks went back to the pool.

        NOTE: such blocks hold no full block of known tokens, so none is in the prefix index.
        """
        blocks = self.req_blocks.get(request.request_id)
        if not blocks:
            return 0
        keep = max(-(-num_tokens // self.block_size),
                   self.num_indexed_blocks.get(request.request_id, 0))
        if keep >= len(blocks):
            return 0
        tail = blocks[keep:]
        del blocks[keep:]
        self.pool.free(reversed(tail))
        return len(tail)

    def free(self, request: Request) -> None:
        """Return a request's blocks, tail first, so its prefix is evicted last."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self.num_indexed_blocks.pop(request.request_id, None)
        self.pool.free(reversed(blocks))

    def reset(self) -> None:
        """Drop every request's blocks and the prefix index (fault recovery)."""
        for blocks in self.req_blocks.values():
            self.pool.free(reversed(blocks))
        self.req_blocks.clear()
        self.num_indexed_blocks.clear()
        self.pool.reset_prefix_cache()
