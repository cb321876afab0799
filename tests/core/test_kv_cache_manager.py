"""The block pool and KV cache manager alone (no model): chained block hashes,
prefix hits capped one token short, ref counts under sharing, LRU eviction with
chain ends first, and a whole pool at the end."""

import pytest

from pagoda.core.block_pool import BlockPool, hash_block_tokens
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.request import Request
from pagoda.sampling_params import SamplingParams

BLOCK = 4


def make_request(request_id, tokens, **params):
    return Request(request_id, tokens, SamplingParams(max_tokens=8, **params))


def admit(kv, request):
    """What the scheduler does for a waiting request: look up, allocate, count."""
    hits = kv.get_computed_blocks(request)
    num_computed = len(hits or ()) * BLOCK
    assert kv.allocate_slots(request, request.num_tokens, hits) is not None
    request.num_computed_tokens = request.num_tokens
    return num_computed


def test_hashes_chain_over_the_whole_prefix():
    a = hash_block_tokens(None, [1, 2, 3, 4])
    assert a == hash_block_tokens(None, (1, 2, 3, 4))
    assert hash_block_tokens(a, [5, 6, 7, 8]) != hash_block_tokens(None, [5, 6, 7, 8])
    assert hash_block_tokens(a, [5, 6, 7, 8]) != hash_block_tokens(a, [5, 6, 7, 8], extra_keys=("lora",))
    kv = KVCacheManager(8, BLOCK)
    request = make_request("r", list(range(1, 11)))
    assert kv.block_hashes(request) == [a, hash_block_tokens(a, [5, 6, 7, 8])]  # the partial block has none
    request.output_token_ids += [11, 12]  # decode fills the third block
    assert len(kv.block_hashes(request)) == 3


def test_shared_prefix_hits_and_ref_counts():
    kv = KVCacheManager(16, BLOCK)
    first = make_request("a", list(range(10)))
    assert admit(kv, first) == 0
    second = make_request("b", list(range(8)) + [99, 98, 97])
    assert admit(kv, second) == 8  # two full blocks shared
    assert kv.block_ids("a")[:2] == kv.block_ids("b")[:2]
    assert kv.block_ids("a")[2] != kv.block_ids("b")[2]
    shared = [kv.pool.blocks[i] for i in kv.block_ids("a")[:2]]
    assert [b.ref_cnt for b in shared] == [2, 2]
    assert kv.prefix_cache_stats.queries == 21 and kv.prefix_cache_stats.hits == 8
    assert kv.prefix_cache_stats.hit_rate == pytest.approx(8 / 21)
    kv.free("a")
    assert [b.ref_cnt for b in shared] == [1, 1]
    kv.free("b")
    assert kv.num_free_blocks == 16
    # Freed but still cached: a third request hits them again.
    assert admit(kv, make_request("c", list(range(9)))) == 8


def test_hit_is_capped_one_token_short():
    kv = KVCacheManager(16, BLOCK)
    admit(kv, make_request("a", list(range(8))))
    kv.free("a")
    # Same 8 tokens: only the first block may hit, so token 7 is computed and sampled from.
    assert admit(kv, make_request("b", list(range(8)))) == 4
    assert admit(kv, make_request("c", list(range(9)))) == 8


def test_decode_filled_blocks_are_cached():
    kv = KVCacheManager(16, BLOCK)
    request = make_request("a", [1, 2, 3])
    admit(kv, request)
    request.output_token_ids.append(4)  # sampled; its KV is computed next step
    assert kv.allocate_slots(request, 4) == []
    request.output_token_ids.append(5)
    kv.allocate_slots(request, 5)
    assert admit(kv, make_request("b", [1, 2, 3, 4, 9])) == 4


def test_prompt_logprobs_skip_the_cache():
    kv = KVCacheManager(16, BLOCK)
    admit(kv, make_request("a", list(range(12))))
    request = make_request("b", list(range(12)), prompt_logprobs=1)
    assert kv.get_computed_blocks(request) is None
    assert admit(kv, request) == 0
    assert kv.prefix_cache_stats.queries == 12  # a skipped lookup is no query


