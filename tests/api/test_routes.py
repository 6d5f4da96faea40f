"""The routes and their validation against a fake engine client: no engine process is spawned.

The fake answers each request from its token ids (token = last id, logprob of id t = -t/100), so
every figure a route returns can be checked exactly; it records what reached it, so a test can
say that invalid input never did."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from tiered.api.app import build_app
from tiered.api.metrics import parse
from tiered.api.protocol import AdapterReply, EngineStats, Ready, ScoreRequest, ScoreResponse
from tiered.config import load_config
from tiered.request.validation import InputError, check_prompt

MAX_LEN = 64


class FakeEngine:
    def __init__(self, vocab_size: int) -> None:
        self.ready: Ready | None = Ready(MAX_LEN, vocab_size)
        self.stats: EngineStats | None = EngineStats(jct_error=0.05)
        self.adapters: dict[str, str] = {"ad1": "/adapters/ad1"}
        self.pending: dict[str, Any] = {}
        self.timed_out = self.cancelled = self.restarts = 0
        self.received: list[ScoreRequest] = []
        self.busy_until = 0.0  # the engine's running forward's predicted end (time.time()); 0.0: none
        self.alive_ = True
        self.is_full = False
        self.error: tuple[str, int] | None = None  # (message, status) to answer every request with
        self.retry_after: float | None = None  # ... and its Retry-After (a refused request)
        self.error_reason: str | None = None  # ... and why admission control refused it
        # Answer only a call's prompt at this index with `error`, and stop there, as the engine
        # client answers a call at its first error (the prompts after it cancelled)
        self.error_at: int | None = None
        self.logprob: Any = lambda ids, t: -t / 100  # (prompt ids, token id) -> its logprob

    @property
    def alive(self) -> bool:
        return self.alive_

    async def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def full(self, incoming: int) -> bool:
        return self.is_full

    async def run(self, reqs: list[ScoreRequest], disconnected: Any = None) -> list[ScoreResponse]:
        self.received += reqs
        if self.error is None:
            return [self._answer(r) for r in reqs]
        refused = [
            ScoreResponse(
                r.request_id,
                error=self.error[0],
                error_status=self.error[1],
                retry_after_s=self.retry_after,
                error_reason=self.error_reason,
            )
            for r in reqs
        ]
        if self.error_at is None:
            return refused
        return [self._answer(r) for r in reqs[: self.error_at]] + [refused[self.error_at]]

    def _answer(self, r: ScoreRequest) -> ScoreResponse:
        return ScoreResponse(
            r.request_id,
            token_id=r.token_ids[-1],
            logprobs=[(t, self.logprob(r.token_ids, t)) for t in r.logprob_token_ids],
            top_logprobs=[(r.token_ids[-1] + k, -(k + 1) / 100) for k in range(r.top_logprobs)],
            num_tokens=len(r.token_ids),
            num_device_hit_tokens=len(r.token_ids) // 2,
            compute_seconds=0.5,
            num_pieces=1 + len(r.token_ids) // 32,  # as if long prompts yielded
            deadline_met=None if r.slo_ms is None else r.slo_ms >= 100,  # a fake: 100 ms suffice
        )

    async def adapter(self, name: str, path: str | None) -> AdapterReply:
        return AdapterReply("x")


def _app(model: str | Path, *sets: str, **kwargs: Any) -> tuple[TestClient, FakeEngine]:
    cfg = load_config(None, [f"model.path={model}", f"model.max_model_len={MAX_LEN}", "scheduler.max_waiting=8", *sets])
    fake = FakeEngine(vocab_size=2048)
    return TestClient(build_app(cfg, client=fake, **kwargs)), fake


@pytest.fixture()
def api(tiny_dir: Path) -> Iterator[tuple[TestClient, FakeEngine]]:
    client, fake = _app(tiny_dir, served_model_names=["base"])
    with client:
        yield client, fake


def _error(r: Any) -> dict[str, Any]:
    return r.json()["error"]  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"prompt": [1] * (MAX_LEN + 1)}, "prompt", f"This model's maximum context length is {MAX_LEN} tokens."),
        ({"prompt": [1, 5000]}, "prompt", "token id 5000 is outside the vocabulary [0, 2048) (in prompt)"),
        ({"prompt": [[1, 2], []]}, "prompt", "prompt is empty: it must contain at least one token"),
        ({"prompt": [1], "max_tokens": 2}, "max_tokens", "max_tokens must be 1"),
        ({"prompt": [1], "stream": True}, "stream", "stream=true is not supported"),
        ({"prompt": [1], "logprob_token_ids": [-1]}, "logprob_token_ids", "token id -1 is outside"),
        ({"prompt": [1], "logit_bias": {"7": 101}}, "logit_bias", "logit_bias values must be in [-100, 100]"),
        ({"prompt": [1], "cache_salt": ""}, "cache_salt", "cache_salt must be a non-empty string"),
        ({"prompt": [1], "slo_ms": -5}, "slo_ms", "slo_ms must be a number of milliseconds in (0, 1e9], got -5"),
        ({"prompt": [1], "slo_ms": 0}, "slo_ms", "slo_ms must be a number of milliseconds"),
        ({"prompt": [1], "slo_ms": 2e9}, "slo_ms", "slo_ms must be a number of milliseconds"),
        ({"prompt": [1], "slo_ms": "10"}, "slo_ms", "slo_ms:"),
        ({"prompt": [1], "priority": 2**62}, "priority", f"priority must be an integer in [-{2**62 - 1}, {2**62 - 1}]"),
        ({"prompt": [1], "priority": -(2**70)}, "priority", f"got {-(2**70)}"),
        ({"prompt": "x", "model": "nope"}, "model", "The model `nope` does not exist."),
        ({"prompt": 5}, "prompt", "prompt:"),
    ],
)
def test_invalid_completions_are_refused_before_the_engine(api, body: dict, param: str, message: str) -> None:
    client, fake = api
    r = client.post("/v1/completions", json=body)
    assert r.status_code == (404 if param == "model" else 400)
    assert _error(r)["param"] == param and message in _error(r)["message"]
    assert fake.received == []


def test_the_widest_priorities_a_call_may_carry_reach_the_engine(api) -> None:
    client, fake = api
    for priority in (2**62 - 1, -(2**62 - 1)):
        assert client.post("/v1/completions", json={"prompt": [1], "priority": priority}).status_code == 200
    assert [q.priority for q in fake.received] == [2**62 - 1, -(2**62 - 1)]


def test_a_completion_names_its_adapter_and_echoes_the_request_id(api) -> None:
    client, fake = api
    r = client.post(
        "/v1/completions",
        headers={"X-Request-Id": "r-1"},
        json={"model": "ad1", "prompt": [[3, 4, 5], [6, 7]], "logprob_token_ids": [10, 20]},
    )
    assert r.status_code == 200 and r.headers["x-request-id"] == "r-1"
    data = r.json()
    assert data["id"] == "cmpl-r-1" and data["model"] == "ad1"
    assert [q.lora_name for q in fake.received] == ["ad1", "ad1"] and [q.token_ids for q in fake.received] == [
        [3, 4, 5],
        [6, 7],
    ]
    assert [c["logprob_token_ids"] for c in data["choices"]] == [{"10": -0.1, "20": -0.2}] * 2
    u = data["usage"]
    assert (u["prompt_tokens"], u["completion_tokens"], u["prompt_tokens_details"]["cached_tokens"]) == (5, 2, 2)
    assert u["tiered"]["compute_seconds"] == 0.5


def test_scoring_turns_label_logprobs_into_probabilities(api) -> None:
    client, _ = api
    body = {"query": [1, 2, 3], "items": [[4], [5, 6]], "label_token_ids": [10, 30]}
    scores = client.post("/v1/score", json=body).json()["scores"]
    p10, p30 = math.exp(-0.1), math.exp(-0.3)
    assert scores == [pytest.approx([p10 / (p10 + p30), p30 / (p10 + p30)])] * 2
    raw = client.post("/generative_scoring", json={**body, "apply_softmax": False}).json()["results"]
    assert raw[1]["token_probs"] == pytest.approx({"10": p10, "30": p30})


def test_engine_failures_and_limits_use_the_envelope(api) -> None:
    client, fake = api
    fake.error = ("out of memory computing 3 tokens", 500)
    r = client.post("/v1/completions", json={"prompt": [1, 2, 3]})
    assert r.status_code == 500 and _error(r)["type"] == "server_error" and _error(r)["param"] is None
    fake.error, fake.is_full, fake.stats = None, True, EngineStats(predicted_wait_s=12.2)
    r = client.post("/v1/completions", json={"prompt": [1, 2, 3]})
    assert r.status_code == 503 and _error(r)["type"] == "service_unavailable" and r.headers["Retry-After"] == "13"
    assert "scheduler.max_waiting" in _error(r)["message"]
    assert parse(client.get("/metrics").text)["tiered:requests_refused_total{model_name=base,reason=queue_full}"] == 1
    fake.is_full, fake.alive_ = False, False
    assert client.post("/v1/completions", json={"prompt": [1]}).status_code == 503
    assert client.get("/health").status_code == 503


def test_models_tokenize_and_metrics(api, tiny_dir: Path) -> None:
    client, fake = api
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["base", "ad1"]
    assert client.post("/tokenize", json={"prompt": "hi", "add_special_tokens": False}).json()["count"] >= 1
    r = client.post("/detokenize", json={"tokens": [1, 9999]})
    assert r.status_code == 400 and _error(r)["param"] == "tokens"
    client.post("/v1/completions", json={"model": "ad1", "prompt": [1, 2]})
    text = client.get("/metrics").text
    assert 'vllm:request_success_total{finished_reason="length",model_name="ad1"} 1.0' in text
    assert "tiered:jct_prediction_error 0.05" in text  # the engine's statistics as last reported


def test_every_series_of_the_base_model_is_on_metrics_before_the_first_call(api) -> None:
    """As vLLM's: a dashboard reads zeros and every histogram bucket from start-up."""
    client, _ = api
    m = parse(client.get("/metrics").text)
    assert m["vllm:request_success_total{finished_reason=length,model_name=base}"] == 0
    assert m["vllm:prompt_tokens_total{model_name=base}"] == 0
    for tier in ("device", "host", "remote", "disk"):
        assert m[f"tiered:prefix_cache_hits_total{{model_name=base,tier={tier}}}"] == 0
    for reason in ("deadline", "wait_cap", "queue_full"):
        assert m[f"tiered:requests_refused_total{{model_name=base,reason={reason}}}"] == 0
    for name in ("e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds"):
        assert m[f"vllm:{name}_bucket{{le=0.3,model_name=base}}"] == 0
        assert m[f"vllm:{name}_bucket{{le=+Inf,model_name=base}}"] == 0 == m[f"vllm:{name}_count{{model_name=base}}"]
    assert m["vllm:request_prompt_tokens_bucket{le=1.0,model_name=base}"] == 0


