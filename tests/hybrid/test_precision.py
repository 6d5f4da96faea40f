"""Compute precision per machine: the `auto` rule on faked CPU flags, fp32 compute on bf16 weights
against transformers, bf16 tiers under fp32 compute, and keys that keep the two apart."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from tiered.config import load_config
from tiered.engine import Engine, ScoreParams
from tiered.hybrid import precision as precision_module
from tiered.hybrid.loader import model_identity
from tiered.hybrid.precision import checkpoint_dtype, cpu_flags, resolve_precision

AVX2 = frozenset({"avx", "avx2", "fma"})
AVX512_BF16 = AVX2 | {"avx512f", "avx512_bf16"}
AMX = AVX2 | {"avx512f", "amx_tile", "amx_bf16"}


@pytest.mark.parametrize(
    ("requested", "checkpoint", "device", "flags", "compute", "kv"),
    [
        ("auto", "bfloat16", "cpu", AVX2, "float32", "float32"),  # emulated bf16: fp32 compute, tiers alike
        ("auto", "bfloat16", "cpu", AVX512_BF16, "bfloat16", "bfloat16"),
        ("auto", "bfloat16", "cpu", AMX, "bfloat16", "bfloat16"),
        ("auto", "float32", "cpu", AMX, "float32", "float32"),  # an fp32 checkpoint stays fp32
        ("auto", "float16", "cpu", AVX512_BF16, "float32", "float32"),  # fp16 needs avx512_fp16 / amx_fp16
        ("auto", "float16", "cpu", AVX2 | {"avx512_fp16"}, "float16", "float16"),
        ("auto", "bfloat16", "cuda", frozenset(), "bfloat16", "bfloat16"),  # flags do not matter on a GPU
        ("bfloat16", "float32", "cpu", AVX2, "bfloat16", "bfloat16"),  # explicit: never overridden
        ("float32", "bfloat16", "cpu", AMX, "float32", "float32"),
    ],
)
def test_auto_follows_the_rule_and_an_explicit_dtype_wins(
    requested: str, checkpoint: str, device: str, flags: frozenset[str], compute: str, kv: str
) -> None:
    p = resolve_precision(requested, "auto", checkpoint, device, flags)
    assert (p.checkpoint, p.compute, p.kv) == (checkpoint, compute, kv)


def test_the_reason_names_what_was_missing_and_kv_dtype_can_be_forced() -> None:
    p = resolve_precision("auto", "auto", "bfloat16", "cpu", AVX2)
    assert p.describe() == (
        "bf16 weights, fp32 compute, fp32 KV tiers: this CPU has no native bf16 (no avx512_bf16 / amx_bf16 flag)"
    )
    assert resolve_precision("auto", "bfloat16", "bfloat16", "cpu", AVX2).kv == "bfloat16"  # compact tiers, asked
    assert "amx_bf16" in resolve_precision("auto", "auto", "bfloat16", "cpu", AMX).reason
    assert resolve_precision("auto", "auto", "bfloat16", "cuda", frozenset(), cuda_bf16=False).compute == "float32"


def test_cpu_flags_and_checkpoint_dtype_are_read_from_their_files(tmp_path: Path, tiny_dir: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu avx2 avx512_bf16\n\nprocessor\t: 1\n")
    assert cpu_flags(info) == {"fpu", "avx2", "avx512_bf16"}
    assert cpu_flags(tmp_path / "missing") == frozenset()
    assert checkpoint_dtype(tiny_dir) == "float32"
    folder = _bf16_copy(tiny_dir, tmp_path / "bf16")
    assert checkpoint_dtype(folder) == "bfloat16"
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["torch_dtype"]  # no dtype named: the safetensors header says it
    (folder / "config.json").write_text(json.dumps(cfg))
    assert checkpoint_dtype(folder) == "bfloat16"


def _bf16_copy(src: Path, dst: Path) -> Path:
    """The tiny checkpoint stored in bf16, as real checkpoints ship."""
    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in weights.items()}, str(dst / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["torch_dtype"] = "bfloat16"
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> Path:
    return _bf16_copy(tiny_dir, tmp_path_factory.mktemp("bf16") / "tiny-bf16")


def _engine(folder: Path, tmp_path: Path, *overrides: str) -> Engine:
    fixed = [
        f"model.path={folder}",
        "cache.block_tokens=16",
        "model.max_model_len=1024",
        "cache.retention=all",
        "scheduler.profile_tokens=[64]",
        f"scheduler.profile_cache_dir={tmp_path}",
    ]
    return Engine(load_config(None, [*fixed, *overrides]))


def _prompts() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(0, 1300, (320,), generator=g)
    return [torch.cat([prefix, torch.randint(0, 1300, (17 + i,), generator=g)]) for i in range(3)]


def _run_one_by_one(engine: Engine, prompts: list[torch.Tensor]) -> list[tuple[list[float], int]]:
    """Each prompt in its own step, so the later ones read the first one's prefix from the tiers."""
    out = []
    for p in prompts:
        engine.submit(p, ScoreParams(logprob_token_ids=tuple(range(40))))
        (r,) = engine.run()
        out.append(([r.logprobs[t] for t in range(40)], r.split.num_device_hit_tokens))
    return out


