"""The engine process: an Engine behind two ZMQ sockets (requests in, responses out).

A thread of its own (`_Intake`) reads the messages as they come, forwards running or not: a
request joins the queue (or is refused at once: admission control), a `Cancel` drops a request
that still waits, and while a forward runs the waiting calls that can no longer meet their
deadline are answered within `SHED_CHECK_S` (`scheduler.late: shed`). The main thread runs one
batch per step and sends each result as soon as it is computed (a batch's results together);
adapter commands run between steps. A request the engine refuses or fails gets a response with
`error` set. Around each forward it sends `Busy` (the forward's predicted end, then 0.0): the API
process refuses a call that cannot even wait that long without asking.

Signals: SIGTERM ends the loop and closes the engine (LMCache included); SIGINT is ignored, since
Ctrl-C reaches the whole process group and the API process, which owns this one, stops it. If the
API process disappears without stopping it (killed), the engine notices and exits.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections import deque
from dataclasses import asdict

import zmq

from tiered.api.protocol import (
    AdapterCommand,
    AdapterReply,
    Busy,
    Cancel,
    EngineStats,
    HostCounters,
    PieceCounters,
    Ready,
    ScoreRequest,
    ScoreResponse,
    decode,
    encode,
)
from tiered.config import Config
from tiered.engine import Engine, Result, ScoreParams
from tiered.hybrid.forward import ForwardInputError
from tiered.hybrid.lora import AdapterError
from tiered.logs import setup as setup_logging
from tiered.request.score import RequestOptions
from tiered.scheduler.step import Refused

log = logging.getLogger(__name__)
STATS_INTERVAL_S = 0.5
SHED_CHECK_S = 0.025  # while a forward runs, how often the intake looks for calls that can no longer be in time
IDLE_WAIT_S = 0.1  # with nothing to do, how long the main thread waits for a request before looking again


class _Stop(Exception):
    pass


def _on_sigterm(signum: int, frame: object) -> None:
    raise _Stop


def serve_engine(config: Config, request_addr: str, response_addr: str, parent: int | None = None) -> None:
    """Run until SIGTERM or until the parent process (`parent`: its pid, as that process read it;
    None: this process's parent now) is gone."""
    setup_logging()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_sigterm)
    parent = os.getppid() if parent is None else parent
    ctx = zmq.Context()
    responses = ctx.socket(zmq.PUSH)
    responses.connect(response_addr)
    try:
        with Engine(config) as engine:
            responses.send(encode(Ready(engine.max_model_len, engine.model.args.vocab_size, asdict(engine.precision))))
            intake = _Intake(engine, ctx, request_addr, response_addr)
            try:
                _loop(engine, intake, responses, parent)
            finally:
                intake.stop()
    except _Stop:
        log.info("SIGTERM: stopping")
    finally:
        ctx.destroy(linger=0)


def _loop(engine: Engine, intake: _Intake, responses: zmq.Socket, parent: int) -> None:
    """The engine's steps, in this (the main) thread: each runs once a request waits; adapter
    commands run between steps."""

    def answer_refused(refused: list[Result]) -> None:  # at once, before the step's forward
        for result in refused:
            responses.send(encode(_response(result)))

    def starting(predicted_seconds: float) -> None:
        intake.busy_until = time.time() + predicted_seconds
        responses.send(encode(Busy(intake.busy_until)))

    reported = 0.0  # when EngineStats were last sent
    while True:
        while intake.commands:
            _adapter_command(engine, intake.commands.popleft(), responses)
        busy = engine.num_unfinished > 0
        if not busy:
            if intake.arrived.wait(IDLE_WAIT_S):
                intake.arrived.clear()
            elif os.getppid() != parent:
                log.warning("the API process is gone; stopping")
                break
        results = engine.step(answer_refused, starting)
        if intake.busy_until:
            intake.busy_until = 0.0
            responses.send(encode(Busy(0.0)))
        now = time.monotonic()
        # Statistics a few times a second while busy, and once when the queue empties; before
        # the answers, so a client that reads /metrics after its answer sees them.
        if (results and (now - reported >= STATS_INTERVAL_S or engine.num_unfinished == 0)) or (
            not busy and now - reported >= 10 * STATS_INTERVAL_S
        ):
            responses.send(encode(_stats(engine)))
            reported = now
        for result in results:
            responses.send(encode(_response(result)))


