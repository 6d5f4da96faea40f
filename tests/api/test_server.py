"""A real `tiered serve` (API process + engine process) on the tiny model, through the openai client."""

from __future__ import annotations

import math
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch

from benchmarks.launch import ServerProcess, start_server, stop_server
from tiered.api.metrics import parse
from tiered.hybrid.forward import forward
from tiered.hybrid.loader import load_model, read_args


@pytest.fixture(scope="module")
def server(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    jct = tmp_path_factory.mktemp("jct")
    proc, url = start_server(
        [
            str(tiny_dir),
            "--api-key",
            "sekret",
            "--set",
            "cache.block_tokens=16",
            "--set",
            f"scheduler.profile_cache_dir={jct}",
            "--set",
            "model.max_model_len=1024",
        ],
        timeout_s=180,
    )
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="sekret")


def test_completions_equal_the_in_process_forward(client: openai.OpenAI, tiny_dir: Path) -> None:
    model = load_model(tiny_dir)
    prompts = [[0] + list(range(10, 10 + n)) for n in (5, 50, 300)]
    out = client.completions.create(
        model="tiny", prompt=prompts, max_tokens=1, logprobs=3, extra_body={"logprob_token_ids": [11, 12]}
    )
    assert len(out.choices) == 3 and out.usage.prompt_tokens == sum(map(len, prompts))
    for choice in out.choices:
        ref = torch.log_softmax(forward(model, torch.tensor(prompts[choice.index])), dim=-1)
        got = choice.model_extra["logprob_token_ids"]
        assert abs(got["11"] - float(ref[11])) < 1e-4 and abs(got["12"] - float(ref[12])) < 1e-4
        assert abs(choice.logprobs.token_logprobs[0] - float(ref.max())) < 1e-4
        assert len(choice.logprobs.top_logprobs[0]) == 3
    as_ids = client.completions.create(
        model="tiny", prompt=prompts[0], max_tokens=1, logprobs=3, extra_body={"return_tokens_as_token_ids": True}
    )
    top3 = torch.log_softmax(forward(model, torch.tensor(prompts[0])), dim=-1).topk(3).indices.tolist()
    assert as_ids.choices[0].logprobs.tokens == [f"token_id:{top3[0]}"]
    assert list(as_ids.choices[0].logprobs.top_logprobs[0]) == [f"token_id:{t}" for t in top3]


def test_a_shared_prefix_is_reported_as_cached(client: openai.OpenAI) -> None:
    prefix = list(range(100, 164))  # 4 blocks of 16
    client.completions.create(model="tiny", prompt=prefix + [7, 8], max_tokens=1)
    # Nothing else waited, so the `prefix` policy kept nothing on the device: the host tier has it.
    again = client.completions.create(model="tiny", prompt=prefix + [9, 10], max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens == 64
    hits = ("device_hit_tokens", "host_hit_tokens", "batch_shared_tokens")
    tiered = again.usage.model_extra["tiered"]
    assert {k: tiered[k] for k in hits} == {"device_hit_tokens": 0, "host_hit_tokens": 64, "batch_shared_tokens": 0}
    assert tiered["load_seconds"] > 0 and tiered["compute_seconds"] > 0  # the timing breakdown
    # Loading it put it in device blocks: now it is a device hit.
    third = client.completions.create(model="tiny", prompt=prefix + [11, 12], max_tokens=1)
    tiered = third.usage.model_extra["tiered"]
    assert {k: tiered[k] for k in hits} == {"device_hit_tokens": 64, "host_hit_tokens": 0, "batch_shared_tokens": 0}
    assert tiered["load_seconds"] == 0


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"prompt": "hi", "max_tokens": 4}, "max_tokens", "max_tokens must be 1: this engine serves prefill-only"),
        ({"prompt": [1] * 1025}, "prompt", "This model's maximum context length is 1024 tokens."),
        ({"prompt": [1, 99999]}, "prompt", "token id 99999 is outside the vocabulary"),
        ({"prompt": []}, "prompt", "prompt must not be empty"),
        ({"prompt": "hi", "logprobs": 50}, "logprobs", "logprobs must be between 0 and 20"),
        ({"promptx": "hi"}, "prompt", "prompt: Field required"),
        ({"prompt": 3.5}, "prompt", "prompt"),
    ],
)
def test_bad_requests_get_an_openai_400_and_the_server_keeps_serving(
    server: str, body: dict, param: str, message: str
) -> None:
    r = httpx.post(f"{server}/v1/completions", json=body, headers={"Authorization": "Bearer sekret"}, timeout=30)
    assert r.status_code == 400
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["message"].startswith(message) and err["param"] == param
    assert httpx.get(f"{server}/health", timeout=5).status_code == 200


