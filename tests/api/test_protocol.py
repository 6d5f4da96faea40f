"""Messages between the API and engine processes survive msgpack whole, the new fields included."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest
import zmq

from tiered.api.engine_process import _response, serve_engine
from tiered.api.protocol import (
    Busy,
    EngineStats,
    HostCounters,
    PieceCounters,
    Ready,
    ScoreRequest,
    ScoreResponse,
    decode,
    encode,
)
from tiered.config import load_config
from tiered.config.options import DEFAULT_CONFIG
from tiered.request.score import Result
from tiered.request.tokens import HitSplit


def test_requests_responses_and_stats_round_trip() -> None:
    req = ScoreRequest("r", [1, 2], [3], 2, [4], [(5, -1.5)], priority=-1, cache_salt="s", lora_name="a", slo_ms=250.5)
    assert decode(encode(req)) == req
    out = ScoreResponse("r", token_id=7, logprobs=[(3, -0.1)], num_tokens=2, num_pieces=3, deadline_met=False)
    assert decode(encode(out)) == out
    stats = EngineStats(jct_error=0.1, host=HostCounters(loaded_bytes=5), pieces=PieceCounters(2, 1, 4096, 8192))
    assert decode(encode(stats)) == stats


def test_an_engine_result_maps_to_its_response_and_status() -> None:
    ok = Result("r", 40, HitSplit(16, 0, 24), 5, {}, [], 0.1, 0.0, 0.0, 0.2, 0.2, 0.0, num_pieces=2, deadline_met=True)
    out = _response(ok)
    assert out.error is None and out.num_pieces == 2 and out.deadline_met is True and out.num_device_hit_tokens == 16
    late = _response(Result.failed("r", 40, "deadline exceeded: 5 ms past ...", 0.3, expired=True))
    assert late.error_status == 429 and late.error is not None and late.error.startswith("deadline exceeded")
    assert _response(Result.failed("r", 40, "out of memory computing 40 tokens", 0.3)).error_status == 500


def test_the_engine_process_says_when_its_forward_is_predicted_to_end_and_when_it_has(tiny_dir: Path) -> None:
    """The engine reads no message while a forward runs: just before one it sends `Busy` with the
    forward's predicted end (wall clock), and once it is over a `Busy(0.0)`, before the answers."""
    config = load_config(DEFAULT_CONFIG, [f"model.path={tiny_dir}", "scheduler.profile_tokens=[64,256]"])
    ctx = zmq.Context()
    requests, responses = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    addrs = [f"tcp://127.0.0.1:{s.bind_to_random_port('tcp://127.0.0.1')}" for s in (requests, responses)]
    engine = multiprocessing.get_context("spawn").Process(target=serve_engine, args=(config, *addrs), daemon=True)
    engine.start()
    try:
        responses.setsockopt(zmq.RCVTIMEO, 120_000)
        assert isinstance(decode(responses.recv()), Ready)
        sent = time.time()
        requests.send(encode(ScoreRequest("a", list(range(3, 200)))))
        seen: list[object] = []
        while not seen or not isinstance(seen[-1], ScoreResponse):
            message = decode(responses.recv())
            if not isinstance(message, EngineStats):
                seen.append(message)
        start, end, answer = seen
        assert isinstance(start, Busy) and start.until_unix > sent
        assert end == Busy(0.0) and isinstance(answer, ScoreResponse) and answer.error is None
        responses.setsockopt(zmq.RCVTIMEO, 500)  # idle: steps without a forward announce nothing
        with pytest.raises(zmq.Again):
            while True:
                assert not isinstance(decode(responses.recv()), Busy)
    finally:
        engine.terminate()
        engine.join(30)
        ctx.destroy(linger=0)
