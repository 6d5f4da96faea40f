"""The engine deployment's Ray Serve request router: prefix affinity with a bounded load.

It runs in the ingress replica, inside its handle to the engine replicas. A request sent with
`route=(key, tokens)` (the ingress computes both, `tiered.cluster.ring.route_key`) goes to the
replica that owns `key` on a consistent-hash ring of the running replicas, unless that replica's
queued tokens would go past (1 + load_factor) x an even share, rounded up to whole requests; then
to the next replica on the ring that has room. Queued tokens are counted here, from what this router sent and what has
come back (exact with one ingress replica, which is what `deploy` starts). With
`policy="round_robin"` it cycles through the replicas instead (the baseline of the benchmarks).

Ray pickles this module by value into the ingress (a custom router's module is), so it keeps no
state of its own at module level: each router registers in `tiered.cluster.client.ROUTERS`, where
the ingress's /metrics reads what the replicas last reported through Ray's routing statistics.
"""

from __future__ import annotations

import itertools
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from tiered.cluster.ring import Ring, bounded_choice


class AffinityRouter(RequestRouter):
    def initialize_state(self, policy: str = "affinity", load_factor: float = 0.25, **_: Any) -> None:
        self.policy, self.load_factor = policy, load_factor
        self.queued: dict[str, float] = {}  # replica id -> tokens routed there and not answered yet
        self.routed: dict[str, tuple[str, float]] = {}  # internal request id -> (replica id, tokens)
        self._ring: Ring | None = None
        self._turn = itertools.count()
        from tiered.cluster import client  # imported, not pickled with this module: the ingress's own

        client.ROUTERS.add(self)

    def ring(self, ids: list[str]) -> Ring:
        if self._ring is None or self._ring.members != sorted(ids):
            self._ring = Ring(ids)
        return self._ring

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        route = pending_request.kwargs.get("route") if pending_request is not None else None
        if route is None or not candidate_replicas:  # a request that is not a score (health, info)
            return [candidate_replicas]
        key, tokens = route
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        if self.policy == "round_robin":
            ids = sorted(by_id)
            turn = next(self._turn) % len(ids)
            order = ids[turn:] + ids[:turn]
            chosen = order[0]
        else:
            ring = self.ring(list(by_id))
            chosen = bounded_choice(ring, int(key), self.queued, float(tokens), self.load_factor)
            order = list(ring.walk(int(key)))
        assert pending_request is not None
        self._record(pending_request.metadata.internal_request_id, chosen, float(tokens))
        # The chosen replica first; should it refuse (full), the others in ring order.
        return [[by_id[chosen]], [by_id[r] for r in order if r != chosen]]

    def _record(self, request_id: str, replica: str, tokens: float) -> None:
        self._forget(request_id)  # routed again (its first replica refused it or died)
        self.routed[request_id] = (replica, tokens)
        self.queued[replica] = self.queued.get(replica, 0.0) + tokens

    def _forget(self, request_id: str) -> None:
        previous = self.routed.pop(request_id, None)
        if previous is not None:
            replica, tokens = previous
            self.queued[replica] = max(0.0, self.queued.get(replica, 0.0) - tokens)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._forget(internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.queued.pop(replica_id.unique_id, None)
