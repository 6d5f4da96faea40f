"""Adapters in the engine: per-adapter KV in both tiers, LRU residency, batches of mixed
adapters equal to the single runs, runtime load/unload, and the scheduler's adapter grouping."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tiered.config import load_config
from tiered.embedded import make_adapter
from tiered.engine import Engine, Result, ScoreParams
from tiered.engine.adapters import UnknownAdapterError
from tiered.hybrid.forward import forward
from tiered.hybrid.lora import AdapterError, load_adapter, read_adapter
from tiered.request.score import RequestOptions

BT = 16
YES_NO = ScoreParams(logprob_token_ids=(11, 12))


def _engine(tiny_dir: Path, tmp_path: Path, adapters: dict[str, Path], *overrides: str) -> Engine:
    modules = [f"lora.modules.{name}={path}" for name, path in adapters.items()]
    cfg = load_config(
        None,
        [
            f"model.path={tiny_dir}",
            f"cache.block_tokens={BT}",
            "model.max_model_len=2048",
            "scheduler.profile_tokens=[64, 256]",
            f"scheduler.profile_cache_dir={tmp_path}",
            "scheduler.prefetch=false",
            "lora.enabled=true",
            *modules,
            *overrides,
        ],
    )
    return Engine(cfg)


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 1300, (n,), generator=torch.Generator().manual_seed(seed))


def _run(engine: Engine, prompts: list[tuple[torch.Tensor, str | None]]) -> list[Result]:
    ids = [engine.submit(p, YES_NO, options=RequestOptions(adapter=a)) for p, a in prompts]
    by_id = {r.request_id: r for r in engine.run()}
    return [by_id[i] for i in ids]


@pytest.fixture()
def two(adapter_dirs: dict[tuple[str, str], Path]) -> dict[str, Path]:
    return {"small": adapter_dirs[("tiny", "small")], "wide": adapter_dirs[("tiny", "wide")]}


def _reference(engine: Engine, folder: Path | None, ids: torch.Tensor) -> torch.Tensor:
    w = None
    if folder is not None:
        spec = read_adapter("ref", folder, engine.model.args, 64)
        w = load_adapter(spec, engine.model.args.num_layers, torch.float32, "cpu")
    return torch.log_softmax(forward(engine.model, ids, adapter=w), dim=-1)


def test_kv_is_shared_within_an_adapter_never_across(tiny_dir: Path, tmp_path: Path, two: dict[str, Path]) -> None:
    engine = _engine(tiny_dir, tmp_path, two, "cache.retention=all")
    profile = _ids(160, 1)
    prompt = lambda seed: torch.cat([profile, _ids(8, seed)])  # noqa: E731
    for adapter, seed in ((None, 2), ("small", 3), ("wide", 4)):
        (first,) = _run(engine, [(prompt(seed), adapter)])
        assert first.split.num_device_hit_tokens + first.split.num_host_hit_tokens == 0, adapter
    # Each adapter now finds its own copy of the profile on the device.
    for adapter, seed in ((None, 5), ("small", 6), ("wide", 7)):
        (again,) = _run(engine, [(prompt(seed), adapter)])
        assert again.split.num_device_hit_tokens == 160, adapter
        ref = _reference(engine, two.get(adapter or ""), prompt(seed))
        assert abs(again.logprobs[11] - float(ref[11])) < 1e-4
    # And in the host tier: with the device tier emptied, each adapter loads only its own blocks.
    engine.tiers.flush()
    engine.tiers.device_tier.clear()
    (host,) = _run(engine, [(prompt(8), "wide")])
    assert host.split.num_host_hit_tokens == 160
    ref = _reference(engine, two["wide"], prompt(8))
    assert abs(host.logprobs[11] - float(ref[11])) < 1e-4
    engine.close()


def test_a_mixed_batch_equals_single_runs_and_adapters_stay_within_max_loras(
    tiny_dir: Path, tmp_path: Path, two: dict[str, Path], model_dirs: dict[str, Path]
) -> None:
    # An adapter made for another model (its MLP is 160 wide, ours 176) stops the engine's start.
    other = make_adapter(model_dirs["tiny-mistral"], tmp_path / "other", targets=("gate_proj",))
    three = {**two, "other": other}
    with pytest.raises(AdapterError, match="adapter 'other'.*this model needs"):
        _engine(tiny_dir, tmp_path, three)
    engine = _engine(tiny_dir, tmp_path, two, "lora.max_loras=1")
    profile = _ids(64, 9)
    prompts = [(torch.cat([profile, _ids(10 + i, 20 + i)]), [None, "small", "wide"][i % 3]) for i in range(9)]
    results = _run(engine, prompts)
    # One adapter per batch at most (max_loras=1): the base model's requests may join any batch.
    assert max(r.batch_size for r in results) > 1
    stats = engine.adapters.stats()  # type: ignore[union-attr]
    assert stats.num_resident == 1 and stats.num_loads >= 2 and stats.num_evictions >= 1
    for (ids, adapter), r in zip(prompts, results, strict=True):
        ref = _reference(engine, two.get(adapter or ""), ids)
        assert abs(r.logprobs[11] - float(ref[11])) < 1e-4 and abs(r.logprobs[12] - float(ref[12])) < 1e-4
    engine.close()


def test_an_adapter_folder_changed_on_disk_fails_only_its_requests(
    tiny_dir: Path, tmp_path: Path, two: dict[str, Path]
) -> None:
    folders = {name: Path(shutil.copytree(path, tmp_path / name)) for name, path in two.items()}
    engine = _engine(tiny_dir, tmp_path, folders)
    changed = folders["wide"] / "adapter_model.safetensors"
    save_file({k: v * 2 for k, v in load_file(str(changed)).items()}, str(changed))
    prompts = [(_ids(30, 40 + i), [None, "small", "wide"][i % 3]) for i in range(6)]
    results = _run(engine, prompts)
    for (ids, adapter), r in zip(prompts, results, strict=True):
        if adapter == "wide":
            assert r.error is not None and "changed since it was checked" in r.error
        else:
            assert r.error is None
            assert abs(r.logprobs[11] - float(_reference(engine, two.get(adapter or ""), ids)[11])) < 1e-4
    engine.close()


def test_adapters_load_and_unload_at_runtime(tiny_dir: Path, tmp_path: Path, two: dict[str, Path]) -> None:
    engine = _engine(tiny_dir, tmp_path, {})
    prompt = _ids(40, 3)
    with pytest.raises(UnknownAdapterError, match="The model `small` does not exist"):
        engine.submit(prompt, YES_NO, options=RequestOptions(adapter="small"))
    engine.add_adapter("small", str(two["small"]))
    with pytest.raises(AdapterError, match="already been loaded"):
        engine.add_adapter("small", str(two["wide"]))
    waiting = engine.submit(prompt, YES_NO, options=RequestOptions(adapter="small"))
    engine.remove_adapter("small")  # a request already waiting still runs with it
    (r,) = engine.run()
    assert r.request_id == waiting and r.error is None
    assert abs(r.logprobs[11] - float(_reference(engine, two["small"], prompt)[11])) < 1e-4
    with pytest.raises(UnknownAdapterError, match="The model `small` does not exist"):
        engine.submit(prompt, YES_NO, options=RequestOptions(adapter="small"))
    with pytest.raises(UnknownAdapterError, match="cannot be found"):
        engine.remove_adapter("small")
    engine.close()


def test_the_scheduler_fills_a_batch_with_the_heads_adapter_first(
    tiny_dir: Path, tmp_path: Path, two: dict[str, Path]
) -> None:
    engine = _engine(tiny_dir, tmp_path, two, "scheduler.policy=fcfs", "scheduler.max_batch_tokens=60")
    # Arrival order alternates adapters; the budget takes three 20-token requests.
    order = ["small", "wide", "small", "wide", "small", "wide"]
    ids = [engine.submit(_ids(20, 30 + i), YES_NO, options=RequestOptions(adapter=a)) for i, a in enumerate(order)]
    first = engine.step()
    assert [r.request_id for r in first] == [ids[0], ids[2], ids[4]]
    engine.close()