def test_the_shared_validation_rules() -> None:
    check_prompt([0, 1, 2], vocab_size=3, max_model_len=3)
    with pytest.raises(InputError, match=r"^prompt is empty: it must contain at least one token$"):
        check_prompt([], 3, 3, "prompt")
    with pytest.raises(InputError, match=r"However, you requested 4 tokens"):
        check_prompt([0] * 4, 3, 3)
    with pytest.raises(InputError, match=r"token id 3 is outside the vocabulary \[0, 3\) \(in items\)") as info:
        check_prompt([3], 3, 3, "items")
    assert info.value.param == "items"


def _ids(client: TestClient) -> list[str]:
    return [m["id"] for m in client.get("/v1/models").json()["data"]]


def test_the_served_name_is_the_model_as_given_and_the_folder_name_an_alias(tiny_dir: Path) -> None:
    client, fake = _app(tiny_dir)
    with client:
        assert _ids(client) == [str(tiny_dir), "ad1"]
        for model in (str(tiny_dir), "tiny", None):  # the folder's name is still accepted
            r = client.post("/v1/completions", json={"model": model, "prompt": [1, 2]})
            assert r.status_code == 200 and r.json()["model"] == str(tiny_dir)
        assert fake.received[-1].lora_name is None
        assert client.post("/v1/completions", json={"model": "tinyx", "prompt": [1]}).status_code == 404
        assert client.post("/tokenize", json={"model": "tiny", "prompt": "hi"}).status_code == 200
        metrics = client.get("/metrics").text
        assert f'vllm:request_success_total{{finished_reason="length",model_name="{tiny_dir}"}} 3.0' in metrics


