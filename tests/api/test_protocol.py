"""Messages between the API and engine processes survive msgpack whole, the new fields included."""

from __future__ import annotations

from tiered.api.engine_process import _response
from tiered.api.protocol import EngineStats, HostCounters, PieceCounters, ScoreRequest, ScoreResponse, decode, encode
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
