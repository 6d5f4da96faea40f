"""LongRoPE (Phi-3's long-context checkpoints): a prompt past the original length computes every
position with the long factors, a shorter one with the short factors, both with cos / sin scaled by
the attention factor; equal to transformers' model in every forward mode, in a batch that mixes
both, and through the engine, where K,V of one regime is never a cached prefix for the other."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tiered.config import load_config
from tiered.engine import Engine, ScoreParams
from tiered.hybrid.forward import BatchItem, forward, forward_batch
from tiered.hybrid.loader import load_model, read_args

ORIGINAL = 64  # tiny-phi3-longrope's original_max_position_embeddings
TOLERANCE = 1e-5  # max |Δ logit| / max |logit|, fp32: summation order only


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 1300, (n,), generator=torch.Generator().manual_seed(seed))


def _close(got: torch.Tensor, ref: torch.Tensor) -> None:
    err, scale = (got - ref).abs().max().item(), ref.abs().max().item()
    assert err <= TOLERANCE * scale, f"max error {err:.3g} > {TOLERANCE} x {scale:.3g}"


@pytest.fixture(scope="module")
def pair(model_dirs: dict[str, Path]) -> tuple[Path, torch.nn.Module]:
    folder = model_dirs["tiny-phi3-longrope"]
    return folder, AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def _reference(ref: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return ref(ids[None]).logits[0, -1].float()


def test_the_loader_reads_longrope(pair: tuple[Path, torch.nn.Module]) -> None:
    lr = read_args(pair[0]).longrope
    assert lr is not None and lr.original_max_position_embeddings == ORIGINAL
    assert lr.short_factor[1] == pytest.approx(1.1) and lr.long_factor[1] == pytest.approx(4.0)
    assert lr.attention_factor == pytest.approx(math.sqrt(1 + math.log(4096 / 64) / math.log(64)))
    args = read_args(pair[0])
    assert [args.rope_regime(n) for n in (1, ORIGINAL, ORIGINAL + 1)] == [0, 0, 1]


@pytest.mark.parametrize("length", [30, ORIGINAL, ORIGINAL + 1, 300])
def test_every_mode_matches_transformers_on_both_sides_of_the_original_length(
    pair: tuple[Path, torch.nn.Module], length: int
) -> None:
    folder, ref = pair
    model = load_model(folder)
    ids = _ids(length, seed=length)
    expected = _reference(ref, ids)
    for mode, chunk in (("vanilla", 1), ("chunked", 16), ("hybrid", 16), ("hybrid", 1000)):
        _close(forward(model, ids, mode=mode, chunk_tokens=chunk), expected)


def test_a_prefix_in_the_long_regime_and_a_batch_of_both_regimes(pair: tuple[Path, torch.nn.Module]) -> None:
    """A prefix shorter than the original length computed for a long prompt (its regime given) is
    that prompt's prefix; a batch of a short and a long prompt computes each in its own regime."""
    folder, ref = pair
    model = load_model(folder)
    long, short = _ids(200, seed=1), _ids(40, seed=2)
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    forward(model, long[:32], kv_sink=lambda i, k, v: kv.__setitem__(i, (k.clone(), v.clone())), rope_regime=1)
    prefix = [kv[i] for i in range(len(kv))]
    for mode in ("hybrid", "chunked"):
        _close(forward(model, long[32:], mode=mode, chunk_tokens=16, prefix_kv=prefix), _reference(ref, long))
    batch = forward_batch(model, [BatchItem(short), BatchItem(long)], chunk_tokens=16)
    _close(batch[0], _reference(ref, short))
    _close(batch[1], _reference(ref, long))


def test_the_engine_never_serves_one_regimes_kv_to_the_other(
    pair: tuple[Path, torch.nn.Module], tmp_path: Path
) -> None:
    """A short prompt's cached blocks are no prefix for a long prompt that starts with the same
    tokens; a long prompt's are for the next long one. Every answer equals transformers'."""
    folder, ref = pair
    cfg = load_config(
        None,
        [
            f"model.path={folder}",
            "model.dtype=float32",
            "model.max_model_len=2048",
            "cache.block_tokens=16",
            "cache.retention=all",
            "scheduler.profile_tokens=[64, 256]",
            f"scheduler.profile_cache_dir={tmp_path}",
        ],
    )
    profile = _ids(48, seed=3)
    prompts = [torch.cat([profile, _ids(8, seed=4)]), torch.cat([profile, _ids(150, seed=5)])]
    prompts.append(torch.cat([prompts[1][:160], _ids(30, seed=6)]))
    yes_no = ScoreParams(logprob_token_ids=(11, 12))
    with Engine(cfg) as engine:
        results = []
        for prompt in prompts:
            engine.submit(prompt, yes_no)
            (r,) = engine.run()
            results.append(r)
    assert [r.split.num_device_hit_tokens for r in results] == [0, 0, 160]
    for prompt, r in zip(prompts, results, strict=True):
        expected = torch.log_softmax(_reference(ref, prompt), dim=-1)
        assert max(abs(r.logprobs[t] - float(expected[t])) for t in (11, 12)) < 1e-4
