"""LoRA adapters in PEFT's format, applied per request in the batched forward (PreFT).

In a prefill-only engine every token is a prefill token, so prefill-only adapters are simply
per-request adapters. The base weights stay unmerged: every projection step (q, k, v, o, gate,
up, down) adds, for each run of packed rows that share an adapter, `scale · (h[rows] Aᵀ) Bᵀ` into
its output. That is Punica / S-LoRA's segmented matmul written as one `addmm_` per run: a batch
mixing adapters applies each token's own adapter, and no request copies a base weight.

A folder is read in two steps: `read_adapter` checks `adapter_config.json` and the tensor names
and shapes in `adapter_model.safetensors` against the model (header only, no weights read) and
names the file and field of anything it cannot serve; `load_adapter` reads the weights.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load as safetensors_load
from torch import Tensor

if TYPE_CHECKING:
    from tiered.hybrid.args import ModelArgs

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$"
)
# Fields whose PEFT features change the math beyond W + s·BA: refused unless off.
_REFUSED = {"use_dora": False, "fan_in_fan_out": False, "lora_bias": False}


class AdapterError(ValueError):
    """An adapter folder cannot be served; the message names the file and the field or tensor."""

    status = 400


class AdapterNotFoundError(AdapterError):
    """The adapter folder or one of its two files does not exist (vLLM answers 404)."""

    status = 404


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    """A checked adapter folder: what the engine needs before reading its weights."""

    name: str
    path: Path
    rank: int  # the largest rank of its modules
    target_modules: tuple[str, ...]
    identity: str  # sha256 of config and weights: the adapter's part of every block key
    scales: dict[str, float]  # "layer.module" -> alpha / r (or alpha / sqrt(r) with rslora)


@dataclass(slots=True)
class LoraWeights:
    """An adapter resident on the engine's device: per layer, module -> (A [r, in], B [out, r], scale)."""

    spec: AdapterSpec
    layers: list[dict[str, tuple[Tensor, Tensor, float]]]

    @property
    def nbytes(self) -> int:
        """Device bytes the adapter's A and B matrices take."""
        return sum(a.nbytes + b.nbytes for layer in self.layers for a, b, _ in layer.values())


class LoraRun(NamedTuple):
    """Rows [start, end) of a slice of packed tokens that use `weights`."""

    start: int
    end: int
    weights: LoraWeights


class LoraSlice(NamedTuple):
    """The adapters of one layer's slice of packed tokens (runs in row order, base rows left out)."""

    layer: int
    runs: Sequence[LoraRun]

    def add_(self, out: Tensor, h: Tensor, module: str) -> None:
        """out[rows] += scale · (h[rows] Aᵀ) Bᵀ for every run whose adapter targets `module`."""
        for start, end, weights in self.runs:
            ab = weights.layers[self.layer].get(module)
            if ab is not None:
                a, b, scale = ab
                out[start:end].addmm_(h[start:end] @ a.t(), b.t(), alpha=scale)


