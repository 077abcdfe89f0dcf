"""KV block manager: exact block ids, reference counts, eviction order, no leaks."""

from __future__ import annotations

import pytest

from bastion.core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from bastion.core.kv_cache_manager import KVCacheManager
from bastion.core.request import Request
from bastion.ipc.messages import SamplingParams


def make_request(request_id: str, token_ids: list[int]) -> Request:
    return Request(request_id, token_ids, SamplingParams(max_tokens=8))


def test_free_queue_is_fifo_with_o1_middle_removal():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    assert queue.block_ids() == [0, 1, 3, 4]
    assert queue.popleft().block_id == 0
    queue.append(blocks[2])
    assert queue.block_ids() == [1, 3, 4, 2]
    assert queue.num_free_blocks == 4


def test_allocation_hands_out_blocks_in_order_and_counts_references():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    req = make_request("a", list(range(10)))  # 10 tokens -> 3 blocks
    assert kv.allocate_slots(req, 10) == [0, 1, 2]
    assert [kv.pool.blocks[i].ref_cnt for i in range(3)] == [1, 1, 1]
    req.num_computed_tokens = 10
    assert kv.allocate_slots(req, 2) == []  # fits in block 2
    req.num_computed_tokens = 12
    assert kv.allocate_slots(req, 1) == [3]
    assert kv.num_free_blocks == 4


def test_prefix_hit_shares_blocks_and_reports_cached_tokens():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(100, 110))  # two full blocks + 2 tokens
    a = make_request("a", prompt)
    assert kv.allocate_slots(a, 10) == [0, 1, 2]
    b = make_request("b", prompt[:8] + [7, 7, 7])
    hit = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in hit.blocks] == [0, 1]
    assert hit.num_tokens == 8
    assert kv.allocate_slots(b, 3, hit) == [0, 1, 3]
    assert [kv.pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    assert kv.block_ids("b") == [0, 1, 3]


def test_full_prompt_hit_leaves_one_token_to_compute():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(8))
    a = make_request("a", prompt)
    kv.allocate_slots(a, 8)
    b = make_request("b", prompt)
    hit = kv.get_computed_blocks(b)
    assert hit.num_tokens == 4  # the last block is recomputed so the model yields logits


def test_freed_blocks_stay_cached_and_evict_in_lru_order_tail_first():
    kv = KVCacheManager(num_blocks=6, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5, 6])
    assert kv.allocate_slots(a, 6) == [0, 1, 2]
    kv.free(a)
    # Free queue: untouched blocks first, then a's blocks tail first (prefix evicted last).
    assert kv.pool.free_queue.block_ids() == [3, 4, 5, 2, 1, 0]
    assert all(kv.pool.blocks[i].ref_cnt == 0 for i in range(6))
    # A new request with a different prompt takes 3, 4, 5 first, then evicts 2 (a's tail).
    c = make_request("c", [9] * 8)
    assert kv.allocate_slots(c, 8) == [3, 4, 5, 2]
    assert kv.pool.blocks[2].block_hash == c.block_hashes[3]  # evicted, re-indexed for c
    assert a.block_hashes[2] not in kv.pool.cached
    # a's first two blocks are still a prefix hit.
    b = make_request("b", [1, 2, 3, 4, 0])
    hit = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in hit.blocks] == [0, 1]


def test_hit_on_free_block_is_removed_from_free_queue():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = make_request("a", [1, 2, 3])
    kv.allocate_slots(a, 3)
    kv.free(a)
    b = make_request("b", [1, 2, 8])
    hit = kv.get_computed_blocks(b)
    assert kv.allocate_slots(b, 1, hit) == [0, 2]
    assert 0 not in kv.pool.free_queue.block_ids()
    assert kv.pool.blocks[0].ref_cnt == 1


def test_allocation_fails_without_side_effects_when_pool_is_short():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    a = make_request("a", [1, 2, 3, 4])
    kv.allocate_slots(a, 4)
    b = make_request("b", [5, 6, 7, 8])
    assert kv.allocate_slots(b, 4) is None
    assert kv.num_free_blocks == 1
    assert kv.block_ids("b") == []


def test_every_block_returns_after_free_and_reset():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    reqs = [make_request(str(i), list(range(i, i + 9))) for i in range(3)]
    for r in reqs:
        assert kv.allocate_slots(r, 9) is not None
    kv.free(reqs[0])
    kv.reset()
    assert kv.num_free_blocks == 10
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    assert kv.pool.cached == {}


def test_double_free_is_caught():
    pool = BlockPool(2, enable_caching=True)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(AssertionError):
        pool.free(blocks)