def test_fp32_compute_on_bf16_weights_equals_an_fp32_reference(
    bf16_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(precision_module, "cpu_flags", lambda: AVX2)
    engine = _engine(bf16_dir, tmp_path)
    assert (engine.precision.compute, engine.precision.kv) == ("float32", "float32")
    assert engine.model.lm_head.weight.dtype == torch.float32
    assert engine.tiers.device_tier.kv.dtype == torch.float32
    ref_model = AutoModelForCausalLM.from_pretrained(str(bf16_dir), dtype=torch.float32).eval()
    prompts = _prompts()
    got = _run_one_by_one(engine, prompts)
    engine.close()
    for p, (logprobs, _) in zip(prompts[:1], got, strict=False):  # the first computes all: no tier rounding
        with torch.no_grad():
            ref = torch.log_softmax(ref_model(p[None]).logits[0, -1].float(), dim=-1)
        assert max(abs(a - b) for a, b in zip(logprobs, ref[:40].tolist(), strict=True)) < 1e-4


def test_bf16_tiers_stay_within_bf16_rounding_of_fp32_tiers(
    bf16_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(precision_module, "cpu_flags", lambda: AVX2)
    prompts = _prompts()
    runs = {}
    for kv in ("float32", "bfloat16"):
        engine = _engine(bf16_dir, tmp_path, f"cache.kv_dtype={kv}")
        assert engine.precision.compute == "float32" and engine.tiers.device_tier.kv.dtype == getattr(torch, kv)
        runs[kv] = _run_one_by_one(engine, prompts)
        engine.close()
    assert len(list(tmp_path.glob("jct-*.json"))) == 2  # the JCT profile is keyed by the precision
    for (lp32, hits32), (lp16, hits16) in zip(runs["float32"], runs["bfloat16"], strict=True):
        assert hits32 == hits16
        diff = max(abs(a - b) for a, b in zip(lp32, lp16, strict=True))
        # 2^-8 relative rounding of K and V moves these logprobs (|logprob| < 10) by at most ~1e-2.
        assert diff < 2e-2
    assert [h for _, h in runs["bfloat16"]] == [0, 320, 320]
    # The first request computes everything (identical); the hits read bf16-rounded KV (they differ).
    assert runs["float32"][0][0] == runs["bfloat16"][0][0]
    assert runs["float32"][1][0] != runs["bfloat16"][1][0]


def test_explicit_dtype_is_kept_and_the_keys_name_the_precision(
    bf16_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(precision_module, "cpu_flags", lambda: AVX2)
    engine = _engine(bf16_dir, tmp_path, "model.dtype=bfloat16", "cache.suffix=discard")
    assert engine.precision.compute == "bfloat16" and engine.model.lm_head.weight.dtype == torch.bfloat16
    assert engine.precision.reason == "set by model.dtype"
    engine.close()
    monkeypatch.setattr(precision_module, "cpu_flags", lambda: AMX)
    engine = _engine(bf16_dir, tmp_path, "cache.suffix=discard")
    assert engine.precision.compute == "bfloat16"  # native here: auto keeps the checkpoint's dtype
    engine.close()
    identities = {
        model_identity(bf16_dir, p, 16) for p in ("bfloat16<-float32", "float32<-float32", "bfloat16<-bfloat16")
    }
    assert len(identities) == 3  # KV of another tier dtype or compute precision is never shared