def test_api_key_is_required_on_v1_routes_only(server: str, tiny_dir: Path) -> None:
    assert httpx.get(f"{server}/metrics", timeout=5).status_code == 200  # open, as vLLM's
    assert httpx.get(f"{server}/version", timeout=5).status_code == 200
    assert httpx.post(f"{server}/tokenize", json={"prompt": "hi"}, timeout=5).json()["count"] >= 1
    r = httpx.post(f"{server}/v1/completions", json={"prompt": [1, 2]}, timeout=5)
    assert r.status_code == 401 and r.json()["error"]["message"] == "Incorrect API key provided."
    assert httpx.get(f"{server}/v1/models", timeout=5).status_code == 401
    ok = httpx.get(f"{server}/v1/models", headers={"Authorization": "Bearer sekret"}, timeout=5)
    card = ok.json()["data"][0]
    assert ok.status_code == 200 and card["max_model_len"] == 1024
    assert card["id"] == str(tiny_dir) and card["root"] == str(tiny_dir)  # the model argument as given
    # The engine's resolved precision, through ZMQ: the tiny checkpoint is fp32, so auto keeps fp32.
    assert (card["dtype"], card["kv_cache_dtype"], card["checkpoint_dtype"]) == ("float32", "float32", "float32")
    assert card["dtype_reason"] == "the checkpoint is fp32"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server}/v1", api_key="wrong").completions.create(
            model="tiny", prompt="x", max_tokens=1
        )


def _post(server: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server}{path}", json=body, headers={"Authorization": "Bearer sekret"}, timeout=120)


def test_scoring_50_items_equals_50_single_completions(server: str, client: openai.OpenAI) -> None:
    query = list(range(200, 264))  # 4 blocks of 16: the shared prefix
    items = [[300 + i, 301 + i, 302] for i in range(50)]
    labels = [11, 12]
    vllm = _post(server, "/generative_scoring", {"query": query, "items": items, "label_token_ids": labels})
    sglang = _post(
        server, "/v1/score", {"query": query, "items": items, "label_token_ids": labels, "apply_softmax": False}
    )
    assert vllm.status_code == 200 and sglang.status_code == 200, (vllm.text, sglang.text)
    results, scores = vllm.json()["results"], sglang.json()["scores"]
    assert len(results) == len(scores) == 50 and sglang.json()["object"] == "scoring"
    # The query was computed once: one forward computes it for all 50 items (or a later one finds it cached).
    usage = vllm.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] + usage["tiered"]["batch_shared_tokens"] >= 49 * 64
    singles = client.completions.create(
        model="tiny", prompt=[query + item for item in items], max_tokens=1, extra_body={"logprob_token_ids": labels}
    )
    for choice in singles.choices:
        lp = choice.model_extra["logprob_token_ids"]
        p11, p12 = math.exp(lp["11"]), math.exp(lp["12"])
        assert abs(scores[choice.index][0] - p11) < 1e-6 and abs(scores[choice.index][1] - p12) < 1e-6
        probs = results[choice.index]["token_probs"]
        assert abs(probs["11"] - p11 / (p11 + p12)) < 1e-5 and abs(probs["11"] + probs["12"] - 1) < 1e-6


