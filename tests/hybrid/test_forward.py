"""Every forward mode equals transformers' reference; prefix-as-KV equals computing it all."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tiered.hybrid.forward import ForwardInputError, forward
from tiered.hybrid.loader import load_model
from tiered.hybrid.model import CausalLM
from tiered.offload.device_tier import DeviceTier, PrefixKV

# Max |logit error| relative to max |reference logit|. fp32 differs from the reference only by
# summation order; bf16 also by where intermediate results are rounded (e.g. the residual add
# is fused into the matmul here), so a few bf16 ulps.
TOLERANCE = {"float32": 1e-5, "bfloat16": 1.5e-2}
MODES = [("vanilla", 1), ("chunked", 64), ("hybrid", 64), ("hybrid", 1000)]


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 1300, (n,), generator=torch.Generator().manual_seed(seed))


def _assert_close(got: torch.Tensor, ref: torch.Tensor, dtype: str) -> None:
    err = (got - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= TOLERANCE[dtype] * scale, f"max error {err:.3g} > {TOLERANCE[dtype]} x {scale:.3g}"


_models: dict[tuple[str, str], tuple[CausalLM, torch.nn.Module]] = {}


def _pair(model_dirs: dict[str, Path], name: str, dtype: str) -> tuple[CausalLM, torch.nn.Module]:
    key = (name, dtype)
    if key not in _models:
        ref = AutoModelForCausalLM.from_pretrained(str(model_dirs[name]), dtype=getattr(torch, dtype)).eval()
        _models[key] = (load_model(model_dirs[name], dtype), ref)
    return _models[key]


@pytest.mark.parametrize(
    "name",
    ["tiny", "tiny-qwen2", "tiny-qwen3", "tiny-phi3", "tiny-gemma2", "tiny-gemma3", "tiny-mistral", "tiny-llama3"],
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("length", [1, 2, 63, 64, 65, 777, 3000])
def test_every_mode_matches_transformers(model_dirs: dict[str, Path], name: str, dtype: str, length: int) -> None:
    ours, ref = _pair(model_dirs, name, dtype)
    ids = _ids(length, seed=length)
    with torch.no_grad():
        expected = ref(ids[None]).logits[0, -1].float()
    for mode, chunk in MODES:
        got = forward(ours, ids, mode=mode, chunk_tokens=chunk)
        assert got.shape == (ours.args.vocab_size,) and got.dtype == torch.float32
        _assert_close(got, expected, dtype)


class KVCollector:
    """A KV sink that copies what it receives, per layer."""

    def __init__(self) -> None:
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        assert layer not in self.kv
        self.kv[layer] = (k.clone(), v.clone())

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [self.kv[i] for i in range(len(self.kv))]


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen2", "tiny-qwen3", "tiny-phi3", "tiny-gemma2", "tiny-gemma3"])
@pytest.mark.parametrize("split", [1, 15, 16, 17, 255, 256, 257, 1024, 1099])
@pytest.mark.parametrize("mode", ["vanilla", "chunked", "hybrid"])
def test_prefix_as_kv_equals_computing_everything(
    model_dirs: dict[str, Path], name: str, split: int, mode: str
) -> None:
    model, _ = _pair(model_dirs, name, "float32")
    ids = _ids(1100, seed=7)
    full = forward(model, ids, mode="vanilla")
    sink = KVCollector()
    forward(model, ids[:split], mode=mode, chunk_tokens=100, kv_sink=sink)
    got = forward(model, ids[split:], mode=mode, chunk_tokens=100, prefix_kv=sink.layers())
    _assert_close(got, full, "float32")


@pytest.mark.parametrize("mode", ["vanilla", "chunked", "hybrid"])
def test_a_prefix_in_scattered_device_tier_blocks_equals_computing_everything(
    model_dirs: dict[str, Path], mode: str
) -> None:
    """The tiers' prefix (`PrefixKV`: 32 blocks of a pool, in an order where no two are adjacent),
    read by block id in every mode: the logits of computing the whole prompt."""
    model, _ = _pair(model_dirs, "tiny", "float32")
    ids = _ids(600, seed=3)
    sink = KVCollector()
    forward(model, ids[:512], mode="vanilla", kv_sink=sink)
    tier = DeviceTier(model.args, 16, 0, torch.float32, "cpu", num_blocks=64)
    blocks = [b for pair in zip(range(62, 30, -2), range(1, 33, 2), strict=True) for b in pair]
    for layer, (k, v) in enumerate(sink.layers()):
        tier.write_layer(layer, blocks, k, v)
    prefix = PrefixKV(tier, blocks, model.args.num_layers)
    got = forward(model, ids[512:], mode=mode, chunk_tokens=40, prefix_kv=prefix)
    _assert_close(got, forward(model, ids, mode="vanilla"), "float32")


def test_sink_receives_each_layers_kv_equal_across_modes(model_dirs: dict[str, Path]) -> None:
    model, _ = _pair(model_dirs, "tiny", "float32")
    ids = _ids(300)
    sinks = {}
    for mode in ("vanilla", "chunked", "hybrid"):
        sinks[mode] = KVCollector()
        forward(model, ids, mode=mode, chunk_tokens=64, kv_sink=sinks[mode])
    a = model.args
    for layer in range(a.num_layers):
        k, v = sinks["vanilla"].kv[layer]
        assert k.shape == v.shape == (300, a.num_kv_heads, a.head_dim)
        for mode in ("chunked", "hybrid"):
            torch.testing.assert_close(sinks[mode].kv[layer][0], k, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(sinks[mode].kv[layer][1], v, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("mode", "freed_before_next_layer"), [("hybrid", True), ("vanilla", False)])
def test_only_hybrid_frees_a_layers_kv_before_the_next(
    model_dirs: dict[str, Path], mode: str, freed_before_next_layer: bool
) -> None:
    """When layer i's K,V reach the sink, hybrid has already freed layer i-1's; vanilla holds all."""
    model, _ = _pair(model_dirs, "tiny", "float32")
    refs: list[weakref.ref[torch.UntypedStorage]] = []
    alive_at_next: list[bool] = []

    def sink(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        gc.collect()
        if refs:
            alive_at_next.append(refs[-1]() is not None)
        # The storage's Python object lives exactly as long as the layer's K buffer.
        refs.append(weakref.ref(k.untyped_storage()))

    forward(model, _ids(500), mode=mode, chunk_tokens=64, kv_sink=sink)
    assert len(alive_at_next) == model.args.num_layers - 1
    assert not any(alive_at_next) if freed_before_next_layer else all(alive_at_next)


@pytest.mark.parametrize("chunk", [1, 7, 64, 499, 500, 10_000])
def test_hybrid_result_does_not_depend_on_chunk_size(model_dirs: dict[str, Path], chunk: int) -> None:
    model, _ = _pair(model_dirs, "tiny", "float32")
    ids = _ids(500)
    _assert_close(
        forward(model, ids, mode="hybrid", chunk_tokens=chunk), forward(model, ids, mode="vanilla"), "float32"
    )


def test_bad_inputs_are_refused_with_a_clear_error(model_dirs: dict[str, Path]) -> None:
    model, _ = _pair(model_dirs, "tiny", "float32")
    with pytest.raises(ForwardInputError, match="non-empty"):
        forward(model, torch.tensor([], dtype=torch.long))
    with pytest.raises(ForwardInputError, match="non-empty 1-D"):
        forward(model, torch.tensor([[1, 2]]))
    with pytest.raises(ValueError, match="unknown forward mode 'fast'"):
        forward(model, torch.tensor([1, 2]), mode="fast")  # type: ignore[arg-type]
