"""A remote store shared by engines (LMCache's Redis backend, a real redis-server): what one
engine stored, another finds, counted as remote hits, with the logits of a plain forward."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import torch
from through_tiers import forward_with_tiers

from tiered.config import HostTierConfig
from tiered.hybrid.forward import forward
from tiered.hybrid.loader import model_identity
from tiered.hybrid.model import CausalLM
from tiered.offload.tiers import KVTiers
from tiered.request.score import RequestOptions
from tiered.request.tokens import block_keys

BT = 16  # the block size of conftest's make_tiers
TOL = 1e-5  # fp32 logits, relative to the largest |logit|


def _tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 1300, (n,), generator=torch.Generator().manual_seed(seed))


def _remote(url: str) -> HostTierConfig:
    return HostTierConfig(lmcache={"max_local_cpu_size": 0.05, "remote_url": url})


def _in_redis(tiers: KVTiers, ids: torch.Tensor, want: int, keys: list[int] | None = None) -> None:
    """Wait until LMCache's asynchronous remote puts of `ids`' chunks have landed."""
    import redis

    host = tiers.host_tier
    assert host is not None
    client = redis.Redis.from_url(host._engine.config.remote_url)  # type: ignore[union-attr]
    names = [host._key(k).to_string() + "metadata" for k in keys or tiers.new_request("w", ids).keys]
    deadline = time.monotonic() + 20
    while sum(client.exists(k) for k in names) < want:
        assert time.monotonic() < deadline, "LMCache's remote puts did not land"
        time.sleep(0.05)


def _run(model: CausalLM, tiers: KVTiers, ids: torch.Tensor, name: str):
    return forward_with_tiers(model, tiers, tiers.new_request(name, ids), chunk_tokens=64)


def test_a_second_engine_loads_what_the_first_stored(model: CausalLM, make_tiers, redis_url: str) -> None:
    ids = _tokens(200, 1)  # 12 full blocks; the 13th is partial
    first = make_tiers(host=_remote(redis_url), model_identity="m-shared")
    _run(model, first, ids, "a")
    first.flush()
    _in_redis(first, ids, 12)
    second = make_tiers(host=_remote(redis_url), model_identity="m-shared")
    logits, prepared = _run(model, second, ids, "b")
    assert prepared.split.num_remote_hit_tokens == 192 and prepared.split.num_host_hit_tokens == 0
    assert second.stats().host.num_remote_hit_tokens == 192
    ref = forward(model, ids)
    assert (logits - ref).abs().max().item() <= TOL * ref.abs().max().item()
    # Another model's engine never finds them: the identity is part of every key.
    other = make_tiers(host=_remote(redis_url), model_identity="m-other")
    _, prepared = _run(model, other, ids, "c")
    assert prepared.split.num_remote_hit_tokens == 0 and prepared.split.num_miss_tokens == 200


def test_closing_a_tier_with_a_redis_backend_returns(model: CausalLM, make_tiers, redis_url: str) -> None:
    tiers = make_tiers(host=_remote(redis_url), model_identity="m-close")
    _run(model, tiers, _tokens(400, 3), "puts")  # 25 chunks: LMCache's remote puts still in flight at close
    done = threading.Event()
    thread = threading.Thread(target=lambda: (tiers.close(), done.set()), daemon=True)
    thread.start()
    assert done.wait(20), "closing LMCache's Redis connector deadlocked"


def test_redis_down_degrades_to_recomputation(model: CausalLM, make_tiers) -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tiers = make_tiers(host=_remote(f"redis://127.0.0.1:{port}"), model_identity="m-down")
    ids = _tokens(120, 2)
    for name in ("x", "y"):
        logits, prepared = _run(model, tiers, ids, name)
        tiers.flush()
        ref = forward(model, ids)
        assert (logits - ref).abs().max().item() <= TOL * ref.abs().max().item()
    # The second run found the first one's chunks in the local part of the host tier.
    assert prepared.split.num_remote_hit_tokens == 0 and prepared.split.num_host_hit_tokens > 0


def test_block_keys_do_not_depend_on_pythonhashseed() -> None:
    """Engines in different processes must agree on keys, salted and adapter ones included."""
    code = (
        "from tiered.request.tokens import block_keys;"
        "print(block_keys(list(range(64)), 16, 'salt', 'adapter-identity'))"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert outs == {str(block_keys(list(range(64)), 16, "salt", "adapter-identity"))}


def test_model_identity_follows_the_checkpoint_and_dtype(tiny_dir, tmp_path) -> None:
    import shutil

    same = model_identity(tiny_dir, "float32", 16)
    assert model_identity(tiny_dir, "float32", 16) == same
    assert model_identity(tiny_dir, "bfloat16", 16) != same
    assert model_identity(tiny_dir, "float32", 32) != same
    copy = tmp_path / "copy"
    shutil.copytree(tiny_dir, copy)
    assert model_identity(copy, "float32", 16) == same  # another folder, the same checkpoint
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one byte of the last tensor
    weights.write_bytes(bytes(data))
    assert model_identity(copy, "float32", 16) != same


def test_two_engines_share_one_redis_with_salted_prompts(tiny_dir, tmp_path, redis_url: str) -> None:
    """Whole engines, each with its own identity derived from the same checkpoint."""
    from tiered.config import load_config
    from tiered.engine import Engine, ScoreParams

    cfg = load_config(
        None,
        [
            f"model.path={tiny_dir}",
            "cache.block_tokens=16",
            "scheduler.profile_tokens=[64, 256]",
            f"scheduler.profile_cache_dir={tmp_path}",
            f"cache.host.lmcache={{remote_url: '{redis_url}'}}",
        ],
    )
    ids = _tokens(300, 7)
    params = ScoreParams(logprob_token_ids=(11, 12))
    results = []
    for _ in range(2):
        with Engine(cfg) as engine:
            engine.submit(ids, params, options=RequestOptions(cache_salt="tenant-a"))
            (result,) = engine.run()
            engine.tiers.flush()
            _in_redis_salted(engine, ids, 18)
            results.append(result)
    first, second = results
    assert first.split.num_remote_hit_tokens == 0 and second.split.num_remote_hit_tokens == 288
    assert all(abs(first.logprobs[t] - second.logprobs[t]) <= 1e-5 for t in (11, 12))


def _in_redis_salted(engine, ids: torch.Tensor, want: int) -> None:
    req = engine.tiers.new_request("w", ids, "tenant-a")
    _in_redis(engine.tiers, ids, want, req.keys)


def test_the_remote_lookup_stops_at_the_next_device_block(
    model: CausalLM, make_tiers, redis_url: str, monkeypatch
) -> None:
    """Blocks 0-2 and 4-9 on the device, block 3 evicted: LMCache is asked for block 3 alone (not
    for 3-9, which would load blocks the device holds a second time)."""
    tiers = make_tiers(host=_remote(redis_url), model_identity="m-gap", retention="all")
    ids = _tokens(168, 30)  # 10 full blocks and a partial one
    _run(model, tiers, ids, "first")
    tiers.flush()
    keys = tiers.new_request("k", ids).keys
    dt = tiers.device_tier
    evicted = dt._index[keys[3]]
    dt._lru.move_to_end(evicted, last=False)
    assert dt._evict_one()
    host = tiers.host_tier
    assert host is not None
    asked: list[list[int]] = []
    get = host.get
    monkeypatch.setattr(host, "get", lambda ks: (asked.append(list(ks)), get(ks))[1])
    logits, prepared = _run(model, tiers, ids, "again")
    assert asked == [[keys[3]]]
    split = prepared.split
    assert (split.num_device_hit_tokens, split.num_host_hit_tokens, split.num_remote_hit_tokens) == (144, 16, 0)
    ref = forward(model, ids)
    assert (logits - ref).abs().max().item() <= TOL * ref.abs().max().item()