def test_text_scoring_puts_the_item_first_when_asked(server: str, tiny_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_dir))
    model = load_model(tiny_dir)
    body = {
        "query": " Answer:",
        "items": ["Post: bread.", "Post: football."],
        "label_token_ids": [11, 12],
        "item_first": True,
        "apply_softmax": False,
    }
    r = _post(server, "/v1/score", body)
    assert r.status_code == 200, r.text
    for item, row in zip(body["items"], r.json()["scores"], strict=True):
        ids = tok.encode(item) + tok.encode(" Answer:", add_special_tokens=False)
        ref = torch.softmax(forward(model, torch.tensor(ids)), dim=-1)
        assert abs(row[0] - float(ref[11])) < 1e-5 and abs(row[1] - float(ref[12])) < 1e-5
    bad = _post(server, "/v1/score", {"query": "q", "items": [], "label_token_ids": [1]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "items"


def test_chat_completion_uses_the_chat_template(client: openai.OpenAI, tiny_dir: Path) -> None:
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "Will the user like this post? Answer:"}]
    out = client.chat.completions.create(
        model="tiny", messages=messages, max_completion_tokens=1, logprobs=True, top_logprobs=2
    )
    tok = AutoTokenizer.from_pretrained(str(tiny_dir))
    ids = tok.encode(
        tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False
    )
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    ref = torch.log_softmax(forward(load_model(tiny_dir), torch.tensor(ids)), dim=-1)
    content = out.choices[0].logprobs.content[0]
    assert abs(content.logprob - float(ref.max())) < 1e-4 and len(content.top_logprobs) == 2
    assert out.usage.prompt_tokens == len(ids) and out.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="max_tokens must be 1"):
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=3)


def test_64_concurrent_requests_all_answered_correctly(server: str, tiny_dir: Path) -> None:
    import asyncio

    model = load_model(tiny_dir)
    prompts = [[0] + [(7 * i + j) % 1300 + 1 for j in range(20 + i)] for i in range(64)]

    async def run() -> list:
        aclient = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="sekret")
        calls = [
            aclient.completions.create(model="tiny", prompt=p, max_tokens=1, extra_body={"logprob_token_ids": [5]})
            for p in prompts
        ]
        return await asyncio.gather(*calls)

    outs = asyncio.run(run())
    assert len(outs) == 64
    for prompt, out in zip(prompts, outs, strict=True):
        ref = torch.log_softmax(forward(model, torch.tensor(prompt)), dim=-1)
        assert abs(out.choices[0].model_extra["logprob_token_ids"]["5"] - float(ref[5])) < 1e-4


def test_metrics_in_vllms_names_with_buckets_labels_and_tiers(server: str, tiny_dir: Path) -> None:
    r = httpx.get(f"{server}/metrics", timeout=5)
    values = parse(r.text)
    ok = values["vllm:request_success_total"]
    name = str(tiny_dir)  # the served name: the model argument as given
    assert ok >= 1 and values[f"vllm:request_success_total{{finished_reason=length,model_name={name}}}"] == ok
    # Host-tier transfers (an earlier test loaded a prefix): bytes are KV bytes of the hit tokens.
    a = read_args(tiny_dir)
    kv_bytes_per_token = 2 * a.num_layers * a.num_kv_heads * a.head_dim * 4  # fp32
    device = values[f"tiered:prefix_cache_hits_total{{model_name={name},tier=device}}"]
    host = values[f"tiered:prefix_cache_hits_total{{model_name={name},tier=host}}"]
    assert host > 0 and values["tiered:host_load_seconds_total"] > 0
    assert values["tiered:host_load_bytes_total"] == host * kv_bytes_per_token
    assert values["tiered:host_store_bytes_total"] > 0 and values["tiered:host_store_dropped_chunks_total"] == 0
    assert values["vllm:prefix_cache_hits_total"] == device + host
    assert 0 <= values["vllm:prefix_cache_hits_total"] <= values["vllm:prefix_cache_queries_total"]
    assert values["vllm:prompt_tokens_total"] == values["vllm:prefix_cache_queries_total"]
    # Histograms with buckets (histogram_quantile works): every answer is in the +Inf bucket.
    for metric in (
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_prompt_tokens",
    ):
        assert values[f"vllm:{metric}_count"] == ok
        assert values[f"vllm:{metric}_bucket{{le=+Inf,model_name={name}}}"] == ok
    assert values[f"vllm:e2e_request_latency_seconds_bucket{{le=0.3,model_name={name}}}"] <= ok
    assert "tiered:jct_prediction_error" in values and values["vllm:num_requests_waiting"] == 0
    assert any(name.startswith("lmcache:") for name in values), "LMCache's own metrics are exposed too"


