"""The API process's side of the engine: it runs the engine process (restarting it if it dies),
sends requests and commands over ZMQ (msgpack frames) and matches the answers to them."""

from __future__ import annotations

import asyncio
import logging
import math
import multiprocessing
import os
import signal
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import Any, Protocol, TypeVar

import zmq
import zmq.asyncio

from tiered.api.errors import APIError, ClientGone
from tiered.api.protocol import (
    AdapterCommand,
    AdapterReply,
    Busy,
    Cancel,
    EngineStats,
    Ready,
    ScoreRequest,
    ScoreResponse,
    decode,
    encode,
)
from tiered.config import Config
from tiered.embedded import resolve_model_path

log = logging.getLogger(__name__)
ENGINE_START_TIMEOUT_S = 900
T = TypeVar("T")


class Counts(Protocol):
    """What `wait_answers` needs of a client: its config, and the counters it bumps."""

    config: Config
    cancelled: int
    timed_out: int


async def wait_answers(
    client: Counts, answers: asyncio.Future[T], n: int, disconnected: Callable[[], Awaitable[bool]] | None
) -> T:
    """`answers`' result, unless the client disconnects first (ClientGone) or
    `server.request_timeout_s` runs out (504); either is counted on `client` for its `n` requests.
    The caller cancels what was sent."""
    timeout = client.config.server.request_timeout_s
    deadline = time.monotonic() + timeout if timeout else math.inf
    while True:
        done, _ = await asyncio.wait({answers}, timeout=min(0.25, max(0.0, deadline - time.monotonic())))
        if done:
            return answers.result()
        if disconnected is not None and await disconnected():
            client.cancelled += n
            raise ClientGone
        if time.monotonic() >= deadline:
            client.timed_out += n
            raise APIError(
                504,
                f"the request did not finish within server.request_timeout_s={timeout:g} s; it was cancelled",
                type_="timeout",
            )


def first_error_or_all(futures: list[asyncio.Future[ScoreResponse]]) -> asyncio.Future[list[ScoreResponse]]:
    """A future of the answers of `futures`: all of them, in order, once all are done; the ones
    done so far, in order, as soon as one is an error response; the exception of the first that
    raised (an engine death)."""
    out: asyncio.Future[list[ScoreResponse]] = asyncio.get_running_loop().create_future()
    if not futures:
        out.set_result([])

    def settle(_: object) -> None:
        if out.done():
            return
        done = [f for f in futures if f.done() and not f.cancelled()]
        raised = next((e for f in done if (e := f.exception()) is not None), None)
        if raised is not None:
            out.set_exception(raised)
        elif len(done) == len(futures) or any(f.result().error is not None for f in done):
            out.set_result([f.result() for f in done])

    for f in futures:
        f.add_done_callback(settle)
    return out


def served_config(config: Config) -> Config:
    """`config` with `model.path` resolved to the checkpoint's folder, as the engine process loads it."""
    folder = resolve_model_path(config.model.path, config.model.models_dir)
    return replace(config, model=replace(config.model, path=str(folder)))


def run_engine(
    config: Config, request_addr: str, response_addr: str, parent: int, go: Connection | None = None
) -> None:
    """The engine process's entry point (`parent`: the API process's pid). The engine's modules are
    imported here, in that process: the API process that spawns it never loads them. With `go`, it
    imports them (and LMCache's, where the host tier is on), then waits for a message on `go`
    before it starts anything, or returns if the API process is gone first (the pipe's end)."""
    # Ctrl-C reaches every process of the terminal's group: the API process stops this one.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from tiered.api.engine_process import serve_engine

    if go is not None:
        if config.cache.host.enabled:
            from tiered.offload.lmcache_setup import import_lmcache

            import_lmcache()
        try:
            go.recv()
        except EOFError:
            return
        go.close()
    serve_engine(config, request_addr, response_addr, parent)