def test_an_embedded_model_is_served_as_embedded_name(tmp_path: Path) -> None:
    client, _ = _app("embedded:tiny", f"model.models_dir={tmp_path}")
    with client:
        assert _ids(client) == ["embedded:tiny", "ad1"]
        r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 200 and r.json()["model"] == "embedded:tiny"


def test_several_served_names_the_first_reported_all_accepted(tiny_dir: Path) -> None:
    client, fake = _app(tiny_dir, served_model_names=["first", "org/second"])
    with client:
        assert _ids(client) == ["first", "org/second", "ad1"]
        assert [m["parent"] for m in client.get("/v1/models").json()["data"]] == [None, None, "first"]
        for model in ("first", "org/second", "tiny"):
            r = client.post("/v1/score", json={"model": model, "query": [1], "items": [[2]], "label_token_ids": [3]})
            assert r.status_code == 200 and r.json()["model"] == "first"
        assert client.post("/v1/completions", json={"model": str(tiny_dir), "prompt": [1]}).status_code == 404
        r = client.post("/v1/completions", json={"model": "ad1", "prompt": [1]})  # an adapter is still a model id
        assert r.json()["model"] == "ad1" and fake.received[-1].lora_name == "ad1"


def test_an_adapter_may_not_take_a_name_of_the_base_model(tiny_dir: Path) -> None:
    client, _ = _app(tiny_dir, "lora.enabled=true", "lora.allow_runtime_updates=true", served_model_names=["base"])
    with client:
        for name in ("base", "tiny"):
            r = client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": "/x"})
            assert r.status_code == 400 and _error(r)["message"] == f"'{name}' is the base model's name"
        assert client.post("/v1/load_lora_adapter", json={"lora_name": "ad2", "lora_path": "/x"}).status_code == 200