def test_vllm_extras_choose_the_token_and_salt_the_cache(client: openai.OpenAI, tiny_dir: Path) -> None:
    model = load_model(tiny_dir)
    prompt = [0] + list(range(400, 440))
    ref = torch.log_softmax(forward(model, torch.tensor(prompt)), dim=-1)
    allowed = [int(ref.argsort()[3]), int(ref.argsort()[8])]  # neither is the argmax
    out = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=1, logprobs=1, extra_body={"allowed_token_ids": allowed, "priority": -5}
    )
    chosen = max(allowed, key=lambda t: float(ref[t]))
    assert out.choices[0].text == client_decode(tiny_dir, chosen)
    biased = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, logit_bias={"7": 100})
    assert biased.choices[0].text == client_decode(tiny_dir, 7)
    long = [0] + list(range(500, 564))  # 4 full blocks of 16 below the last token
    first = client.completions.create(model="tiny", prompt=long, max_tokens=1, extra_body={"cache_salt": "tenant-a"})
    other = client.completions.create(model="tiny", prompt=long, max_tokens=1, extra_body={"cache_salt": "tenant-b"})
    same = client.completions.create(model="tiny", prompt=long, max_tokens=1, extra_body={"cache_salt": "tenant-a"})
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert other.usage.prompt_tokens_details.cached_tokens == 0  # another salt never sees tenant-a's KV
    assert same.usage.prompt_tokens_details.cached_tokens == 64


def client_decode(tiny_dir: Path, token: int) -> str:
    from transformers import AutoTokenizer

    return str(AutoTokenizer.from_pretrained(str(tiny_dir)).decode([token]))


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"prompt": [1, 2], "allowed_token_ids": [5000]}, "allowed_token_ids", "token id 5000 is outside"),
        ({"prompt": [1, 2], "allowed_token_ids": []}, "allowed_token_ids", "allowed_token_ids must not be empty"),
        ({"prompt": [1, 2], "logit_bias": {"x": 1}}, "logit_bias", "logit_bias keys must be token ids"),
        ({"prompt": [1, 2], "logit_bias": {"5": 300}}, "logit_bias", "logit_bias values must be in [-100, 100]"),
        ({"prompt": [1, 2], "cache_salt": ""}, "cache_salt", "cache_salt must be a non-empty string"),
        ({"prompt": [1, 2], "priority": "high"}, "priority", "priority: Input should be a valid integer"),
    ],
)
def test_bad_extras_get_a_400_naming_them(server: str, body: dict, param: str, message: str) -> None:
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert r.json()["error"]["message"].startswith(message)