class EngineClient:
    """Runs the engine process (restarting it if it dies) and matches its responses to requests.
    `config` as `served_config` gives it."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.ctx = zmq.asyncio.Context()
        self.requests = self.ctx.socket(zmq.PUSH)
        self.responses = self.ctx.socket(zmq.PULL)
        req_port = self.requests.bind_to_random_port("tcp://127.0.0.1")
        resp_port = self.responses.bind_to_random_port("tcp://127.0.0.1")
        self._addrs = (f"tcp://127.0.0.1:{req_port}", f"tcp://127.0.0.1:{resp_port}")
        self.process: multiprocessing.process.BaseProcess | None = None
        self.pending: dict[str, asyncio.Future[Any]] = {}  # ScoreResponse or AdapterReply
        self.adapters: dict[str, str] = dict(config.lora.modules)  # served LoRA adapters: name -> folder
        self._commands: dict[str, AdapterCommand] = {}  # adapter commands sent, by id, until answered
        self.ready: Ready | None = None
        self.stats: EngineStats | None = None  # the engine's statistics as it last reported them
        # When the forward running now is predicted to end (time.time()); 0.0: none runs
        self.busy_until = 0.0
        self.restarts = 0
        self.cancelled = 0
        self.timed_out = 0
        self._ready_event = asyncio.Event()
        self._reader: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._stopping = False
        # The API process's end of a held engine process's pipe (`spawn(hold=True)`), until `release`
        self._go: Connection | None = None

    def _spawn(self, go: Connection | None = None) -> None:
        self.ready = None
        self.busy_until = 0.0
        self._ready_event.clear()
        # A restarted engine serves the adapters loaded at runtime too (those still readable).
        if self.restarts:
            self._drop_unreadable_adapters()
        config = replace(self.config, lora=replace(self.config.lora, modules=dict(self.adapters)))
        # A daemonic process may not start children, and with pipeline stages the engine starts them;
        # `stop` ends it either way, and it exits by itself once the API process is gone.
        self.process = multiprocessing.get_context("spawn").Process(
            target=run_engine,
            args=(config, *self._addrs, os.getpid(), go),
            name="tiered-engine",
            daemon=config.engine.pipeline_stages == 1,
        )
        self.process.start()

    async def _wait_ready(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + ENGINE_START_TIMEOUT_S
        while not self._ready_event.is_set():
            if not self.process.is_alive():
                raise RuntimeError(f"the engine process exited during start-up (code {self.process.exitcode})")
            if time.monotonic() > deadline:
                raise RuntimeError("the engine process did not become ready in time")
            try:
                await asyncio.wait_for(self._ready_event.wait(), 0.5)
            except TimeoutError:
                pass

    def spawn(self, hold: bool = False) -> None:
        """Start the engine process now, before `start`, so that it works while this process goes
        on (`tiered serve` checks its options and builds the HTTP app meanwhile); its answers wait
        in the socket until `start` reads them. `hold`: it only imports its modules until `release`."""
        if self.process is not None:
            return
        if not hold:
            self._spawn()
            return
        theirs, self._go = multiprocessing.get_context("spawn").Pipe(duplex=False)
        self._spawn(theirs)
        theirs.close()  # the child has its own copy: the pipe ends when this process's end closes

    def release(self) -> None:
        """Let a held engine process start."""
        if self._go is not None:
            self._go.send(True)
            self._go.close()
            self._go = None

    async def start(self) -> None:
        """Start reading responses and the engine process (unless `spawn` did, then release it),
        wait until it is ready, then watch it."""
        self._reader = asyncio.create_task(self._read())
        self.spawn()
        self.release()
        await self._wait_ready()
        self._watchdog = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        """A dead engine process fails its waiting requests with 503, then is replaced."""
        while not self._stopping:
            await asyncio.sleep(0.2)
            if self.process is None or self.process.is_alive():
                continue
            log.error("the engine process exited (code %s)", self.process.exitcode)
            self.ready = None
            for future in self.pending.values():
                if not future.done():
                    future.set_exception(APIError(503, "the engine process exited", type_="service_unavailable"))
            self.pending.clear()
            if not self.config.server.restart_engine:
                return
            self.restarts += 1
            log.warning("starting a new engine process (restart %d)", self.restarts)
            try:
                self._spawn()
                await self._wait_ready()
                log.info("the engine process serves again")
            except RuntimeError as exc:
                log.error("the new engine process did not start (%s); not serving", exc)
                return

    def _drop_unreadable_adapters(self) -> None:
        """Adapters whose folder fails its check now would stop the new engine from starting."""
        from tiered.hybrid.loader import read_args
        from tiered.hybrid.lora import AdapterError, read_adapter

        args = read_args(self.config.model.path)
        for name, path in list(self.adapters.items()):
            try:
                read_adapter(name, path, args, self.config.lora.max_lora_rank)
            except AdapterError as exc:
                log.error("not serving adapter '%s' after the restart: %s", name, exc)
                del self.adapters[name]

    async def _read(self) -> None:
        while True:
            message = decode(await self.responses.recv())
            if isinstance(message, Busy):
                self.busy_until = message.until_unix
                continue
            if isinstance(message, Ready):
                self.busy_until = 0.0  # a new engine runs nothing yet
                self.ready = message
                self._ready_event.set()
                continue
            if isinstance(message, EngineStats):
                self.stats = message
                continue
            if isinstance(message, AdapterReply):  # the engine's state, even if the caller gave up waiting
                command = self._commands.pop(message.request_id, None)
                if command is not None and message.error is None:
                    if command.path is None:
                        self.adapters.pop(command.name, None)
                    else:
                        self.adapters[command.name] = command.path
            if isinstance(message, ScoreResponse) and message.late_since_unix is not None:
                message.shed_delay_s = max(0.0, time.time() - message.late_since_unix)  # this host's clock
            future = self.pending.pop(message.request_id, None)
            if future is not None and not future.done():
                future.set_result(message)

    @property
    def gave_up(self) -> bool:
        """The engine process died and will not be replaced (restarts off, or the new one failed)."""
        return self._watchdog is not None and self._watchdog.done() and not self.alive

    @property
    def alive(self) -> bool:
        """The engine process runs and has reported that it is ready."""
        return self.ready is not None and self.process is not None and self.process.is_alive()

    async def run(
        self, reqs: list[ScoreRequest], disconnected: Callable[[], Awaitable[bool]] | None = None
    ) -> list[ScoreResponse]:
        """Send requests together and wait for their answers: all of them, in order, or, once one
        is an error (a call fails as a whole on its first), the answers so far, in order.

        The requests still unanswered then, past `server.request_timeout_s` (504), or when the
        client disconnects are cancelled in the engine (they leave its queue; one already
        computing finishes and its answer is dropped)."""
        loop = asyncio.get_running_loop()
        futures = []
        for r in reqs:
            future: asyncio.Future[ScoreResponse] = loop.create_future()
            self.pending[r.request_id] = future
            futures.append(future)
        answered = first_error_or_all(futures)
        try:
            for r in reqs:
                await self.requests.send(encode(r))
            outs = await wait_answers(self, answered, len(reqs), disconnected)
            self.cancelled += len(reqs) - len(outs)  # cancelled as their call failed
            return outs
        finally:
            if answered.done():
                answered.exception()  # retrieved: it may have settled as the wait gave up (504, a disconnect)
            else:
                answered.cancel()
            for future in futures:
                if future.done() and not future.cancelled():
                    future.exception()  # retrieved: an engine death answered it
            # All taken out of `pending` before the first await, so that none stays there if this
            # task is cancelled while it sends the cancellations.
            unanswered = [r.request_id for r in reqs if self.pending.pop(r.request_id, None) is not None]
            if self.alive:
                for request_id in unanswered:
                    await self.requests.send(encode(Cancel(request_id)))

    async def adapter(self, name: str, path: str | None) -> AdapterReply:
        """Load (`path`) or unload (None) a LoRA adapter in the engine; its reply."""
        command = AdapterCommand(uuid.uuid4().hex, name, path)
        future: asyncio.Future[AdapterReply] = asyncio.get_running_loop().create_future()
        self.pending[command.request_id] = future
        self._commands[command.request_id] = command
        try:
            await self.requests.send(encode(command))
            return await asyncio.wait_for(future, 60)
        except TimeoutError:
            raise APIError(
                504, f"the engine did not answer the adapter command for '{name}' in 60 s", type_="timeout"
            ) from None
        finally:
            self.pending.pop(command.request_id, None)

    def full(self, incoming: int) -> bool:
        """Whether `incoming` more requests would put the unanswered ones past `scheduler.max_waiting`."""
        return len(self.pending) + incoming > self.config.scheduler.max_waiting

    def stop(self) -> None:
        """Stop reading and watching, end the engine process (SIGTERM, killed after 30 s), close the sockets."""
        self._stopping = True
        for task in (self._reader, self._watchdog):
            if task is not None:
                task.cancel()
        if self._go is not None:  # a held engine process that was never let start
            self._go.close()
            self._go = None
        if self.process is not None and self.process.is_alive():
            self.process.terminate()  # SIGTERM: the engine closes its tiers and exits
            self.process.join(30)
            if self.process.is_alive():
                log.warning("the engine process did not stop in 30 s; killing it")
                self.process.kill()
                self.process.join(5)
        self.ctx.destroy(linger=0)
