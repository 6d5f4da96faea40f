"""A real `tiered serve` (API process + engine process) on the tiny model, through the openai client."""

from __future__ import annotations

import math
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch

from tiered.api.launch import start_server, stop_server
from tiered.hybrid.forward import forward
from tiered.hybrid.loader import load_model


@pytest.fixture(scope="module")
def server(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    jct = tmp_path_factory.mktemp("jct")
    proc, url = start_server([str(tiny_dir), "--api-key", "sekret", "--set", "cache.block_tokens=16",
                              "--set", f"scheduler.profile_cache_dir={jct}", "--set", "model.max_model_len=1024"],
                             timeout_s=180)  # fmt: skip
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="sekret")


def test_completions_equal_the_in_process_forward(client: openai.OpenAI, tiny_dir: Path) -> None:
    model = load_model(tiny_dir)
    prompts = [[0] + list(range(10, 10 + n)) for n in (5, 50, 300)]
    out = client.completions.create(model="tiny", prompt=prompts, max_tokens=1, logprobs=3,
                                    extra_body={"logprob_token_ids": [11, 12]})  # fmt: skip
    assert len(out.choices) == 3 and out.usage.prompt_tokens == sum(map(len, prompts))
    for choice in out.choices:
        ref = torch.log_softmax(forward(model, torch.tensor(prompts[choice.index])), dim=-1)
        got = choice.model_extra["logprob_token_ids"]
        assert abs(got["11"] - float(ref[11])) < 1e-4 and abs(got["12"] - float(ref[12])) < 1e-4
        assert abs(choice.logprobs.token_logprobs[0] - float(ref.max())) < 1e-4
        assert len(choice.logprobs.top_logprobs[0]) <= 3


def test_a_shared_prefix_is_reported_as_cached(client: openai.OpenAI) -> None:
    prefix = list(range(100, 164))  # 4 blocks of 16
    client.completions.create(model="tiny", prompt=prefix + [7, 8], max_tokens=1)
    # Nothing else waited, so the `prefix` policy kept nothing on the device: the host tier has it.
    again = client.completions.create(model="tiny", prompt=prefix + [9, 10], max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens == 64
    assert again.usage.model_extra["tiered"] == {"device_hit_tokens": 0, "host_hit_tokens": 64}
    # Loading it put it in device blocks: now it is a device hit.
    third = client.completions.create(model="tiny", prompt=prefix + [11, 12], max_tokens=1)
    assert third.usage.model_extra["tiered"] == {"device_hit_tokens": 64, "host_hit_tokens": 0}


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


def test_api_key_is_required_except_for_health(server: str) -> None:
    r = httpx.get(f"{server}/v1/models", timeout=5)
    assert r.status_code == 401 and r.json()["error"]["message"] == "Incorrect API key provided."
    ok = httpx.get(f"{server}/v1/models", headers={"Authorization": "Bearer sekret"}, timeout=5)
    assert ok.status_code == 200 and ok.json()["data"][0]["max_model_len"] == 1024
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
    # The query was computed once and found in the tiers by the other 49 items.
    assert vllm.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 49 * 64
    singles = client.completions.create(model="tiny", prompt=[query + item for item in items], max_tokens=1,
                                        extra_body={"logprob_token_ids": labels})  # fmt: skip
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
    body = {"query": " Answer:", "items": ["Post: bread.", "Post: football."], "label_token_ids": [11, 12],
            "item_first": True, "apply_softmax": False}  # fmt: skip
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
    out = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=1, logprobs=True,
                                         top_logprobs=2)  # fmt: skip
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
        calls = [aclient.completions.create(model="tiny", prompt=p, max_tokens=1, extra_body={"logprob_token_ids": [5]})
                 for p in prompts]  # fmt: skip
        return await asyncio.gather(*calls)

    outs = asyncio.run(run())
    assert len(outs) == 64
    for prompt, out in zip(prompts, outs, strict=True):
        ref = torch.log_softmax(forward(model, torch.tensor(prompt)), dim=-1)
        assert abs(out.choices[0].model_extra["logprob_token_ids"]["5"] - float(ref[5])) < 1e-4


def test_metrics_count_requests_and_cached_tokens(server: str) -> None:
    text = httpx.get(f"{server}/metrics", headers={"Authorization": "Bearer sekret"}, timeout=5).text
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if not line.startswith("#")}
    assert values["tiered:request_success"] >= 1
    assert values["tiered:prefix_cache_hits"] == values["tiered:device_hit_tokens"] + values["tiered:host_hit_tokens"]
    assert 0 <= values["tiered:prefix_cache_hits"] <= values["tiered:prefix_cache_queries"]
    assert values["tiered:e2e_request_latency_seconds_count"] == values["tiered:request_success"]
    assert "tiered:jct_prediction_error" in values and values["tiered:num_requests_waiting"] == 0


def test_engine_death_answers_503_instead_of_hanging(tiny_dir: Path, tmp_path: Path) -> None:
    """Kill the engine process: a request gets a 503 (never a hang) and /health turns 503."""
    import os
    import signal

    proc, url = start_server([str(tiny_dir), "--set", "cache.block_tokens=16",
                              "--set", f"scheduler.profile_cache_dir={tmp_path}"], timeout_s=180)  # fmt: skip
    try:
        engine_pid = int(
            subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()[-1]
        )
        os.kill(engine_pid, signal.SIGKILL)
        r = httpx.post(
            f"{url}/v1/completions", json={"prompt": [t % 1300 + 1 for t in range(4000)], "max_tokens": 1}, timeout=30
        )
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        assert httpx.get(f"{url}/health", timeout=5).status_code == 503
    finally:
        stop_server(proc)