@pytest.mark.parametrize(
    ("content", "status"),
    [
        (b"{not json", 400),
        (b'{"prompt": "\xff\xfe"}'.replace(b"\\xff\\xfe", b"\xff\xfe"), 400),  # invalid UTF-8
        (b"[" * 100000 + b"]" * 100000, 400),  # deep JSON
        (b'{"prompt": "' + b"a" * (17 * 2**20) + b'"}', 413),  # over server.max_body_bytes
    ],
)
def test_hostile_bodies_get_a_4xx_envelope(server: str, content: bytes, status: int) -> None:
    headers = {"Authorization": "Bearer sekret", "Content-Type": "application/json"}
    r = httpx.post(f"{server}/v1/completions", content=content, headers=headers, timeout=60)
    assert r.status_code == status and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(f"{server}/health", timeout=5).status_code == 200


def test_unknown_routes_and_methods_use_the_envelope(server: str) -> None:
    headers = {"Authorization": "Bearer sekret"}
    assert httpx.get(f"{server}/v1/nothing", headers=headers, timeout=5).json()["error"]["code"] == 404
    assert httpx.get(f"{server}/v1/completions", headers=headers, timeout=5).json()["error"]["code"] == 405


def test_fuzzing_from_the_openapi_schema_finds_no_server_error(server: str, tmp_path: Path) -> None:
    """schemathesis generates valid and invalid bodies for every route from /openapi.json."""
    import shutil
    import sys

    cli = shutil.which("schemathesis") or str(Path(sys.executable).parent / "schemathesis")
    out = subprocess.run(
        [
            cli,
            "run",
            f"{server}/openapi.json",
            "--checks",
            "not_a_server_error,negative_data_rejection",
            "--header",
            "Authorization: Bearer sekret",
            "--max-examples",
            "25",
            "--seed",
            "7",
            "--workers",
            "1",
            "--phases",
            "examples,coverage,fuzzing",
            "--request-timeout",
            "60",
            "--report",
            "junit",
            "--report-junit-path",
            str(tmp_path / "fuzz.xml"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,  # its example database (.schemathesis/) goes there, not into the checkout
    )
    assert out.returncode == 0, out.stdout[-4000:]
    assert httpx.get(f"{server}/health", timeout=5).status_code == 200


def test_a_call_that_cannot_meet_its_objective_is_refused_at_once(server: str) -> None:
    """`scheduler.late: shed` (the default): a call whose objective is shorter than its own predicted
    time even with its whole prefix cached gets a 400 naming `slo_ms`, with OpenAI's error body and
    no Retry-After, from the engine (no forward runs, so the API does not refuse it for waiting);
    it is answered once, counted as unmeetable, and the engine goes on."""
    fresh = [(t * 7) % 1290 + 3 for t in range(1000)]
    headers = {"Authorization": "Bearer sekret"}
    sent = time.perf_counter()
    shed = httpx.post(f"{server}/v1/completions", json={"prompt": fresh[::-1], "slo_ms": 0.01}, headers=headers)
    elapsed = time.perf_counter() - sent
    assert httpx.post(f"{server}/v1/completions", json={"prompt": fresh}, headers=headers).status_code == 200
    error = shed.json()["error"]
    assert shed.status_code == 400 and error["type"] == "objective_unmeetable" and error["param"] == "slo_ms"
    assert error["message"].startswith("objective unmeetable") and "Retry-After" not in shed.headers
    assert "with its prefix cached: no wait or retry can meet it" in error["message"]
    m = _metrics(server)
    assert m["tiered:requests_refused_total{model_name=" + m_name(server) + ",reason=unmeetable}"] == 1
    assert m["tiered:deadline_total"] == 1 and m["tiered:predicted_wait_seconds"] >= 0
    # refused on its first look: timed from the server's receipt, within what the client waited
    assert m["tiered:shed_delay_seconds_count"] == 1 and 0 <= m["tiered:shed_delay_seconds_sum"] <= elapsed
    assert httpx.post(f"{server}/v1/completions", json={"prompt": [1, 2]}, headers=headers).status_code == 200


def m_name(server: str) -> str:
    """The served model's name (the metrics' model_name label)."""
    models = httpx.get(f"{server}/v1/models", headers={"Authorization": "Bearer sekret"}, timeout=5).json()
    return str(models["data"][0]["id"])


def _engine_pid(server_pid: int) -> int:
    import psutil

    (engine,) = [p for p in psutil.Process(server_pid).children() if "spawn_main" in " ".join(p.cmdline())]
    return engine.pid


def _metrics(url: str) -> dict[str, float]:
    return parse(httpx.get(f"{url}/metrics", timeout=5).text)


@pytest.fixture()
def faulty(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, str]]:
    """A server of its own (these tests kill its parts), with a 2 s request timeout."""
    jct = tmp_path_factory.mktemp("jct-faulty")
    sets = [
        "cache.block_tokens=16",
        f"scheduler.profile_cache_dir={jct}",
        "server.request_timeout_s=2",
        "scheduler.profile_tokens=[64,256]",
    ]
    proc, url = start_server([str(tiny_dir), *(a for s in sets for a in ("--set", s))], timeout_s=180)
    yield proc, url
    if proc.poll() is None:
        stop_server(proc)


def test_timeouts_and_disconnects_cancel_waiting_requests(faulty: tuple[ServerProcess, str]) -> None:
    """Enough fresh 8,000-token requests for about 6 s of work (at least 30) against a 2 s timeout:
    the late ones get 504 and leave the engine's queue; a client that hangs up has its request
    cancelled too. Nothing stays pinned."""
    import concurrent.futures
    import math

    _, url = faulty
    # The first request also pays the server's warm-up; a second, fresh one times a request alone.
    for offset in (0, 7):
        start = time.perf_counter()
        fresh = [(t + offset) % 1290 + 3 for t in range(8000)]
        assert httpx.post(f"{url}/v1/completions", json={"prompt": fresh}).status_code == 200
    num = max(30, math.ceil(6 / (time.perf_counter() - start)))
    prompts = [[(i * 31 + t) % 1290 + 3 for t in range(8000)] for i in range(1, num + 1)]
    with concurrent.futures.ThreadPoolExecutor(num + 1) as pool:
        futures = [pool.submit(httpx.post, f"{url}/v1/completions", json={"prompt": p}, timeout=60) for p in prompts]

        def hang_up() -> None:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{url}/v1/completions", json={"prompt": prompts[0][::-1]}, timeout=0.3)

        pool.submit(hang_up).result()
        codes = [f.result().status_code for f in futures]
    assert set(codes) == {200, 504} and codes.count(504) >= 5, codes
    assert all(f.result().json()["error"]["type"] == "timeout" for f in futures if f.result().status_code == 504)
    ok = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2, 3]}, timeout=30)
    assert ok.status_code == 200
    m = _metrics(url)
    assert m["tiered:request_timeout_total"] == codes.count(504) and m["tiered:request_cancelled_total"] == 1
    assert m["tiered:engine_cancelled_requests_total"] >= 5  # dropped while waiting: never computed
    assert m["tiered:device_tier_pinned_blocks"] == 0 and m["vllm:num_requests_waiting"] == 0