class _Intake:
    """Reads the API's messages in a thread of its own, so a call is admitted (or refused, at once)
    while a forward runs: requests join the queue, cancels take theirs out, adapter commands wait
    for the main thread (they change what a forward reads). A burst of messages (a scoring call's
    items) enters whole under the engine's lock, so the next pick sees all of it. While a forward
    runs, every `SHED_CHECK_S` it also answers the waiting calls that can no longer meet their
    deadline once the forward's predicted end has passed (`scheduler.late: shed`). Its answers go
    out on a socket of its own."""

    def __init__(self, engine: Engine, ctx: zmq.Context, request_addr: str, response_addr: str) -> None:
        self.engine = engine
        self.commands: deque[AdapterCommand] = deque()  # for the main thread, between steps
        self.arrived = threading.Event()  # a request joined the queue since the main thread looked
        self.busy_until = 0.0  # the running forward's predicted end (time.time()); 0.0: none runs
        self._stopping = threading.Event()
        requests = ctx.socket(zmq.PULL)
        requests.connect(request_addr)
        answers = ctx.socket(zmq.PUSH)
        answers.connect(response_addr)
        self._thread = threading.Thread(target=self._run, args=(requests, answers), name="tiered-intake", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the thread (it closes its sockets)."""
        self._stopping.set()
        self._thread.join(timeout=5.0)

    def _run(self, requests: zmq.Socket, answers: zmq.Socket) -> None:
        try:
            while not self._stopping.is_set():
                try:
                    if requests.poll(int(SHED_CHECK_S * 1e3)):
                        self._drain(requests, answers)
                    if self.busy_until:
                        left = self.busy_until - time.time()
                        for result in self.engine.shed_unreachable(max(0.0, left), overrun=left <= 0):
                            answers.send(encode(_response(result)))
                except zmq.ContextTerminated:
                    return
                except Exception:  # noqa: BLE001 - the intake must outlive any one message
                    log.exception("the engine's intake failed on a message; going on")
        finally:
            requests.close(linger=0)
            answers.close(linger=0)

    def _drain(self, requests: zmq.Socket, answers: zmq.Socket) -> None:
        with self.engine.lock:
            while True:
                try:
                    message = decode(requests.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                if isinstance(message, AdapterCommand):
                    self.commands.append(message)
                else:
                    _handle(self.engine, message, answers)
        self.arrived.set()


def _host_counters(engine: Engine) -> HostCounters | None:
    if engine.tiers.host_tier is None:
        return None
    h = engine.tiers.host_tier.stats()
    return HostCounters(
        h.num_loaded_bytes,
        h.load_seconds,
        h.num_stored_bytes,
        h.store_seconds,
        h.store_thread_cpu_seconds,
        h.num_dropped_chunks,
        h.num_pending_stores,
        h.num_disk_write_failures,
        h.store_wait_seconds,
    )


def _stats(engine: Engine) -> EngineStats:
    from tiered.api.metrics import lmcache_metrics

    host = engine.tiers.host_tier
    adapters = engine.adapters.stats() if engine.adapters is not None else None
    with engine.lock:  # the intake changes the queue meanwhile
        num_waiting, backlog = engine.num_waiting, engine.scheduler.backlog()
    return EngineStats(
        jct_error=engine.jct.error,
        host_failures=host.stats().num_failures if host is not None else 0,
        host=_host_counters(engine),
        pinned_blocks=engine.tiers.device_tier.stats().num_pinned_blocks,
        engine_cancelled=engine.num_cancelled,
        num_waiting=num_waiting,
        predicted_wait_s=backlog,
        adapters=(adapters.num_resident, adapters.num_loads) if adapters is not None else None,
        lmcache_metrics=lmcache_metrics() if host is not None else "",
        pieces=PieceCounters(
            engine.pieces.num_pieces,
            engine.pieces.num_deferrals,
            engine.pieces.parked_device_bytes,
            engine.pieces.parked_host_bytes,
        ),
    )


def _response(result: Result) -> ScoreResponse:
    if result.error is not None:  # shed or past its deadline: 429, the load was too high for it;
        status = 429 if result.expired else 503 if result.unavailable else 500  # a pipeline stage died: 503
        late_since = None if result.late_since is None else time.time() - (time.monotonic() - result.late_since)
        return ScoreResponse(
            request_id=result.request_id,
            error=result.error,
            error_status=status,
            retry_after_s=result.retry_after,
            late_since_unix=late_since,
        )
    return ScoreResponse(
        request_id=result.request_id,
        token_id=result.token_id,
        logprobs=list(result.logprobs.items()),
        top_logprobs=result.top_logprobs,
        num_tokens=result.num_tokens,
        num_device_hit_tokens=result.split.num_device_hit_tokens,
        num_host_hit_tokens=result.split.num_host_hit_tokens,
        num_remote_hit_tokens=result.split.num_remote_hit_tokens,
        num_disk_hit_tokens=result.split.num_disk_hit_tokens,
        num_shared_tokens=result.num_shared_tokens,
        queued_seconds=result.queued_seconds,
        load_seconds=result.load_seconds,
        store_seconds=result.store_seconds,
        compute_seconds=result.compute_seconds,
        num_pieces=result.num_pieces,
        deadline_met=result.deadline_met,
    )


def _adapter_command(engine: Engine, message: AdapterCommand, responses: zmq.Socket) -> None:
    reply = AdapterReply(message.request_id)
    try:
        if message.path is None:
            engine.remove_adapter(message.name)
        else:
            engine.add_adapter(message.name, message.path)
    except (AdapterError, ForwardInputError) as exc:
        reply.error, reply.error_status = str(exc), getattr(exc, "status", 400)
    except Exception as exc:  # noqa: BLE001 - a command must never take the engine down
        log.exception("adapter command for '%s' failed", message.name)
        reply.error, reply.error_status = f"internal error: {type(exc).__name__}: {exc}", 500
    responses.send(encode(reply))


def _handle(engine: Engine, message: ScoreRequest | Cancel, responses: zmq.Socket) -> None:
    if isinstance(message, Cancel):
        if engine.cancel(message.request_id):
            log.info("request %s cancelled while waiting", message.request_id)
        return
    req = message
    params = ScoreParams(
        tuple(req.logprob_token_ids), req.top_logprobs, tuple(req.allowed_token_ids), tuple(req.logit_bias)
    )
    try:
        now = time.monotonic()  # the API's receipt on this process's clock (the same machine or NTP)
        arrival = None if req.arrival_unix is None else now - min(max(0.0, time.time() - req.arrival_unix), 3600.0)
        engine.enqueue(  # the API process checked the call (tiered.request.validation)
            req.token_ids,
            params,
            req.request_id,
            RequestOptions(req.priority, req.cache_salt, req.lora_name, req.slo_ms, arrival),
        )
    except ForwardInputError as exc:
        status = getattr(exc, "status", 400)  # 404: an unknown adapter
        responses.send(encode(ScoreResponse(request_id=req.request_id, error=str(exc), error_status=status)))
    except Refused as exc:  # admission control: 429 (its objective cannot be met) or 503 (over capacity)
        late_since = (
            (req.arrival_unix or time.time()) if exc.reason != "wait_cap" else None
        )  # missed from its receipt on
        refused = ScoreResponse(
            req.request_id,
            error=str(exc),
            error_status=exc.status,
            retry_after_s=exc.retry_after,
            late_since_unix=late_since,
            error_reason=exc.reason,
        )
        responses.send(encode(refused))
