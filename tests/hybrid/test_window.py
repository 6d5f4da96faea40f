"""Sliding-window attention, computed: past the window each query sees only the last `window` keys
(transformers' rule), on the layers the config names, in every forward mode, with a cached prefix
and in a batch; equal to transformers' model within the fp32 tolerance of `test_forward.py`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tiered.hybrid.forward import BatchItem, forward, forward_batch
from tiered.hybrid.loader import load_model, read_args
from tiered.hybrid.model import CausalLM, use_attention
from tiered.native import library as native

WINDOW = 48
TOLERANCE = 1e-5  # max |Δ logit| / max |logit|, fp32: summation order only


def _windowed(src: Path, dst: Path, **config: object) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(config)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def windowed_dirs(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("windowed")
    return {
        # every layer windowed
        "mistral": _windowed(model_dirs["tiny-mistral"], root / "mistral", sliding_window=WINDOW),
        # Qwen's rule: only the layers from max_window_layers on
        "qwen2": _windowed(
            model_dirs["tiny-qwen2"],
            root / "qwen2",
            use_sliding_window=True,
            sliding_window=WINDOW,
            max_window_layers=1,
        ),
    }


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 1300, (n,), generator=torch.Generator().manual_seed(seed))


def _close(got: torch.Tensor, ref: torch.Tensor) -> None:
    err, scale = (got - ref).abs().max().item(), ref.abs().max().item()
    assert err <= TOLERANCE * scale, f"max error {err:.3g} > {TOLERANCE} x {scale:.3g}"


_pairs: dict[tuple[str, str], tuple[CausalLM, torch.nn.Module]] = {}

# The kernels a window runs on here: the C++ kernel's own windowed call, and the PyTorch one any other takes.
KERNELS = [
    pytest.param("native", marks=pytest.mark.skipif(not native.available(), reason="no native kernel here")),
    "flash",
]


def _pair(dirs: dict[str, Path], name: str, kernel: str = "flash") -> tuple[CausalLM, torch.nn.Module]:
    if (name, kernel) not in _pairs:
        ref = AutoModelForCausalLM.from_pretrained(str(dirs[name]), dtype=torch.float32, attn_implementation="eager")
        model = load_model(dirs[name])
        use_attention(model, kernel)
        _pairs[(name, kernel)] = (model, ref.eval())
    return _pairs[(name, kernel)]


def test_the_config_says_which_layers_slide(windowed_dirs: dict[str, Path]) -> None:
    assert read_args(windowed_dirs["mistral"]).window_layers == (0, 1)
    qwen = read_args(windowed_dirs["qwen2"])
    assert qwen.window_layers == (1,) and qwen.layer_window(0) is None and qwen.layer_window(1) == WINDOW


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("name", ["mistral", "qwen2"])
@pytest.mark.parametrize("length", [WINDOW - 1, WINDOW, WINDOW + 1, 300, 700])
def test_every_mode_matches_transformers_past_the_window(
    windowed_dirs: dict[str, Path], name: str, length: int, kernel: str
) -> None:
    ours, ref = _pair(windowed_dirs, name, kernel)
    ids = _ids(length, seed=length)
    with torch.no_grad():
        expected = ref(ids[None]).logits[0, -1].float()
    for mode, chunk in (("vanilla", 1), ("chunked", 64), ("hybrid", 64), ("hybrid", 1000)):
        _close(forward(ours, ids, mode=mode, chunk_tokens=chunk), expected)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("split", [10, WINDOW, 200])
def test_a_cached_prefix_and_a_batch_see_the_same_window(
    windowed_dirs: dict[str, Path], split: int, kernel: str
) -> None:
    """A prefix handed in as K,V, and followers computed in one batch with it, give the logits of
    the whole prompt computed at once."""
    model, _ = _pair(windowed_dirs, "mistral", kernel)
    ids = _ids(400, seed=3)
    whole = forward(model, ids, mode="vanilla")
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    forward(model, ids[:split], kv_sink=lambda i, k, v: kv.__setitem__(i, (k.clone(), v.clone())))
    prefix = [kv[i] for i in range(len(kv))]
    for mode in ("hybrid", "chunked"):
        _close(forward(model, ids[split:], mode=mode, chunk_tokens=64, prefix_kv=prefix), whole)
    other = _ids(120, seed=4)
    batch = forward_batch(
        model, [BatchItem(ids[split:], prefix), BatchItem(other), BatchItem(ids[split:300], prefix)], chunk_tokens=64
    )
    _close(batch[0], whole)
    _close(batch[1], forward(model, other, mode="vanilla"))
    _close(batch[2], forward(model, ids[:300], mode="vanilla"))