def test_a_dead_engine_answers_503_and_is_restarted(faulty: tuple[ServerProcess, str]) -> None:
    import os
    import signal

    proc, url = faulty
    os.kill(_engine_pid(proc.pid), signal.SIGKILL)
    r = httpx.post(f"{url}/v1/completions", json={"prompt": [t % 1300 + 1 for t in range(4000)]}, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
    deadline = time.monotonic() + 120
    while httpx.get(f"{url}/health", timeout=5).status_code != 200:
        assert time.monotonic() < deadline, "the engine was not restarted"
        time.sleep(0.5)
    assert httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2, 3]}, timeout=30).status_code == 200
    assert _metrics(url)["tiered:engine_restarts_total"] == 1


def test_sigterm_stops_both_processes_cleanly(faulty: tuple[ServerProcess, str]) -> None:
    import signal

    import psutil

    proc, url = faulty
    engine = psutil.Process(_engine_pid(proc.pid))
    proc.terminate()
    # uvicorn shuts down gracefully, then re-raises the signal it caught (the usual exit status for it)
    assert proc.wait(60) in (0, -signal.SIGTERM)
    engine.wait(10)  # raises if the engine process outlives the server
    err = proc.log_tail(100_000)
    assert "stopping the engine process" in err and "tiered-engine tiered.api.engine_process: SIGTERM: stopping" in err
    assert "Traceback" not in err and "\x1b[" not in err  # one plain format: no ANSI colours


