"""The ingress's side of the engine replicas: the serving layer's `Client`, over a Ray Serve handle.

`tiered serve` talks to one engine process (`EngineClient`); with replicas, the ingress runs the
same app (`build_app`: routes, errors, metrics) with a `ReplicaClient` instead. Each call's
prompts travel together to one replica (so they batch there), chosen by the router from
`route=(key, tokens)`. A replica that dies while it holds a call is retried once on another;
if that fails too, the call gets a 503. Either way each request is answered once.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from contextvars import ContextVar
from dataclasses import fields
from typing import Any

from ray.exceptions import ActorUnavailableError, RayActorError

from tiered.api.engine_client import wait_answers
from tiered.api.errors import APIError
from tiered.api.protocol import (
    AdapterReply,
    EngineStats,
    HostCounters,
    Ready,
    ScoreRequest,
    ScoreResponse,
    decode,
    encode,
)
from tiered.cluster.ring import route_key
from tiered.config import Config

log = logging.getLogger(__name__)

# Per HTTP request: the client's x-user-id, and the replica that answered (x-tiered-replica).
ROUTE: ContextVar[dict[str, str | None] | None] = ContextVar("tiered_route", default=None)
READY_TIMEOUT_S = 900
ROUTER_SYNC_TIMEOUT_S = 60
# This process's request routers (`tiered.cluster.router.AffinityRouter` registers itself).
ROUTERS: weakref.WeakSet[Any] = weakref.WeakSet()


def reports() -> dict[str, dict[str, Any]]:
    """What each running replica last reported through Ray's routing statistics
    (`EngineReplica.record_routing_stats`), by replica id."""
    return {
        rid.unique_id: dict(replica.routing_stats or {})
        for router in list(ROUTERS)
        for rid, replica in router.curr_replicas.items()
    }


class RouteHeaders:
    """Pure ASGI middleware: reads x-user-id for the router; names the replica that answered in
    the response's x-tiered-replica header."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        user = dict(scope["headers"]).get(b"x-user-id")
        route: dict[str, str | None] = {"user": user.decode(errors="replace") if user else None, "replica": None}
        ROUTE.set(route)

        async def send_named(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start" and route["replica"]:
                message = {
                    **message,
                    "headers": [*message.get("headers", []), (b"x-tiered-replica", route["replica"].encode())],
                }
            await send(message)

        await self.app(scope, receive, send_named)


def merge_stats(reports: list[EngineStats]) -> EngineStats | None:
    """The replicas' statistics as one engine's: counters and gauges summed, the JCT error averaged.
    LMCache's own metrics are left out (each replica's would repeat the same families)."""
    if not reports:
        return None
    errors = [s.jct_error for s in reports if s.jct_error is not None]
    hosts = [s.host for s in reports if s.host is not None]
    adapters = [s.adapters for s in reports if s.adapters is not None]
    return EngineStats(
        jct_error=sum(errors) / len(errors) if errors else None,
        host_failures=sum(s.host_failures for s in reports),
        host=HostCounters(*(sum(getattr(h, f.name) for h in hosts) for f in fields(HostCounters))) if hosts else None,
        pinned_blocks=sum(s.pinned_blocks for s in reports),
        engine_cancelled=sum(s.engine_cancelled for s in reports),
        num_waiting=sum(s.num_waiting for s in reports),
        adapters=(sum(a[0] for a in adapters), sum(a[1] for a in adapters)) if adapters else None,
        # the wait a new call would see: the least loaded replica's (the router spreads calls)
        predicted_wait_s=min(s.predicted_wait_s for s in reports),
    )


class ReplicaClient:
    """`tiered.api.serving.Client` for N engine replicas behind a Ray Serve deployment handle."""

    def __init__(self, handle: Any, config: Config) -> None:
        self.handle, self.config = handle, config
        self.ready: Ready | None = None
        self.adapters: dict[str, str] = dict(config.lora.modules)
        self.pending: dict[str, Any] = {}
        self.timed_out = self.cancelled = 0
        # The replicas' forwards are not reported here: each replica's engine sheds at its next step.
        self.busy_until = 0.0

    @property
    def stats(self) -> EngineStats | None:
        """The replicas' last reported statistics, merged as one engine's (None if none reported)."""
        return merge_stats([decode(r["stats"]) for r in reports().values() if r.get("stats")])

    @property
    def restarts(self) -> int:  # engine processes restarted inside the replicas
        """Engine processes restarted inside the replicas, summed over their last reports."""
        return sum(int(r.get("restarts", 0)) for r in reports().values())

    @property
    def alive(self) -> bool:
        """Whether a replica has answered `start`'s `info` call."""
        return self.ready is not None

    @property
    def num_replicas(self) -> int:
        """Engine replicas this ingress routes to now."""
        return sum(len(router.curr_replicas) for router in list(ROUTERS))

    async def start(self) -> None:
        """Until a replica answers, then until the router knows all `cluster.replicas` of them (Ray
        tells each handle of new replicas a little after they start), so /health's 200 means
        every replica takes calls."""
        info = await asyncio.wait_for(self.handle.info.remote(), READY_TIMEOUT_S)
        self.ready = Ready(info["max_model_len"], info["vocab_size"], info.get("precision", {}))
        deadline = time.monotonic() + ROUTER_SYNC_TIMEOUT_S
        while self.num_replicas < self.config.cluster.replicas:
            if time.monotonic() > deadline:
                log.warning("serving with %d of %d replicas", self.num_replicas, self.config.cluster.replicas)
                break
            await asyncio.sleep(0.1)

    def stop(self) -> None:
        """Nothing to do: Ray Serve stops the replicas."""
        pass  # Ray Serve stops the replicas

    def full(self, incoming: int) -> bool:
        """Whether `incoming` more requests would pass `scheduler.max_waiting` summed over the replicas."""
        return len(self.pending) + incoming > self.config.scheduler.max_waiting * self.config.cluster.replicas

    async def run(self, reqs: list[ScoreRequest], disconnected: Any = None) -> list[ScoreResponse]:
        """Send a call's requests to the replica the router picks; retried once elsewhere if that one dies."""
        route = ROUTE.get() or {}
        first = reqs[0]
        c = self.config
        key = route_key(
            first.token_ids,
            c.cache.block_tokens,
            c.cluster.affinity_tokens,
            route.get("user"),
            first.cache_salt,
            first.lora_name,
        )
        frames = [encode(r) for r in reqs]
        tokens = sum(len(r.token_ids) for r in reqs)
        for r in reqs:
            self.pending[r.request_id] = r
        try:
            for attempt in (1, 2):
                call = self.handle.run.remote(frames, route=(key, tokens))
                answer = asyncio.ensure_future(call)  # a DeploymentResponse is awaitable
                try:
                    reply = await wait_answers(self, answer, len(reqs), disconnected)
                except RayActorError as exc:  # the replica died (ActorDiedError): nothing runs there any more
                    if attempt == 2:
                        raise APIError(
                            503,
                            "the engine replica serving this request died, and so did the one it was "
                            "retried on; retry shortly",
                            type_="service_unavailable",
                        ) from None
                    log.warning(
                        "an engine replica died holding %d request(s) (%s); retrying them on another",
                        len(reqs),
                        type(exc).__name__,
                    )
                    continue
                except ActorUnavailableError:  # unreachable for now, maybe still computing: not retried
                    call.cancel()
                    raise APIError(
                        503,
                        "the engine replica serving this request is unreachable; retry shortly",
                        type_="service_unavailable",
                    ) from None
                except BaseException:
                    call.cancel()  # Ray Serve cancels it in the replica, which cancels it in its engine
                    answer.cancel()
                    raise
                if route:
                    route["replica"] = reply["replica"]
                if reply.get("error"):
                    status, message, type_ = reply["error"]
                    raise APIError(status, message, type_=type_)
                return [decode(f) for f in reply["outs"]]
            raise AssertionError("unreachable")
        finally:
            for r in reqs:
                self.pending.pop(r.request_id, None)

    async def adapter(self, name: str, path: str | None) -> AdapterReply:
        """Refused (501): runtime LoRA updates are not available with replicas."""
        raise APIError(
            501,
            "runtime LoRA updates are not available with replicas: list the adapters in lora.modules (--lora-modules)",
            type_="not_implemented",
        )
