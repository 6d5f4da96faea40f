"""Which precision the forward computes in, and which the KV tiers keep, on this machine.

Design notes: docs/internals.md, section `tiered/hybrid/precision.py`.
"""

from __future__ import annotations

import json
import platform
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tiered.config import Config

DTYPE_NAMES = ("float32", "bfloat16", "float16")

# The instructions that make a CPU compute a dtype natively (oneDNN's fast paths in torch's CPU build).
NATIVE_CPU_FLAGS: dict[str, tuple[str, ...]] = {
    "bfloat16": ("avx512_bf16", "amx_bf16"),
    "float16": ("avx512_fp16", "amx_fp16"),
}

_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


@dataclass(frozen=True, slots=True)
class Precision:
    """The resolved precisions and why: weights as stored, compute as run, KV as kept in the tiers."""

    checkpoint: str  # the checkpoint's dtype
    compute: str  # weights are loaded in this dtype and the forward computes in it
    kv: str  # the device and host tiers keep KV in this dtype
    reason: str  # one sentence: why `compute` was chosen

    def describe(self) -> str:
        """E.g. 'bf16 weights, fp32 compute, fp32 KV tiers: this CPU has no native bf16 (...)'."""
        names = (_SHORT[self.checkpoint], _SHORT[self.compute], _SHORT[self.kv])
        return "{} weights, {} compute, {} KV tiers: ".format(*names) + self.reason

    @property
    def identity(self) -> str:
        """What KV values depend on: the tier's dtype and the precision that computed it (block keys carry it)."""
        return f"{self.kv}<-{self.compute}"


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> frozenset[str]:
    """The instruction-set flags of the first CPU listed (empty where the file is unreadable)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def cpu_name(cpuinfo: str | Path = "/proc/cpuinfo") -> str:
    """`lscpu`'s model name (platform.processor() is often empty on Linux)."""
    try:
        for line in Path(cpuinfo).read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def checkpoint_dtype(folder: str | Path) -> str:
    """The dtype a checkpoint stores its weights in: config.json's `dtype` / `torch_dtype`, else the
    first floating tensor in the first safetensors header, else float32."""
    folder = Path(folder)
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        cfg = {}
    named = cfg.get("dtype") or cfg.get("torch_dtype")
    if named in DTYPE_NAMES:
        return str(named)
    for path in sorted(folder.glob("*.safetensors")):
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, entry in header.items():
            if name != "__metadata__" and entry.get("dtype") in _SAFETENSORS_DTYPES:
                return _SAFETENSORS_DTYPES[entry["dtype"]]
    return "float32"


def resolve_precision(
    requested: str,
    requested_kv: str,
    checkpoint: str,
    device: str,
    flags: frozenset[str] | None = None,
    cuda_bf16: bool = True,
) -> Precision:
    """Resolve `model.dtype` and `cache.kv_dtype` (each `auto` or a dtype name) for `device`.

    An explicit dtype is never overridden. `auto` computes in the checkpoint's dtype where the
    device is native for it (CUDA; a CPU with the flags in NATIVE_CPU_FLAGS), else fp32.
    `flags`: the CPU's (read from /proc/cpuinfo when None); `cuda_bf16`: whether the GPU computes bf16."""
    if requested != "auto":
        compute, reason = requested, "set by model.dtype"
    elif checkpoint == "float32":
        compute, reason = "float32", "the checkpoint is fp32"
    elif device.startswith("cuda"):
        native = checkpoint != "bfloat16" or cuda_bf16
        compute = checkpoint if native else "float32"
        reason = "the GPU computes it natively" if native else "this GPU has no bf16"
    else:
        have = cpu_flags() if flags is None else flags
        wanted = NATIVE_CPU_FLAGS[checkpoint]
        found = sorted(set(wanted) & have)
        if found:
            compute, reason = checkpoint, f"this CPU computes {_SHORT[checkpoint]} natively ({', '.join(found)})"
        else:
            compute = "float32"
            reason = f"this CPU has no native {_SHORT[checkpoint]} (no {' / '.join(wanted)} flag)"
    kv = compute if requested_kv == "auto" else requested_kv
    return Precision(checkpoint, compute, kv, reason)


def precision_for(model_dtype: str, kv_dtype: str, folder: str | Path, device: str) -> Precision:
    """`resolve_precision` for a checkpoint folder on a resolved device (this machine's flags and GPU)."""
    cuda_bf16 = True
    if device.startswith("cuda"):
        import torch

        cuda_bf16 = torch.cuda.is_bf16_supported()
    return resolve_precision(model_dtype, kv_dtype, checkpoint_dtype(folder), device, cuda_bf16=cuda_bf16)


def config_precision(cfg: Config) -> Precision:
    """What an engine built from `cfg` would resolve (benchmarks size and label their runs with it)."""
    from tiered.config.options import resolve_device
    from tiered.embedded import resolve_model_path

    folder = resolve_model_path(cfg.model.path, cfg.model.models_dir)
    return precision_for(cfg.model.dtype, cfg.cache.kv_dtype, folder, resolve_device(cfg.device))
