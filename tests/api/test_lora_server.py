"""Adapters through `tiered serve`: vLLM's flags and routes, the openai client, the errors."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch

from benchmarks.launch import start_server, stop_server
from tiered.cli import main
from tiered.hybrid.forward import forward
from tiered.hybrid.loader import load_model
from tiered.hybrid.lora import load_adapter, read_adapter


@pytest.fixture(scope="module")
def server(
    tiny_dir: Path, adapter_dirs: dict[tuple[str, str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    jct = tmp_path_factory.mktemp("jct")
    proc, url = start_server(
        [
            str(tiny_dir),
            "--served-model-name",
            "base",
            "--set",
            "cache.block_tokens=16",
            "--set",
            f"scheduler.profile_cache_dir={jct}",
            "--set",
            "model.max_model_len=1024",
            "--enable-lora",
            "--lora-modules",
            f"small={adapter_dirs[('tiny', 'small')]}",
            "--max-lora-rank",
            "8",
            "--set",
            "lora.allow_runtime_updates=true",
        ],
        timeout_s=180,
    )
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused")


def _logprob(client: openai.OpenAI, model: str, prompt: list[int]) -> tuple[float, str]:
    out = client.completions.create(model=model, prompt=prompt, max_tokens=1, extra_body={"logprob_token_ids": [5]})
    return out.choices[0].model_extra["logprob_token_ids"]["5"], out.model


def _reference(tiny_dir: Path, folder: Path | None, prompt: list[int]) -> float:
    model = load_model(tiny_dir)
    w = None
    if folder is not None:
        w = load_adapter(read_adapter("ref", folder, model.args, 64), model.args.num_layers, torch.float32, "cpu")
    return float(torch.log_softmax(forward(model, torch.tensor(prompt), adapter=w), dim=-1)[5])


def test_a_request_picks_its_adapter_by_model(
    client: openai.OpenAI, tiny_dir: Path, adapter_dirs: dict[tuple[str, str], Path]
) -> None:
    ids = [m.id for m in client.models.list().data]
    assert ids == ["base", "small"]
    prompt = list(range(3, 60))
    base, small = _reference(tiny_dir, None, prompt), _reference(tiny_dir, adapter_dirs[("tiny", "small")], prompt)
    assert abs(base - small) > 1e-2
    for model, expected in (("base", base), ("small", small)):
        got, name = _logprob(client, model, prompt)
        assert abs(got - expected) < 1e-4 and name == model


def test_an_unknown_model_is_a_404_in_vllms_words(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="The model `nope` does not exist."):
        client.completions.create(model="nope", prompt=[1, 2, 3], max_tokens=1)


def test_adapters_load_and_unload_at_runtime(
    server: str, client: openai.OpenAI, tiny_dir: Path, adapter_dirs: dict[tuple[str, str], Path], tmp_path: Path
) -> None:
    wide = adapter_dirs[("tiny", "wide")]
    r = httpx.post(f"{server}/v1/load_lora_adapter", json={"lora_name": "wide", "lora_path": str(wide)}, timeout=30)
    assert r.status_code == 200 and "added successfully" in r.text
    assert [m.id for m in client.models.list().data] == ["base", "small", "wide"]
    prompt = list(range(10, 50))
    got, _ = _logprob(client, "wide", prompt)
    assert abs(got - _reference(tiny_dir, wide, prompt)) < 1e-4
    again = httpx.post(f"{server}/v1/load_lora_adapter", json={"lora_name": "wide", "lora_path": str(wide)})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    broken = Path(shutil.copytree(wide, tmp_path / "broken"))
    (broken / "adapter_config.json").write_text('{"r": 0, "lora_alpha": 1}')
    bad = httpx.post(f"{server}/v1/load_lora_adapter", json={"lora_name": "broken", "lora_path": str(broken)})
    assert bad.status_code == 400
    assert "adapter_config.json: field 'r' must be a positive integer" in bad.json()["error"]["message"]
    r = httpx.post(f"{server}/v1/unload_lora_adapter", json={"lora_name": "wide"})
    assert r.status_code == 200 and "removed successfully" in r.text
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="wide", prompt=prompt, max_tokens=1)
    gone = httpx.post(f"{server}/v1/unload_lora_adapter", json={"lora_name": "wide"})
    assert gone.status_code == 404 and "cannot be found" in gone.json()["error"]["message"]
    empty = httpx.post(f"{server}/v1/unload_lora_adapter", json={"lora_name": ""})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "lora_name"
    missing = httpx.post(f"{server}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path / "no")})
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "NotFoundError"
    # A path the engine cannot even resolve is a clear 400, and the engine keeps serving.
    odd = httpx.post(f"{server}/v1/load_lora_adapter", json={"lora_name": "y", "lora_path": "~nosuchuser/x"})
    assert odd.status_code == 400 and "cannot be read" in odd.json()["error"]["message"]
    assert _logprob(client, "small", prompt)[1] == "small"


def test_serve_refuses_a_bad_adapter_folder_before_starting(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["serve", str(tiny_dir), "--enable-lora", "--lora-modules", f"x={tmp_path / 'missing'}"])
    assert code == 2
    err = capsys.readouterr().err
    assert "--lora-modules: adapter 'x'" in err and "adapter_config.json does not exist" in err