KEY = {"Authorization": "Bearer sekret"}


def test_version_tokenize_and_detokenize_in_vllms_shapes(server: str, tiny_dir: Path) -> None:
    from transformers import AutoTokenizer

    from tiered import __version__

    tok = AutoTokenizer.from_pretrained(str(tiny_dir))
    assert httpx.get(f"{server}/version", headers=KEY).json() == {"version": __version__}
    text = "Post: five easy bread recipes"
    r = httpx.post(f"{server}/tokenize", headers=KEY, json={"model": "tiny", "prompt": text}).json()
    assert r["tokens"] == tok.encode(text) and r["count"] == len(r["tokens"]) and r["max_model_len"] == 1024
    plain = httpx.post(
        f"{server}/tokenize", headers=KEY, json={"prompt": text, "add_special_tokens": False, "return_token_strs": True}
    ).json()
    assert plain["tokens"] == tok.encode(text, add_special_tokens=False) and plain["count"] == r["count"] - 1
    assert plain["token_strs"] == tok.convert_ids_to_tokens(plain["tokens"])
    chat = httpx.post(f"{server}/tokenize", headers=KEY, json={"messages": [{"role": "user", "content": "hi"}]})
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat.json()["tokens"] == tok.encode(rendered, add_special_tokens=False)
    back = httpx.post(f"{server}/detokenize", headers=KEY, json={"tokens": plain["tokens"]}).json()
    assert back == {"prompt": tok.decode(plain["tokens"])}
    bad = httpx.post(f"{server}/detokenize", headers=KEY, json={"tokens": [10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    unknown = httpx.post(f"{server}/tokenize", headers=KEY, json={"model": "nope", "prompt": "x"})
    assert unknown.status_code == 404 and unknown.json()["error"]["message"] == "The model `nope` does not exist."


def test_x_request_id_is_echoed_and_names_the_response(server: str, tiny_dir: Path) -> None:
    r = httpx.post(
        f"{server}/v1/completions",
        headers={**KEY, "X-Request-Id": "abc-123"},
        json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 1},
    )
    assert r.status_code == 200 and r.headers["x-request-id"] == "abc-123" and r.json()["id"] == "cmpl-abc-123"
    assert r.json()["model"] == str(tiny_dir)  # the folder's name is an alias; the served name is reported
    refused = httpx.post(f"{server}/v1/completions", headers={**KEY, "X-Request-Id": "bad-1"}, json={"prompt": []})
    assert refused.status_code == 400 and refused.headers["x-request-id"] == "bad-1"


def test_streaming_is_a_clear_400_and_add_special_tokens_is_honoured(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="stream=true is not supported"):
        client.completions.create(model="tiny", prompt="hello", max_tokens=1, stream=True)
    with pytest.raises(openai.BadRequestError, match="stream=true is not supported"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True)
    with_bos = client.completions.create(model="tiny", prompt="hello there", max_tokens=1)
    without = client.completions.create(
        model="tiny", prompt="hello there", max_tokens=1, extra_body={"add_special_tokens": False}
    )
    assert without.usage.prompt_tokens == with_bos.usage.prompt_tokens - 1
    with pytest.raises(openai.NotFoundError, match="The model `other` does not exist."):
        client.completions.create(model="other", prompt="hello", max_tokens=1)
