"""Prefix-affinity routing without Ray: the consistent-hash ring, the bounded load, the route key."""

from __future__ import annotations

import random
from collections import Counter

from tiered.cluster.ring import Ring, bounded_choice, route_key
from tiered.request.tokens import block_keys


def test_each_key_has_one_owner_and_keys_spread_evenly() -> None:
    ring = Ring([f"r{i}" for i in range(8)])
    owners = Counter(ring.owner(random.Random(k).getrandbits(64)) for k in range(16000))
    assert set(owners) == set(ring.members)
    assert max(owners.values()) / min(owners.values()) < 1.6  # 64 points each: within tens of percent
    walk = list(ring.walk(12345))
    assert sorted(walk) == ring.members and walk[0] == ring.owner(12345)


def test_adding_or_losing_a_replica_moves_only_its_share_of_keys() -> None:
    keys = [random.Random(k).getrandbits(64) for k in range(8000)]
    before = Ring([f"r{i}" for i in range(8)])
    grown = Ring([f"r{i}" for i in range(9)])
    moved = [k for k in keys if before.owner(k) != grown.owner(k)]
    assert all(grown.owner(k) == "r8" for k in moved)  # a key moves only to the new replica
    assert 0.06 < len(moved) / len(keys) < 0.17  # about 1/9 of them
    shrunk = Ring([f"r{i}" for i in range(8) if i != 3])
    assert all(shrunk.owner(k) == before.owner(k) for k in keys if before.owner(k) != "r3")
    # The lost replica's keys go to the next replica on its ring walk, not anywhere.
    assert all(shrunk.owner(k) == next(m for m in before.walk(k) if m != "r3") for k in keys)


def test_the_bounded_load_keeps_every_replica_within_its_share() -> None:
    ring = Ring([f"r{i}" for i in range(4)])
    loads: dict[str, float] = {}
    hot = 42  # one user sends everything: without the bound, one replica would take it all
    for _ in range(400):
        member = bounded_choice(ring, hot, loads, 100.0, 0.25)
        loads[member] = loads.get(member, 0.0) + 100.0
    total = sum(loads.values())
    assert max(loads.values()) <= 1.25 * total / 4 + 100
    assert set(loads) == set(ring.members)
    # An idle owner takes its key's requests. With four replicas, one request queued on the owner
    # while the others idle is already past 1.25 x 2/4 + 1 requests: the next one takes it.
    for key in range(0, 2**64, 2**58):
        owner = ring.owner(key)
        assert bounded_choice(ring, key, {}, 100.0, 0.25) == owner
        assert bounded_choice(ring, key, {owner: 100.0}, 100.0, 0.25) == next(m for m in ring.walk(key) if m != owner)
        two = Ring(["a", "b"])
        assert bounded_choice(two, key, {two.owner(key): 100.0}, 100.0, 0.25) == two.owner(key)  # 200 <= 225
        assert bounded_choice(two, key, {two.owner(key): 200.0}, 100.0, 0.25) != two.owner(key)  # 300 > 287.5
        # A request far larger than what is queued still goes to its owner: the bound adds the request.
        assert bounded_choice(two, key, {"a": 100.0, "b": 100.0}, 1000.0, 0.25) == two.owner(key)
    order = list(ring.walk(hot))
    busy = {order[0]: 1000.0}  # the owner is far above its share: the next one on the ring
    assert bounded_choice(ring, hot, busy, 100.0, 0.25) == order[1]
    assert bounded_choice(ring, hot, busy, 100.0, 0.25, total=1000.0) == order[1]


def test_the_route_key_is_the_user_else_the_first_blocks() -> None:
    profile = list(range(3, 300))
    a, b = profile + [7, 8], profile + [9]
    assert route_key(a, 16, 256) == route_key(b, 16, 256)  # a shared profile: one replica
    assert route_key(a, 16, 256) == block_keys(profile[:256], 16)[-1] % 2**64  # the device tier's key of block 16
    assert route_key(a, 16, 256) != route_key(list(range(4, 300)), 16, 256)
    assert route_key(a, 16, 256, user="u1") == route_key([5], 16, 256, user="u1")  # x-user-id overrides
    assert route_key(a, 16, 256, user="u1") != route_key(a, 16, 256, user="u2")
    assert route_key(a, 16, 256, salt="s") != route_key(a, 16, 256)  # salted KV is not shared: nor is the key
    assert route_key([5, 6], 16, 256) != route_key([5, 7], 16, 256)  # shorter than a block: all of it
