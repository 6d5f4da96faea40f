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
    assert late.late_since_unix is None  # past its deadline (drop_expired): not a shed call
    # shed: the last moment a check found it in time, on the monotonic clock, leaves as Unix time
    shed = _response(Result.failed("r", 40, "deadline unreachable", 0.3, True, late_since=time.monotonic() - 0.2))
    assert shed.error_status == 429 and shed.late_since_unix == pytest.approx(time.time() - 0.2, abs=0.05)
    assert shed.shed_delay_s is None  # set where it is received


def _engine_process(
    tiny_dir: Path, *overrides: str
) -> tuple[zmq.Context, zmq.Socket, zmq.Socket, multiprocessing.Process]:
    """An engine process on the tiny model, its request and response sockets (the API's ends)."""
    config = load_config(DEFAULT_CONFIG, [f"model.path={tiny_dir}", "scheduler.profile_tokens=[64,256]", *overrides])
    ctx = zmq.Context()
    requests, responses = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    addrs = [f"tcp://127.0.0.1:{s.bind_to_random_port('tcp://127.0.0.1')}" for s in (requests, responses)]
    engine = multiprocessing.get_context("spawn").Process(target=serve_engine, args=(config, *addrs), daemon=True)
    engine.start()
    return ctx, requests, responses, engine


def test_the_engine_process_says_when_its_forward_is_predicted_to_end_and_when_it_has(tiny_dir: Path) -> None:
    """Just before a forward the engine sends `Busy` with its predicted end (wall clock), and once
    it is over a `Busy(0.0)`, before the answers."""
    ctx, requests, responses, engine = _engine_process(tiny_dir)
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


def test_a_call_that_cannot_be_in_time_is_refused_while_a_forward_runs(tiny_dir: Path) -> None:
    """The engine's intake reads messages while a forward runs: a call whose objective it cannot
    meet behind that forward (0.8 of the forward's predicted rest; its own time a few ms) gets its
    429 before that forward's answer, not after it; the forward's request is answered as usual."""
    ctx, requests, responses, engine = _engine_process(tiny_dir, "model.max_model_len=32768")
    try:
        responses.setsockopt(zmq.RCVTIMEO, 120_000)
        assert isinstance(decode(responses.recv()), Ready)
        requests.send(encode(ScoreRequest("long", [(t * 7) % 1290 + 3 for t in range(32_000)])))
        while not isinstance(message := decode(responses.recv()), Busy | ScoreResponse):
            pass
        assert isinstance(message, Busy) and message.until_unix > 0, message
        rest = message.until_unix - time.time()
        assert rest > 0.05, rest  # 32 K tokens: far more work than the call's 37
        late_call = ScoreRequest("late", list(range(3, 40)), slo_ms=800 * rest, arrival_unix=time.time())
        requests.send(encode(late_call))
        answers = []
        while len(answers) < 2:
            message = decode(responses.recv())
            if isinstance(message, ScoreResponse):
                answers.append(message)
            assert not (isinstance(message, Busy) and message.until_unix == 0.0 and not answers), "refused after"
        late, long = answers
        assert (late.request_id, late.error_status) == ("late", 429) and "deadline unreachable" in str(late.error)
        assert late.late_since_unix is not None and late.late_since_unix <= time.time()
        assert long.request_id == "long" and long.error is None
    finally:
        engine.terminate()
        engine.join(30)
        ctx.destroy(linger=0)