@pytest.mark.parametrize("metrics_require_key", [False, True])
def test_the_api_key_guards_v1_routes_only(tiny_dir: Path, metrics_require_key: bool) -> None:
    client, fake = _app(tiny_dir, f"server.metrics_require_key={str(metrics_require_key).lower()}", api_key="k")
    key = {"Authorization": "Bearer k"}
    scoring = {"query": [1], "items": [[2]], "label_token_ids": [3]}
    with client:
        assert client.get("/version").status_code == 200 and client.get("/health").status_code == 200
        assert client.post("/tokenize", json={"prompt": "hi"}).json()["count"] >= 1
        assert client.post("/detokenize", json={"tokens": [300]}).json() == {"prompt": "ow"}
        assert client.get("/metrics").status_code == (401 if metrics_require_key else 200)
        for method, path, body in [
            ("POST", "/v1/completions", {"prompt": [1]}),
            ("GET", "/v1/models", None),
            ("POST", "/v1/score", scoring),
            ("POST", "/generative_scoring", scoring),
        ]:
            r = client.request(method, path, json=body)
            assert r.status_code == 401 and _error(r)["message"] == "Incorrect API key provided.", path
            wrong = client.request(method, path, json=body, headers={"Authorization": "Bearer kk"})
            assert wrong.status_code == 401
            assert client.request(method, path, json=body, headers=key).status_code == 200, path
        assert client.get("/metrics", headers=key).status_code == 200
        assert len(fake.received) == 3  # only the keyed calls reached the engine


