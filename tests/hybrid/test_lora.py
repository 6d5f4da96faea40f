"""LoRA adapters in the forward: equal to transformers + peft (adapter merged), alone and in mixed
batches; a folder we cannot serve is refused with a message naming the file and the field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from tiered.hybrid.forward import BatchItem, forward, forward_batch
from tiered.hybrid.loader import load_model
from tiered.hybrid.lora import AdapterError, AdapterNotFoundError, LoraWeights, load_adapter, read_adapter

# Max |logit error| relative to max |reference logit| in fp32: the merged weight W + s·BA and our
# unmerged W x + s·B(A x) differ only by rounding.
TOLERANCE = 1e-4
MODES = [("hybrid", 64), ("hybrid", 1000), ("vanilla", 1), ("chunked", 64)]


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 1300, (n,), generator=torch.Generator().manual_seed(seed))


def _weights(folder: Path, model: torch.nn.Module, name: str = "a") -> LoraWeights:
    spec = read_adapter(name, folder, model.args, max_rank=64)
    return load_adapter(spec, model.args.num_layers, torch.float32, "cpu")


def _error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return (got - ref).abs().max().item() / ref.abs().max().item()


@pytest.mark.parametrize("model_name", ["tiny", "tiny-qwen2", "tiny-qwen3"])
@pytest.mark.parametrize("adapter", ["small", "wide"])
def test_adapter_logits_equal_peft_merged(
    model_dirs: dict[str, Path], adapter_dirs: dict[tuple[str, str], Path], model_name: str, adapter: str
) -> None:
    folder = adapter_dirs[(model_name, adapter)]
    ours = load_model(model_dirs[model_name], "float32")
    base_ref = AutoModelForCausalLM.from_pretrained(str(model_dirs[model_name]), dtype=torch.float32)
    merged = PeftModel.from_pretrained(base_ref, str(folder)).merge_and_unload().eval()
    weights = _weights(folder, ours)
    for length in (1, 65, 777):
        ids = _ids(length, length)
        with torch.no_grad():
            expected = merged(ids[None]).logits[0, -1].float()
        # The adapter matters: the base model's logits are far from the merged model's.
        assert _error(forward(ours, ids), expected) > 100 * TOLERANCE
        for mode, chunk in MODES:
            err = _error(forward(ours, ids, mode=mode, chunk_tokens=chunk, adapter=weights), expected)
            assert err <= TOLERANCE, f"{mode}/{chunk} at {length} tokens: {err:.3g}"


def test_a_mixed_adapter_batch_equals_the_single_runs(
    model_dirs: dict[str, Path], adapter_dirs: dict[tuple[str, str], Path]
) -> None:
    model = load_model(model_dirs["tiny"], "float32")
    small, wide = (_weights(adapter_dirs[("tiny", n)], model, n) for n in ("small", "wide"))
    profile = _ids(100, 1)
    # Per adapter, the profile's KV as that adapter computes it: a prefix is one adapter's.
    prefixes = {}
    for key, w in (("base", None), ("small", small), ("wide", wide)):
        kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        forward(model, profile, kv_sink=lambda i, k, v, kv=kv: kv.__setitem__(i, (k.clone(), v.clone())), adapter=w)
        prefixes[key] = [kv[i] for i in range(len(kv))]
    cases = [
        ("wide", _ids(30, 2)),
        ("base", _ids(20, 3)),
        ("small", _ids(25, 4)),
        ("wide", _ids(40, 5)),
        ("small", _ids(33, 6)),
        ("base", _ids(50, 7)),
    ]
    adapters = {"base": None, "small": small, "wide": wide}
    items = [BatchItem(ids, prefixes[a], adapter=adapters[a]) for a, ids in cases]
    # Two followers: each shares its lead's first 12 tokens (same prefix, same adapter).
    items.append(BatchItem(_ids(9, 8), prefixes["small"], lead=2, num_shared=12, adapter=small))
    items.append(BatchItem(_ids(7, 9), None, adapter=wide))
    singles = [torch.cat([profile, ids]) for _, ids in cases]
    singles.append(torch.cat([profile, cases[2][1][:12], items[6].token_ids]))
    singles.append(items[7].token_ids)
    single_adapters = [adapters[a] for a, _ in cases] + [small, wide]
    for mode, chunk in MODES:
        batched = forward_batch(model, items, mode=mode, chunk_tokens=chunk)
        for i, (ids, w) in enumerate(zip(singles, single_adapters, strict=True)):
            ref = forward(model, ids, adapter=w)
            assert _error(batched[i], ref) <= 1e-5, f"{mode}/{chunk} item {i}"


def _copy(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / "adapter"))


def _edit_config(folder: Path, **fields: object) -> None:
    cfg = json.loads((folder / "adapter_config.json").read_text())
    cfg.update(fields)
    (folder / "adapter_config.json").write_text(json.dumps(cfg))


def _edit_weights(folder: Path, rename: tuple[str, str] | None = None, drop: str | None = None) -> None:
    state = load_file(str(folder / "adapter_model.safetensors"))
    if rename:
        key = next(k for k in state if rename[0] in k)
        state[key.replace(rename[0], rename[1])] = state.pop(key)
    if drop:
        del state[next(k for k in state if drop in k)]
    save_file(state, str(folder / "adapter_model.safetensors"))


@pytest.mark.parametrize(
    ("breaks", "message"),
    [
        (lambda f: (f / "adapter_config.json").unlink(), r"adapter_config\.json does not exist"),
        (lambda f: (f / "adapter_model.safetensors").unlink(), r"adapter_model\.safetensors does not exist"),
        (lambda f: (f / "adapter_config.json").write_text("{r: 4"), r"adapter_config\.json is not valid JSON"),
        (lambda f: (f / "adapter_model.safetensors").write_bytes(b"nope"), "is not a safetensors file"),
        (lambda f: _edit_config(f, r=8), r"q_proj has lora_A \[4, 64\] .* with r=8 from adapter_config\.json"),
        (lambda f: _edit_config(f, r="four"), "field 'r' must be a positive integer, got 'four'"),
        (lambda f: _edit_config(f, use_dora=True), "field 'use_dora' is True; only False is supported"),
        (lambda f: _edit_config(f, peft_type="IA3"), "field 'peft_type' is 'IA3'; only LORA is supported"),
        (lambda f: _edit_config(f, bias="all"), "field 'bias' is 'all'"),
        (lambda f: _edit_weights(f, rename=("q_proj", "lm_head")), "tensor '.*lm_head.*' is not a LoRA A/B weight"),
        (lambda f: _edit_weights(f, drop="v_proj.lora_B"), "v_proj has no lora_B weight"),
        (lambda f: _edit_config(f, rank_pattern=["q_proj"]), "field 'rank_pattern' must map module names"),
        (lambda f: _edit_config(f, alpha_pattern={"(q": 2}), "field 'alpha_pattern' key '\\(q' is not a regular"),
        (lambda f: _edit_config(f, rank_pattern={"q_proj": 0}), "'rank_pattern' value for 'q_proj' must be a positive"),
        (lambda f: _edit_config(f, rank_pattern={"q_proj": 2}), r"q_proj has lora_A \[4, 64\] .* with r=2"),
    ],
)
def test_a_malformed_adapter_folder_names_the_file_and_field(
    model_dirs: dict[str, Path], adapter_dirs: dict[tuple[str, str], Path], tmp_path: Path, breaks, message: str
) -> None:
    folder = _copy(adapter_dirs[("tiny", "small")], tmp_path)
    breaks(folder)
    model = load_model(model_dirs["tiny"], "float32")
    with pytest.raises(AdapterError, match=message):
        read_adapter("bad", folder, model.args, max_rank=64)


def test_pattern_ranks_and_alphas_scale_like_peft(
    model_dirs: dict[str, Path], adapter_dirs: dict[tuple[str, str], Path], tmp_path: Path
) -> None:
    """alpha_pattern gives v_proj its own alpha (rank_pattern must then match the tensors)."""
    folder = _copy(adapter_dirs[("tiny", "small")], tmp_path)
    _edit_config(folder, alpha_pattern={"v_proj": 64}, rank_pattern={"q_proj": 4})
    ours = load_model(model_dirs["tiny"], "float32")
    spec = read_adapter("p", folder, ours.args, max_rank=64)
    assert spec.scales["0.v_proj"] == 16.0 and spec.scales["0.q_proj"] == 2.0
    base_ref = AutoModelForCausalLM.from_pretrained(str(model_dirs["tiny"]), dtype=torch.float32)
    merged = PeftModel.from_pretrained(base_ref, str(folder)).merge_and_unload().eval()
    ids = _ids(200, 3)
    with torch.no_grad():
        expected = merged(ids[None]).logits[0, -1].float()
    assert _error(forward(ours, ids, adapter=_weights(folder, ours)), expected) <= TOLERANCE


def test_a_missing_folder_is_not_found_and_a_changed_one_is_refused_on_load(
    model_dirs: dict[str, Path], adapter_dirs: dict[tuple[str, str], Path], tmp_path: Path
) -> None:
    model = load_model(model_dirs["tiny"], "float32")
    with pytest.raises(AdapterNotFoundError, match="adapter_config.json does not exist"):
        read_adapter("gone", tmp_path / "nowhere", model.args, max_rank=64)
    folder = _copy(adapter_dirs[("tiny", "small")], tmp_path)
    spec = read_adapter("a", folder, model.args, max_rank=64)
    state = load_file(str(folder / "adapter_model.safetensors"))
    save_file({k: v * 2 for k, v in state.items()}, str(folder / "adapter_model.safetensors"))  # same shapes
    with pytest.raises(AdapterError, match="changed since it was checked"):
        load_adapter(spec, model.args.num_layers, torch.float32, "cpu")


def test_a_rank_above_max_lora_rank_is_refused(
    model_dirs: dict[str, Path], adapter_dirs: dict[tuple[str, str], Path]
) -> None:
    model = load_model(model_dirs["tiny"], "float32")
    with pytest.raises(AdapterError, match=r"field 'r' is 8, above lora.max_lora_rank \(--max-lora-rank\) 4"):
        read_adapter("wide", adapter_dirs[("tiny", "wide")], model.args, max_rank=4)
    assert read_adapter("small", adapter_dirs[("tiny", "small")], model.args, max_rank=4).rank == 4
