"""The device-tier pool: chained keys, capped matches, collisions, pinning and exact LRU order."""

from __future__ import annotations

import torch

from tiered.hybrid.args import ModelArgs
from tiered.offload.device_tier import DeviceTier
from tiered.request.tokens import block_keys

BT = 4


def _tier(num_blocks: int) -> DeviceTier:
    args = ModelArgs(
        "LlamaForCausalLM",
        vocab_size=32,
        hidden_size=4,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=2,
        intermediate_size=8,
        rms_norm_eps=1e-5,
        rope_theta=1e4,
        rope_scaling=None,
        qkv_bias=False,
        o_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
        max_position_embeddings=64,
        sliding_window=None,
    )
    block_bytes = 2 * 2 * BT * 1 * 2 * 4  # K and V, 2 layers, BT tokens, 1 head of 2, fp32
    tier = DeviceTier(args, BT, num_blocks * block_bytes, torch.float32, "cpu")
    assert tier.bytes_per_block == block_bytes and tier.num_blocks == num_blocks
    return tier


def _fill(tier: DeviceTier, tokens: list[int]) -> list[int]:
    keys = block_keys(tokens, BT)
    blocks = tier.allocate(len(keys))
    for i, (b, key) in enumerate(zip(blocks, keys, strict=False)):
        assert tier.cache(b, key, tokens[i * BT : (i + 1) * BT])
    tier.unpin(blocks)
    return blocks


def test_keys_chain_over_full_blocks_only() -> None:
    a = block_keys(list(range(10)), BT)
    assert len(a) == 2  # the trailing 2 tokens make no block
    b = block_keys([0, 1, 2, 3, 4, 5, 6, 99, 8, 9], BT)
    assert a[0] == b[0] and a[1] != b[1]
    c = block_keys([7, 1, 2, 3, 4, 5, 6, 7], BT)
    assert c[1] != a[1]  # same tokens in block 1, different parent


def test_match_is_capped_so_the_last_token_is_computed() -> None:
    tier = _tier(8)
    tokens = list(range(12))
    blocks = _fill(tier, tokens)
    keys = block_keys(tokens, BT)
    assert tier.match(keys, tokens) == blocks[:2]  # 12 tokens: at most 11 may hit -> 2 blocks
    assert tier.match(keys, tokens + [5]) == blocks  # 13 tokens: all 3 blocks
    assert tier.match(keys[:1], tokens[:4]) == []
    assert tier.stats().num_hit_tokens == 2 * BT + 3 * BT


def test_token_comparison_rules_out_a_key_collision() -> None:
    tier = _tier(4)
    tokens = [1, 2, 3, 4, 5]
    keys = block_keys(tokens, BT)
    (b,) = tier.allocate(1)
    tier.cache(b, keys[0], [9, 9, 9, 9])  # same key, other tokens: a collision
    tier.unpin([b])
    assert tier.match(keys, tokens) == []


def test_lru_evicts_the_least_recently_released_unpinned_block() -> None:
    tier = _tier(3)
    evicted: list[int] = []
    tier.on_evict = lambda block_id, key, tokens: evicted.append(tokens[0])
    a, b, c = (_fill(tier, [t] * BT + [0])[0] for t in (10, 20, 30))
    # Use A again: it becomes the most recently released.
    tier.pin([a])
    tier.unpin([a])
    tier.pin([c])  # C is in use: never evicted
    got = tier.allocate(2)
    assert evicted == [20, 10]
    assert sorted(got) == sorted([a, b])
    assert tier.allocate(1) == []  # only the pinned C remains
    assert tier.stats().num_evictions == 2


def test_an_uncached_block_is_freed_on_its_last_unpin() -> None:
    tier = _tier(2)
    blocks = tier.allocate(2)
    assert tier.stats().num_used_blocks == 2 and tier.allocate(1) == []
    tier.unpin(blocks)
    assert tier.stats().num_used_blocks == 0
    (b,) = tier.allocate(1)
    key = block_keys([1, 2, 3, 4], BT)[0]
    assert tier.cache(b, key, [1, 2, 3, 4])
    (b2,) = tier.allocate(1)
    assert not tier.cache(b2, key, [1, 2, 3, 4])  # already cached: b2 stays a private block
    tier.unpin([b2])
    assert tier.stats().num_used_blocks == 1


def test_layer_data_round_trips_through_the_pool() -> None:
    tier = _tier(4)
    blocks = tier.allocate(2)
    k = torch.randn(2 * BT, 1, 2)
    v = torch.randn(2 * BT, 1, 2)
    tier.write_layer(1, blocks[::-1], k, v)
    got_k, got_v = tier.layer_kv(1, blocks[::-1])
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    assert torch.count_nonzero(tier.layer_kv(0, blocks)[0]) == 0


def test_forget_drops_every_key_and_keeps_pinned_blocks_allocated_until_unpinned() -> None:
    """A pipeline stage died with the pool: nothing hits any more; a block a request still pins is
    freed only when its last pin goes (its holder unpins what it pinned)."""
    tier = _tier(4)
    tokens = list(range(12))
    blocks = _fill(tier, tokens)
    held = tier.match(block_keys(tokens, BT), tokens + [0], pin=True)
    assert held == blocks and tier.stats().num_pinned_blocks == 3
    changed: list[int] = []
    tier.on_change = changed.append
    tier.forget()
    assert sorted(changed) == sorted(block_keys(tokens, BT))
    assert tier.match(block_keys(tokens, BT), tokens + [0]) == []
    assert tier.stats().num_used_blocks == 3 and tier.stats().num_pinned_blocks == 3
    tier.unpin(held)
    assert tier.stats().num_used_blocks == 0 and len(tier.allocate(4)) == 4