def test_logprobs_keep_ids_that_decode_alike_apart(api) -> None:
    """Ids 100 and 101 of the tiny tokenizer are single bytes of multi-byte characters: both decode to U+FFFD."""
    client, _ = api
    r = client.post("/v1/completions", json={"prompt": [5, 98], "logprobs": 4}).json()["choices"][0]
    assert r["text"] == "}" and r["logprobs"]["tokens"] == ["}"] and r["logprobs"]["token_logprobs"] == [-0.01]
    assert r["logprobs"]["top_logprobs"] == [{"}": -0.01, "~": -0.02, "token_id:100": -0.03, "token_id:101": -0.04}]
    r = client.post("/v1/completions", json={"prompt": [5, 100], "logprobs": 2}).json()["choices"][0]
    assert r["text"] == "\ufffd" and r["logprobs"]["tokens"] == ["token_id:100"]  # the chosen one is a key of its row
    assert r["logprobs"]["top_logprobs"] == [{"token_id:100": -0.01, "token_id:101": -0.02}]


def test_return_tokens_as_token_ids_per_request_and_per_server(tiny_dir: Path) -> None:
    body = {"prompt": [5, 98], "logprobs": 2}
    chat = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2}
    for server_default in (False, True):
        client, fake = _app(tiny_dir, return_tokens_as_token_ids=server_default)
        with client:
            for asked in (None, True, False):
                on = server_default if asked is None else asked
                extra = {} if asked is None else {"return_tokens_as_token_ids": asked}
                lp = client.post("/v1/completions", json={**body, **extra}).json()["choices"][0]["logprobs"]
                assert lp["tokens"] == (["token_id:98"] if on else ["}"])
                assert list(lp["top_logprobs"][0]) == (["token_id:98", "token_id:99"] if on else ["}", "~"])
                r = client.post("/v1/chat/completions", json={**chat, **extra}).json()["choices"][0]
                last = fake.received[-1].token_ids[-1]
                (first,) = r["logprobs"]["content"]
                text = client.post("/detokenize", json={"tokens": [last]}).json()["prompt"]
                assert r["message"]["content"] == text
                assert first["token"] == (f"token_id:{last}" if on else text)
                assert first["bytes"] == list(text.encode()) and first["logprob"] == -0.01
                assert [e["token"] for e in first["top_logprobs"]] == (
                    [f"token_id:{last}", f"token_id:{last + 1}"] if on else [text, client_text(client, last + 1)]
                )


def client_text(client: TestClient, token: int) -> str:
    return str(client.post("/detokenize", json={"tokens": [token]}).json()["prompt"])


def test_latency_objectives_reach_the_engine_and_are_counted_per_route(api) -> None:
    """slo_ms on completions, chat and scoring goes to the engine as given; each answer says its
    pieces and whether it met its deadline (usage.tiered), and /metrics counts both per route."""
    client, fake = api
    r = client.post("/v1/completions", json={"prompt": [[1] * 40, [2, 3]], "slo_ms": 1500})
    assert r.status_code == 200 and [q.slo_ms for q in fake.received] == [1500, 1500]
    assert r.json()["usage"]["tiered"]["num_pieces"] == 2 + 1 and r.json()["usage"]["tiered"]["deadline_met"] is True
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "slo_ms": 50.5})
    assert r.status_code == 200 and fake.received[-1].slo_ms == 50.5
    assert r.json()["usage"]["tiered"]["deadline_met"] is False
    r = client.post("/v1/score", json={"query": "a", "items": ["b"], "label_token_ids": [1], "slo_ms": 200})
    assert r.status_code == 200 and fake.received[-1].slo_ms == 200
    r = client.post("/v1/completions", json={"prompt": [1, 2]})
    assert fake.received[-1].slo_ms is None and r.json()["usage"]["tiered"]["deadline_met"] is None
    m = parse(client.get("/metrics").text)
    assert m["tiered:deadline_total{model_name=base,outcome=met,route=/v1/completions}"] == 2
    assert m["tiered:deadline_total{model_name=base,outcome=missed,route=/v1/chat/completions}"] == 1
    assert m["tiered:deadline_total{model_name=base,outcome=met,route=/v1/score}"] == 1
    assert m["tiered:prefill_pieces_total"] == 3 + 1 + 1 + 1


