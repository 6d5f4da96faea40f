"""`tiered serve --replicas N` on Ray Serve: N engine replicas and one OpenAI-compatible ingress.

Design notes: docs/internals.md, section `tiered/cluster/deploy.py`.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from dataclasses import replace
from typing import Any

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from tiered.api.engine_client import served_config
from tiered.api.errors import APIError
from tiered.api.protocol import decode, encode
from tiered.config import Config, ConfigError
from tiered.logs import setup_ours

log = logging.getLogger(__name__)
APP_NAME = "tiered"
ROUTING_STATS_PERIOD_S = 1.0  # how often replicas report their statistics (the ingress's /metrics)


class EngineReplica:
    """One engine (process) behind Ray Serve; the ingress calls `run` with a call's requests."""

    async def __init__(self, config: Config) -> None:  # type: ignore[misc]  # Ray Serve awaits it
        from tiered.api.engine_client import EngineClient

        setup_ours()
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.client = EngineClient(config)
        await self.client.start()
        log.info("replica %s serves (engine pid %s)", self.replica, self.client.process and self.client.process.pid)

    async def run(self, frames: list[bytes], route: tuple[int, int]) -> dict[str, Any]:
        """Score a call's requests together; `route` is the router's (unused here)."""
        try:
            outs = await self.client.run([decode(f) for f in frames])
        except APIError as exc:
            return {"replica": self.replica, "error": (exc.status, exc.message, exc.type)}
        return {"replica": self.replica, "outs": [encode(o) for o in outs]}

    def info(self) -> dict[str, Any]:
        """This replica's ids and its engine's limits (max_model_len, vocab_size, precision), for the ingress."""
        ready = self.client.ready
        engine = self.client.process
        return {
            "replica": self.replica,
            "pid": os.getpid(),
            "engine_pid": engine.pid if engine else None,
            "max_model_len": ready.max_model_len if ready else 0,
            "vocab_size": ready.vocab_size if ready else 0,
            "precision": ready.precision if ready else {},
        }

    def check_health(self) -> None:
        """Ray Serve's health check: fails once the engine is gone for good, so Ray replaces the replica."""
        if self.client.gave_up:
            raise RuntimeError("the engine process is gone and was not replaced")

    def record_routing_stats(self) -> dict[str, Any]:
        """Ray Serve's routing statistics: the engine's stats (encoded) and restarts, for /metrics."""
        stats = self.client.stats
        return {"stats": encode(stats) if stats is not None else None, "restarts": self.client.restarts}

    def __del__(self) -> None:  # Ray Serve's graceful shutdown of a replica
        client = getattr(self, "client", None)
        if client is not None:
            client.stop()


class Ingress:
    """The OpenAI-compatible app, over the engine replicas."""

    def __init__(self, engines: Any, config: Config, app_kwargs: dict[str, Any]) -> None:
        from tiered.cluster.client import ReplicaClient

        setup_ours()
        self.config, self.app_kwargs = config, app_kwargs
        self.client = ReplicaClient(engines, config)

    def __serve_build_asgi_app__(self) -> Any:
        from tiered.api.app import build_app
        from tiered.cluster.client import RouteHeaders

        app = build_app(self.config, client=self.client, **self.app_kwargs)
        app.add_middleware(RouteHeaders)
        return app


def replica_config(config: Config) -> Config:
    """The config each replica's engine runs: the model resolved once (an embedded model is made
    here, not by every replica at once), torch threads = the replica's CPUs unless set."""
    threads = config.engine.threads or max(1, int(config.cluster.cpus_per_replica))
    return served_config(replace(config, engine=replace(config.engine, threads=threads)))


def build(config: Config, app_kwargs: dict[str, Any] | None = None) -> Any:
    """The Ray Serve application (not yet running)."""
    c = config.cluster
    if config.lora.allow_runtime_updates:
        raise ConfigError(
            "lora.allow_runtime_updates: runtime LoRA updates are not available with replicas; "
            "list the adapters in lora.modules (--lora-modules)"
        )
    gpus = c.gpus_per_replica if c.gpus_per_replica is not None else (1.0 if config.device.startswith("cuda") else 0.0)
    router_fields: dict[str, Any] = {
        "request_router_class": "tiered.cluster.router.AffinityRouter",
        "request_router_kwargs": {"policy": c.routing, "load_factor": c.load_factor},
        "request_routing_stats_period_s": ROUTING_STATS_PERIOD_S,
    }
    router = RequestRouterConfig(**router_fields)
    engine: Any = serve.deployment(
        EngineReplica,
        name="EngineReplica",
        num_replicas=c.replicas,
        ray_actor_options={"num_cpus": c.cpus_per_replica, "num_gpus": gpus},
        # The engine queues and batches; Ray should not hold calls back from it.
        max_ongoing_requests=max(config.scheduler.max_waiting, 1),
        health_check_period_s=c.health_check_period_s,
        health_check_timeout_s=c.health_check_timeout_s,
        request_router_config=router,
    )
    ingress: Any = serve.deployment(
        serve.ingress()(Ingress),
        name="Ingress",
        num_replicas=1,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=max(config.scheduler.max_waiting * c.replicas, 1) + 64,
    )
    cfg = replica_config(config)
    return ingress.bind(engine.bind(cfg), cfg, app_kwargs or {})


def deploy(config: Config, host: str = "127.0.0.1", port: int = 8000, app_kwargs: dict[str, Any] | None = None) -> str:
    """Join the Ray cluster at `config.cluster.address` (None: start one on this machine), deploy
    the replicas and the ingress, and return the ingress's URL once every replica serves."""
    if not ray.is_initialized():
        ray.init(address=config.cluster.address, include_dashboard=False, configure_logging=False, log_to_driver=True)
    serve.start(http_options={"host": host, "port": port})
    serve.run(build(config, app_kwargs), name=APP_NAME, route_prefix="/")
    url = f"http://{host}:{port}"
    log.info(
        "%d engine replica(s) serve at %s (Ray Serve; routing: %s)",
        config.cluster.replicas,
        url,
        config.cluster.routing,
    )
    return url


def shutdown() -> None:
    """Take the app, Serve and Ray (if this process started or joined it) down; a no-op once done."""
    if not ray.is_initialized():
        return
    serve.shutdown()
    ray.shutdown()


def serve_until_stopped(config: Config, host: str, port: int, app_kwargs: dict[str, Any] | None = None) -> None:
    """`tiered serve --replicas N`: deploy, then wait for SIGINT/SIGTERM and take everything down."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    deploy(config, host, port, app_kwargs)
    try:
        stop.wait()
    finally:
        log.info("stopping the replicas")
        shutdown()
