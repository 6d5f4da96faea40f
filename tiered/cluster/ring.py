"""Prefix-affinity routing, without Ray: a consistent-hash ring with a bounded load.

A request's key (the user's id, else its prompt's first blocks) picks a point on the ring; the
request goes to the first replica clockwise whose queued tokens, with this request's, stay within
(1 + epsilon) x an even share of all queued tokens plus the request itself ("consistent hashing
with bounded loads", Mirrokni, Thorup and Zadimoghaddam). So a user's requests go
where the user's KV is cached while that replica keeps up, and spill to the next replica on the
ring (the same one every time, where the remote tier makes the move cheap) when it does not.
Adding or losing a replica moves only the keys whose arc it owned. The Ray Serve router
(`tiered.cluster.router`) and the cluster simulation (`benchmarks.cluster_sim`) both route with
this.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Iterable, Iterator, Mapping, Sequence

VNODES = 64  # points per replica on the ring: keys spread within a few percent of even


def stable_hash(text: str) -> int:
    """A string as a 64-bit int, equal in every process (Python's str hash is salted per process)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


class Ring:
    """Replicas (by name) placed at `vnodes` pseudo-random points each."""

    def __init__(self, members: Iterable[str], vnodes: int = VNODES) -> None:
        self.members = sorted(set(members))
        if not self.members:
            raise ValueError("a ring needs at least one member")
        points = sorted((stable_hash(f"{m}#{i}"), m) for m in self.members for i in range(vnodes))
        self._hashes = [h for h, _ in points]
        self._owners = [m for _, m in points]

    def walk(self, key: int) -> Iterator[str]:
        """Every member once, clockwise from `key`: its owner first."""
        start = bisect.bisect(self._hashes, key % 2**64)
        seen: set[str] = set()
        n = len(self._owners)
        for i in range(n):
            member = self._owners[(start + i) % n]
            if member not in seen:
                seen.add(member)
                yield member
                if len(seen) == len(self.members):
                    return

    def owner(self, key: int) -> str:
        """The member that owns `key`: the first one clockwise from it."""
        return next(self.walk(key))


def bounded_choice(
    ring: Ring, key: int, loads: Mapping[str, float], cost: float, epsilon: float, total: float | None = None
) -> str:
    """The first replica on `key`'s ring walk that can take `cost` more and stay within its
    capacity: (1 + epsilon) x the mean load once this request is placed, plus this request (the
    paper's ceiling, for loads in tokens rather than unit requests). So an idle replica always has
    room, and so does the least loaded one (it is at most the mean), whatever the request's size.
    `total`: the members' summed load, when the caller keeps it (else summed here)."""
    if total is None:
        total = sum(loads.get(m, 0.0) for m in ring.members)
    cap = (1 + epsilon) * (total + cost) / len(ring.members) + cost
    for member in ring.walk(key):
        if loads.get(member, 0.0) + cost <= cap:
            return member
    # Only floating-point rounding gets here: the least loaded, the first such in ring order.
    return min(ring.walk(key), key=lambda m: loads.get(m, 0.0))


def user_key(user: str) -> int:
    """Where a user (`x-user-id`) lands on the ring."""
    return stable_hash(f"user\0{user}")


def route_key(
    token_ids: Sequence[int],
    block_tokens: int,
    affinity_tokens: int,
    user: str | None = None,
    salt: str | None = None,
    adapter: str | None = None,
) -> int:
    """Where on the ring a request lands: its `x-user-id` when the client sent one, else the chained
    key of the prompt's first whole blocks (up to `affinity_tokens`), which is the device tier's
    key of that block: requests that share those blocks share a replica. A prompt shorter than a
    block is keyed by all of it."""
    from tiered.request.tokens import block_keys

    if user:
        return user_key(user)
    head = list(token_ids[: max(block_tokens, affinity_tokens // block_tokens * block_tokens)])
    keys = block_keys(head, block_tokens, salt, adapter)
    return keys[-1] % 2**64 if keys else stable_hash(f"prompt\0{head}\0{salt}\0{adapter}")