def test_a_request_past_its_deadline_is_a_429_naming_the_reason(api) -> None:
    client, fake = api
    fake.error = ("deadline exceeded: 40 ms past its latency objective while it waited (scheduler.drop_expired)", 429)
    r = client.post("/v1/completions", json={"prompt": [1, 2, 3], "slo_ms": 10})
    assert r.status_code == 429 and _error(r)["type"] == "deadline_exceeded"
    assert "deadline exceeded" in _error(r)["message"]
    assert "Retry-After" not in r.headers
    m = parse(client.get("/metrics").text)
    assert m["tiered:deadline_total{model_name=base,outcome=expired,route=/v1/completions}"] == 1


def test_a_call_shed_or_over_the_wait_cap_says_when_to_retry(api) -> None:
    """A call the engine refused at once carries its Retry-After (whole seconds, at least 1), its
    own error type, and is counted by reason."""
    client, fake = api
    fake.error = ("deadline unreachable: ... (scheduler.late: shed)", 429)
    fake.retry_after = 0.2
    r = client.post("/v1/completions", json={"prompt": [1, 2, 3], "slo_ms": 10})
    assert r.status_code == 429 and _error(r)["type"] == "deadline_unreachable" and r.headers["Retry-After"] == "1"
    fake.error, fake.retry_after = ("the server is over capacity: ...", 503), 30.5
    r = client.post("/v1/completions", json={"prompt": [1, 2, 3]})
    assert r.status_code == 503 and _error(r)["type"] == "service_unavailable" and r.headers["Retry-After"] == "31"
    m = parse(client.get("/metrics").text)
    assert m["tiered:deadline_total{model_name=base,outcome=shed,route=/v1/completions}"] == 1
    assert m["tiered:requests_refused_total{model_name=base,reason=deadline}"] == 1
    assert m["tiered:requests_refused_total{model_name=base,reason=wait_cap}"] == 1


def test_a_call_of_several_prompts_is_answered_with_its_first_error(api) -> None:
    """The engine client answers a call at its first error, without its later prompts' answers:
    the call gets that error, and only what was answered is counted."""
    client, fake = api
    fake.error, fake.retry_after, fake.error_at = ("deadline unreachable: ... (scheduler.late: shed)", 429), 2.5, 1
    r = client.post("/v1/completions", json={"prompt": [[1, 2], [3, 4], [5, 6]], "slo_ms": 200})
    assert r.status_code == 429 and _error(r)["type"] == "deadline_unreachable" and r.headers["Retry-After"] == "3"
    assert len(fake.received) == 3  # all three were sent
    m = parse(client.get("/metrics").text)
    assert m["tiered:requests_refused_total{model_name=base,reason=deadline}"] == 1
    assert m["tiered:deadline_total{model_name=base,outcome=shed,route=/v1/completions}"] == 1
    assert m["tiered:deadline_total{model_name=base,outcome=met,route=/v1/completions}"] == 1  # the first prompt's


