"""The API process's engine client over real ZMQ sockets, the engine's side played by the test: a
call's requests are answered together, and a call fails as a whole on its first error without
waiting for its other requests, which are cancelled in the engine. A held engine process whose
API process is gone exits."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import zmq
import zmq.asyncio

from tiered.api.engine_client import EngineClient, first_error_or_all
from tiered.api.protocol import Cancel, Ready, ScoreRequest, ScoreResponse, decode, encode
from tiered.config import load_config


def _ok(rid: str) -> ScoreResponse:
    return ScoreResponse(rid, token_id=7, num_tokens=2)


def _refused(rid: str) -> ScoreResponse:
    return ScoreResponse(rid, error="objective unmeetable", error_status=400, error_reason="unmeetable")


def test_answers_wait_for_all_in_order_unless_one_is_an_error() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in range(3)]
        out = first_error_or_all(futures)
        futures[2].set_result(_ok("c"))
        futures[0].set_result(_ok("a"))
        await asyncio.sleep(0)
        assert not out.done()  # "b" is still to come
        futures[1].set_result(_ok("b"))
        assert [r.request_id for r in await asyncio.wait_for(out, 1)] == ["a", "b", "c"]

        futures = [loop.create_future() for _ in range(3)]
        out = first_error_or_all(futures)
        futures[2].set_result(_ok("c"))
        futures[1].set_result(_refused("b"))
        assert [r.request_id for r in await asyncio.wait_for(out, 1)] == ["b", "c"]  # "a" not waited for
        futures[0].set_result(_ok("a"))  # a late answer changes nothing
        await asyncio.sleep(0)

        futures = [loop.create_future() for _ in range(2)]
        out = first_error_or_all(futures)
        futures[1].set_exception(RuntimeError("the engine process exited"))
        with pytest.raises(RuntimeError, match="exited"):
            await asyncio.wait_for(out, 1)
        assert await asyncio.wait_for(first_error_or_all([]), 1) == []

    asyncio.run(main())


def test_a_call_fails_on_its_first_error_and_its_other_requests_are_cancelled(tiny_dir: Path) -> None:
    async def main() -> None:
        client = EngineClient(load_config(None, [f"model.path={tiny_dir}"]))
        # The engine's side: this test reads the requests and answers them, over the client's sockets.
        ctx = zmq.asyncio.Context()
        inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        inbox.connect(client._addrs[0])
        outbox.connect(client._addrs[1])
        client.ready = Ready(64, 2048)
        client.process = SimpleNamespace(is_alive=lambda: True)  # type: ignore[assignment]  # no process here
        reader = asyncio.create_task(client._read())
        try:
            reqs = [ScoreRequest(f"r{i}", [1, 2], [], 0, [], []) for i in range(4)]
            call = asyncio.create_task(client.run(reqs))
            sent = [decode(await inbox.recv()) for _ in reqs]
            assert [r.request_id for r in sent] == ["r0", "r1", "r2", "r3"]
            await outbox.send(encode(_ok("r0")))
            await outbox.send(encode(_refused("r2")))
            outs = await asyncio.wait_for(call, 5)  # without r1 and r3
            assert [(o.request_id, o.error) for o in outs] == [("r0", None), ("r2", "objective unmeetable")]
            cancels = [decode(await asyncio.wait_for(inbox.recv(), 5)) for _ in range(2)]
            assert all(isinstance(c, Cancel) for c in cancels)
            assert sorted(c.request_id for c in cancels) == ["r1", "r3"] and client.pending == {}
            assert client.cancelled == 2  # counted as cancelled: their call failed
            await outbox.send(encode(_ok("r1")))  # an answer after its call was answered is dropped

            reqs = [ScoreRequest(f"s{i}", [1, 2], [], 0, [], []) for i in range(2)]
            call = asyncio.create_task(client.run(reqs))
            for r in [decode(await inbox.recv()) for _ in reqs][::-1]:
                await outbox.send(encode(_ok(r.request_id)))
            assert [o.request_id for o in await asyncio.wait_for(call, 5)] == ["s0", "s1"]
            assert client.pending == {} and client.cancelled == 2
            assert await inbox.poll(200) == 0  # nothing cancelled: every request was answered
        finally:
            reader.cancel()
            for s in (inbox, outbox, client.requests, client.responses):
                s.close(0)
            ctx.term()
            client.ctx.term()

    asyncio.run(main())


HELD_SCRIPT = """
import os, sys
from tiered.api.engine_client import EngineClient, served_config
from tiered.config import load_config
from tiered.config.options import DEFAULT_CONFIG

cfg = load_config(DEFAULT_CONFIG, [f"model.path={sys.argv[1]}", "cache.host.enabled=false", "cache.suffix=discard"])
client = EngineClient(served_config(cfg))
client.spawn(hold=True)
print(client.process.pid, flush=True)
os._exit(0)  # gone without stopping it: no clean-up of any kind
"""


def test_a_held_engine_process_exits_when_its_api_process_is_gone(tiny_dir: Path) -> None:
    cmd = [sys.executable, "-c", HELD_SCRIPT, str(tiny_dir)]
    # The held process inherits the pipes: run() returns once it too has exited.
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    (pid,) = out.stdout.split()
    deadline = time.monotonic() + 60
    while _alive(int(pid)):
        assert time.monotonic() < deadline, "the held engine process outlived its API process"
        time.sleep(0.2)
    assert "Traceback" not in out.stderr and "engine" not in out.stderr.lower()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # An exited child of an exited parent is reaped by init; a zombie's state is Z.
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or stat.read_text().split(") ")[-1][:1] != "Z"
