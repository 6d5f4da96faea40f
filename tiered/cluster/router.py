"""The engine deployment's Ray Serve request router: prefix affinity with a bounded load.

Design notes: docs/internals.md, section `tiered/cluster/router.py`.
"""

from __future__ import annotations

import itertools
import random
import time
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from tiered.cluster.ring import Ring, bounded_choice

PRUNE_PERIOD_S = 1.0


class AffinityRouter(RequestRouter):
    """Ray Serve request router: a bounded-load consistent-hash ring over the replicas, or round robin."""

    def initialize_state(self, policy: str = "affinity", load_factor: float = 0.25, **_: Any) -> None:
        """Ray Serve's setup hook: the policy, the per-replica token counts, registration in ROUTERS."""
        self.policy, self.load_factor = policy, load_factor
        self.queued: dict[str, float] = {}  # replica id -> tokens routed there and not answered yet
        # internal request id -> (replica id, tokens, the pending request while it is being routed)
        self.routed: dict[str, tuple[str, float, PendingRequest]] = {}
        self._ring: Ring | None = None
        self._turn = itertools.count()
        self._pruned = time.monotonic()
        from tiered.cluster import client  # imported, not pickled with this module: the ingress's own

        client.ROUTERS.add(self)

    def ring(self, ids: list[str]) -> Ring:
        """The ring over `ids`, rebuilt only when the set of replicas changes."""
        if self._ring is None or self._ring.members != sorted(ids):
            self._ring = Ring(ids)
        return self._ring

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        """Rank replicas for a call: the chosen one, then the others (any order for a call without a route)."""
        if pending_request is not None:
            # Every replica is in the ranks below: when none has room, wait before asking again.
            pending_request.routing_context.should_backoff = True
        route = pending_request.kwargs.get("route") if pending_request is not None else None
        if route is None or pending_request is None or not candidate_replicas:  # not a score: any replica
            return [random.sample(candidate_replicas, len(candidate_replicas))]
        self._prune()
        key, tokens = int(route[0]), float(route[1])
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        if self.policy == "round_robin":
            ids = sorted(by_id)
            turn = next(self._turn) % len(ids)
            order = ids[turn:] + ids[:turn]
            chosen = order[0]
        else:
            ring = self.ring(list(by_id))
            chosen = bounded_choice(ring, key, self.queued, tokens, self.load_factor)
            order = list(ring.walk(key))
        self._record(pending_request, chosen, tokens)
        # The chosen replica; should it refuse the call or be gone, any other (Ray takes the least busy).
        return [[by_id[chosen]], [by_id[r] for r in order if r != chosen]]

    def _record(self, pending: PendingRequest, replica: str, tokens: float) -> None:
        request_id = pending.metadata.internal_request_id
        self._forget(request_id)  # routed again (its first replica refused it or died)
        self.routed[request_id] = (replica, tokens, pending)
        self.queued[replica] = self.queued.get(replica, 0.0) + tokens

    def _forget(self, request_id: str) -> None:
        previous = self.routed.pop(request_id, None)
        if previous is not None:
            replica, tokens, _ = previous
            self.queued[replica] = max(0.0, self.queued.get(replica, 0.0) - tokens)

    def _prune(self) -> None:
        """Drop the records of calls cancelled while they were being routed (no completion comes)."""
        now = time.monotonic()
        if now - self._pruned < PRUNE_PERIOD_S:
            return
        self._pruned = now
        for request_id, (_, _, pending) in list(self.routed.items()):
            if pending.future.cancelled():
                self._forget(request_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """Ray Serve's callback when a call ends: its tokens leave its replica's count."""
        self._forget(internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        """Ray Serve's callback when a replica dies: its queued tokens are forgotten."""
        super().on_replica_actor_died(replica_id)
        self.queued.pop(replica_id.unique_id, None)