def test_an_unmeetable_call_is_told_whether_a_retry_can_help(api) -> None:
    """A call whose own time exceeds its objective: a 429 with the warm-up's Retry-After while
    caching its prefix can help, a 400 naming `slo_ms` (no Retry-After) when nothing can; both of
    type objective_unmeetable, counted as shed and refused as unmeetable."""
    client, fake = api
    fake.error, fake.retry_after, fake.error_reason = (
        ("objective unmeetable: ...; retry in 6.3 s", 429),
        6.3,
        "unmeetable",
    )
    r = client.post("/v1/completions", json={"prompt": [1, 2, 3], "slo_ms": 5000})
    assert r.status_code == 429 and _error(r)["type"] == "objective_unmeetable" and r.headers["Retry-After"] == "7"
    fake.error, fake.retry_after = ("objective unmeetable: ...; raise slo_ms", 400), None
    r = client.post("/v1/completions", json={"prompt": [1, 2, 3], "slo_ms": 1})
    assert r.status_code == 400 and _error(r)["type"] == "objective_unmeetable" and _error(r)["param"] == "slo_ms"
    assert "Retry-After" not in r.headers
    m = parse(client.get("/metrics").text)
    assert m["tiered:requests_refused_total{model_name=base,reason=unmeetable}"] == 2
    assert m["tiered:requests_refused_total{model_name=base,reason=deadline}"] == 0
    assert m["tiered:deadline_total{model_name=base,outcome=shed,route=/v1/completions}"] == 2


def test_a_call_that_cannot_wait_for_the_running_forward_is_refused_without_reaching_the_engine(tiny_dir: Path) -> None:
    """While the engine runs a forward predicted to end in 3 s it reads no message: a call whose
    objective ends before that is refused by the API (429, Retry-After: the forward's rest plus
    the engine's queue), never sent; calls that can wait, without an objective, or (late: serve)
    that are served late, go to the engine. The server's default objective counts as a call's own."""
    client, fake = _app(tiny_dir, "scheduler.default_slo_ms=2000", served_model_names=["base"])
    with client:
        fake.busy_until = time.time() + 3.0
        fake.stats = EngineStats(predicted_wait_s=4.0)
        r = client.post("/v1/completions", json={"prompt": [1, 2, 3], "slo_ms": 1000})
        assert r.status_code == 429 and _error(r)["type"] == "deadline_unreachable"
        assert _error(r)["message"].startswith("deadline unreachable: the forward running now")
        assert 6 <= int(r.headers["Retry-After"]) <= 7 and fake.received == []
        r = client.post("/v1/completions", json={"prompt": [1, 2, 3]})  # the default objective, 2 s
        assert r.status_code == 429 and fake.received == []
        for ok in ({"prompt": [4], "slo_ms": 10000}, {"prompt": [5], "slo_ms": 10000}):
            assert client.post("/v1/completions", json=ok).status_code == 200
        assert [r.token_ids for r in fake.received] == [[4], [5]]
        fake.busy_until = time.time() - 0.1  # that forward is over (or ran past its prediction)
        assert client.post("/v1/completions", json={"prompt": [6], "slo_ms": 10}).status_code == 200
        m = parse(client.get("/metrics").text)
        assert m["tiered:requests_refused_total{model_name=base,reason=deadline}"] == 2
        assert m["tiered:deadline_total{model_name=base,outcome=shed,route=/v1/completions}"] == 2
    client, fake = _app(tiny_dir, "scheduler.late=serve", served_model_names=["base"])
    with client:
        fake.busy_until = time.time() + 3.0
        assert client.post("/v1/completions", json={"prompt": [7], "slo_ms": 10}).status_code == 200


def test_a_pair_score_is_exact_where_both_labels_are_far_below_the_top_token(tiny_dir: Path) -> None:
    """Logprobs of -2000 and -2001 (an exp() that underflows to 0 in float64): the score is still
    the sigmoid of their difference, as vLLM computes it from the logits, and SGLang's softmax
    over the label tokens alike."""
    client, fake = _app(tiny_dir, 'server.score_tokens=["No", "Yes"]', served_model_names=["base"])
    tok = AutoTokenizer.from_pretrained(str(tiny_dir))
    no, yes = (tok.encode(w, add_special_tokens=False)[0] for w in ("No", "Yes"))
    fake.logprob = lambda ids, t: -2000.0 if t == yes else -2001.0
    with client:
        r = client.post("/v1/rerank", json={"query": "q", "documents": ["d"]})
        assert r.status_code == 200 and r.json()["results"][0]["relevance_score"] == pytest.approx(
            1 / (1 + math.exp(-1))
        )
        r = client.post(
            "/v1/score", json={"query": [5], "items": [[6]], "label_token_ids": [no, yes], "apply_softmax": True}
        )
        assert r.status_code == 200 and r.json()["scores"][0] == pytest.approx(
            [1 / (1 + math.e), 1 / (1 + math.exp(-1))]
        )