def test_caching_off_never_hits():
    kv = KVCacheManager(16, BLOCK, enable_caching=False)
    admit(kv, make_request("a", list(range(12))))
    assert admit(kv, make_request("b", list(range(12)))) == 0
    assert not kv.pool.cached_block_hash_to_block


def test_reset_forgets_every_prefix_once_no_block_is_held():
    kv = KVCacheManager(8, BLOCK)
    admit(kv, make_request("a", list(range(12))))
    assert not kv.pool.reset_prefix_cache()  # a holds its (cached) blocks: nothing changes
    assert len(kv.pool.cached_block_hash_to_block) == 3
    kv.free("a")
    assert kv.pool.reset_prefix_cache()
    assert not kv.pool.cached_block_hash_to_block
    assert all(block.block_hash is None for block in kv.pool.blocks)
    assert admit(kv, make_request("b", list(range(12)))) == 0  # computed again
    assert len(kv.pool.cached_block_hash_to_block) == 3  # and cached again
    kv.free("b")
    assert kv.num_free_blocks == 8


def test_blocks_without_a_hash_are_reused_first():
    """Freed blocks that hold no prefix-cache entry come back first, most
    recently freed first: without caching, a run keeps reusing the same
    blocks (their pages) instead of walking the whole cache."""
    kv = KVCacheManager(16, BLOCK, enable_caching=False)
    admit(kv, make_request("a", list(range(12))))
    a_ids = kv.block_ids("a")
    kv.free("a")
    admit(kv, make_request("b", list(range(50, 62))))
    assert sorted(kv.block_ids("b")) == sorted(a_ids)
    # With caching, b's full blocks stay cached behind the rest; its partial
    # last block (no hash) is the first to be reused.
    kv = KVCacheManager(6, BLOCK)
    admit(kv, make_request("b", list(range(10))))  # 2 full blocks + 2 tokens
    b_ids = kv.block_ids("b")
    kv.free("b")
    assert kv.pool.free_queue.block_ids() == [b_ids[2], 3, 4, 5, b_ids[1], b_ids[0]]


def test_lru_eviction_takes_chain_ends_first():
    kv = KVCacheManager(6, BLOCK)
    admit(kv, make_request("a", list(range(12))))  # blocks 0,1,2 (all full, all cached)
    a_ids = kv.block_ids("a")
    kv.free("a")
    # Tail first: the never-used blocks, then a's blocks from its end.
    assert kv.pool.free_queue.block_ids() == [3, 4, 5] + a_ids[::-1]
    admit(kv, make_request("x", list(range(50, 63))))  # 4 blocks
    assert a_ids[2] in kv.block_ids("x") and a_ids[0] not in kv.block_ids("x")
    assert kv.pool.blocks[a_ids[2]].block_hash is None  # evicted: no longer cached
    kv.free("x")
    # a's first two blocks survived eviction.
    assert admit(kv, make_request("b", list(range(12)))) == 8


def test_hit_on_a_free_block_uses_up_free_space():
    kv = KVCacheManager(3, BLOCK)
    admit(kv, make_request("a", list(range(8))))
    kv.free("a")
    # 9 tokens need 3 blocks: 2 hits (both free) + 1 new = the whole pool.
    request = make_request("b", list(range(8)) + [7])
    hits = kv.get_computed_blocks(request)
    assert len(hits) == 2
    assert kv.allocate_slots(request, 9, hits) is not None
    assert kv.num_free_blocks == 0
    # A request that needs more than what is left gets None and changes nothing.
    other = make_request("c", list(range(8)) + [1, 2, 3, 4, 5])
    hits = kv.get_computed_blocks(other)
    assert kv.allocate_slots(other, 13, hits) is None
    assert [b.ref_cnt for b in kv.pool.blocks] == [1, 1, 1]
    kv.free("b")
    assert kv.num_free_blocks == 3


def test_free_twice_is_an_error():
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(RuntimeError):
        pool.free(blocks)