def _shapes(args: ModelArgs) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each target module."""
    d, f = args.hidden_size, args.intermediate_size
    q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    return {
        "q_proj": (d, q),
        "k_proj": (d, kv),
        "v_proj": (d, kv),
        "o_proj": (q, d),
        "gate_proj": (d, f),
        "up_proj": (d, f),
        "down_proj": (f, d),
    }


def _pattern_value(patterns: dict[str, Any], module_path: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern: a key matches a module path ending with it."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module_path):
            return value
    return default


def _patterns(cfg: dict[str, Any], field: str, kind: type | tuple[type, ...], what: str, bad: Any) -> dict[str, Any]:
    """A rank_pattern / alpha_pattern: module-path regexes to positive values of `kind`."""
    patterns = cfg.get(field) or {}
    if not isinstance(patterns, dict):
        raise bad(field, f"must map module names to values, got {patterns!r}")
    for key, value in patterns.items():
        try:
            re.compile(key)
        except re.error as exc:
            raise bad(field, f"key {key!r} is not a regular expression ({exc})") from None
        if not isinstance(value, kind) or isinstance(value, bool) or value <= 0:  # type: ignore[operator]
            raise bad(field, f"value for {key!r} must be a positive {what}, got {value!r}")
    return patterns


def _digest(cfg_bytes: bytes, weights_bytes: bytes) -> str:
    """The adapter's identity: its files' contents."""
    return hashlib.sha256(cfg_bytes + b"\0" + weights_bytes).hexdigest()[:32]


def read_adapter(name: str, folder: str | Path, args: ModelArgs, max_rank: int) -> AdapterSpec:
    """Check an adapter folder against the model; AdapterError names what is wrong."""
    try:
        folder = Path(folder).expanduser()
        cfg_path, weights_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
        for path in (cfg_path, weights_path):
            if not path.is_file():
                raise AdapterNotFoundError(
                    f"adapter '{name}': {path} does not exist (a PEFT LoRA folder holds "
                    f"{CONFIG_FILE} and {WEIGHTS_FILE})"
                )
        return _read_adapter(name, folder, cfg_path, weights_path, args, max_rank)
    except (OSError, RuntimeError) as exc:  # unreadable, or `~user` that does not exist
        raise AdapterError(f"adapter '{name}': {folder} cannot be read ({exc})") from None


def _read_adapter(
    name: str, folder: Path, cfg_path: Path, weights_path: Path, args: ModelArgs, max_rank: int
) -> AdapterSpec:
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"adapter '{name}': {cfg_path} is not valid JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"adapter '{name}': {cfg_path} must hold a JSON object")

    def bad(field: str, why: str) -> AdapterError:
        return AdapterError(f"adapter '{name}': {cfg_path}: field '{field}' {why}")

    if cfg.get("peft_type", "LORA") != "LORA":
        raise bad("peft_type", f"is {cfg['peft_type']!r}; only LORA is supported")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise bad("r", f"must be a positive integer, got {r!r}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise bad("lora_alpha", f"must be a number, got {alpha!r}")
    for field, off in _REFUSED.items():
        if cfg.get(field, off) != off:
            raise bad(field, f"is {cfg[field]!r}; only {off!r} is supported")
    if cfg.get("bias", "none") != "none":
        raise bad("bias", f"is {cfg['bias']!r}; only 'none' is supported")
    if cfg.get("modules_to_save"):
        raise bad("modules_to_save", "is set; adapters that replace whole modules are not supported")
    rank_pattern = _patterns(cfg, "rank_pattern", int, "integer", bad)
    alpha_pattern = _patterns(cfg, "alpha_pattern", (int, float), "number", bad)
    rslora = bool(cfg.get("use_rslora", False))

    try:
        with safe_open(str(weights_path), framework="pt") as f:
            shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}  # noqa: SIM118
    except (SafetensorError, OSError) as exc:
        raise AdapterError(f"adapter '{name}': {weights_path} is not a safetensors file ({exc})") from None
    expected = _shapes(args)
    found: dict[tuple[int, str], dict[str, tuple[int, ...]]] = {}
    for key, shape in shapes.items():
        m = _KEY.match(key)
        if m is None or m.group(2) not in expected:
            raise AdapterError(
                f"adapter '{name}': {weights_path}: tensor '{key}' is not a LoRA A/B weight of "
                f"{', '.join(TARGET_MODULES)} (other targets are not supported)"
            )
        layer, module = int(m.group(1)), m.group(2)
        if layer >= args.num_layers:
            raise AdapterError(
                f"adapter '{name}': {weights_path}: tensor '{key}' names layer {layer}; the model has {args.num_layers}"
            )
        found.setdefault((layer, module), {})[m.group(3)] = shape
    if not found:
        raise AdapterError(f"adapter '{name}': {weights_path} holds no LoRA weights")
    scales, rank = {}, 0
    for (layer, module), ab in sorted(found.items()):
        part = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
        module_path = f"model.layers.{layer}.{part}.{module}"
        if set(ab) != {"A", "B"}:
            missing = "B" if "A" in ab else "A"
            raise AdapterError(f"adapter '{name}': {weights_path}: {module_path} has no lora_{missing} weight")
        r_mod = _pattern_value(rank_pattern, module_path, r)
        fan_in, fan_out = expected[module]
        if ab["A"] != (r_mod, fan_in) or ab["B"] != (fan_out, r_mod):
            raise AdapterError(
                f"adapter '{name}': {weights_path}: {module_path} has lora_A {list(ab['A'])} and "
                f"lora_B {list(ab['B'])}; "
                f"with r={r_mod} from {CONFIG_FILE} this model needs [{r_mod}, {fan_in}] and [{fan_out}, {r_mod}]"
            )
        alpha_mod = _pattern_value(alpha_pattern, module_path, alpha)
        scales[f"{layer}.{module}"] = alpha_mod / (math.sqrt(r_mod) if rslora else r_mod)
        rank = max(rank, r_mod)
    if rank > max_rank:
        raise AdapterError(
            f"adapter '{name}': {cfg_path}: field 'r' is {rank}, above lora.max_lora_rank (--max-lora-rank) {max_rank}"
        )
    identity = _digest(cfg_path.read_bytes(), weights_path.read_bytes())
    targets = tuple(m for m in TARGET_MODULES if any(mod == m for _, mod in found))
    return AdapterSpec(name, folder, rank, targets, identity, scales)


def load_adapter(
    spec: AdapterSpec, num_layers: int, dtype: torch.dtype, device: str | torch.device, first_layer: int = 0
) -> LoraWeights:
    """Read a checked adapter's weights onto the device, in the model's dtype. Files that changed
    since `read_adapter` checked them are refused (their identity, in cached KV keys, would lie).
    A pipeline stage's part: layers `first_layer` .. `first_layer + num_layers - 1`, renumbered from 0."""
    try:
        weights_bytes = (spec.path / WEIGHTS_FILE).read_bytes()
        if _digest((spec.path / CONFIG_FILE).read_bytes(), weights_bytes) != spec.identity:
            raise AdapterError(f"adapter '{spec.name}': {spec.path} changed since it was checked; load it again")
        state = safetensors_load(weights_bytes)
    except (SafetensorError, OSError) as exc:
        raise AdapterError(f"adapter '{spec.name}': {spec.path / WEIGHTS_FILE} cannot be read ({exc})") from None
    parts: dict[str, dict[str, Tensor]] = {}
    for key, tensor in state.items():
        m = _KEY.match(key)
        if m is not None:
            parts.setdefault(f"{m.group(1)}.{m.group(2)}", {})[m.group(3)] = tensor
    layers: list[dict[str, tuple[Tensor, Tensor, float]]] = [{} for _ in range(num_layers)]
    for where, ab in parts.items():
        layer, module = where.split(".")
        if not 0 <= int(layer) - first_layer < num_layers:
            continue
        a, b = (ab[x].to(device=device, dtype=dtype).contiguous() for x in "AB")
        layers[int(layer) - first_layer][module] = (a, b, spec.scales[where])
    return LoraWeights(spec, layers)