def test_rerank_and_vllms_pair_scores_rank_by_the_positive_tokens_probability(tiny_dir: Path) -> None:
    """/rerank, /v1/rerank, /v2/rerank (Jina/Cohere shape) and /v1/score in vLLM's shape: one prompt
    per pair (query, then document), scored P(positive) / (P(negative) + P(positive)) of
    `server.score_tokens`; rerank sorts by it and keeps `top_n`. The fake makes a longer prompt
    less likely to say the positive token."""
    client, fake = _app(tiny_dir, 'server.score_tokens=["No", "Yes"]', served_model_names=["base"])
    tok = AutoTokenizer.from_pretrained(str(tiny_dir))
    no, yes = (tok.encode(w, add_special_tokens=False)[0] for w in ("No", "Yes"))
    fake.logprob = lambda ids, t: -len(ids) / 100 if t == yes else -0.3
    docs = ["a much longer document about bread", "short", "a medium document"]

    def expected(doc: str, query: str = "which?") -> float:
        n = len(tok.encode(query)) + len(tok.encode(doc, add_special_tokens=False))
        p_yes, p_no = math.exp(-n / 100), math.exp(-0.3)
        return p_yes / (p_yes + p_no)

    with client:
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            r = client.post(path, json={"query": "which?", "documents": docs, "top_n": 2})
            assert r.status_code == 200, r.text
            results = r.json()["results"]
            assert [x["index"] for x in results] == [1, 2] and results[0]["document"] == {"text": "short"}
            assert results[0]["relevance_score"] == pytest.approx(expected("short"))
        received = fake.received[-3:]
        assert received[0].token_ids == tok.encode("which?") + tok.encode(docs[0], add_special_tokens=False)
        assert sorted(received[0].logprob_token_ids) == sorted([no, yes])
        r = client.post(
            "/v1/rerank", json={"query": "which?", "documents": [{"text": "short"}], "return_documents": False}
        )
        assert r.json()["results"] == [{"index": 0, "relevance_score": pytest.approx(expected("short"))}]
        r = client.post("/v1/score", json={"text_1": "which?", "text_2": docs})
        data = r.json()["data"]
        assert r.status_code == 200 and r.json()["object"] == "list" and [d["index"] for d in data] == [0, 1, 2]
        assert [d["score"] for d in data] == pytest.approx([expected(d) for d in docs])
        r = client.post("/score", json={"text_1": ["which?", "what?"], "text_2": ["short", "short"]})
        assert [d["score"] for d in r.json()["data"]] == pytest.approx([expected("short"), expected("short", "what?")])
        for body, param in (
            ({"query": "q", "documents": []}, "documents"),
            ({"query": "q", "documents": [{"title": "no text"}]}, "documents"),
            ({"query": "q", "documents": ["d"], "top_n": -1}, "top_n"),
        ):
            r = client.post("/rerank", json=body)
            assert r.status_code == 400 and _error(r)["param"] == param, r.text
        r = client.post("/v1/score", json={"text_1": ["a", "b"], "text_2": ["c", "d", "e"]})
        assert r.status_code == 400 and "must be as long" in _error(r)["message"]


def test_pair_scores_name_the_setting_when_the_score_tokens_are_not_single_tokens(tiny_dir: Path) -> None:
    client, _ = _app(tiny_dir, served_model_names=["base"])  # "yes" is two tokens of the embedded tokenizer
    with client:
        r = client.post("/v1/rerank", json={"query": "q", "documents": ["d"]})
    assert r.status_code == 400 and "server.score_tokens" in _error(r)["message"] and "'yes' is 2 tokens" in r.text
