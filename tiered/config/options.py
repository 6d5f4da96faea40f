"""Options both command lines take (`tiered ...` in `cli.py`, `python -m benchmarks ...` in `benchmarks/cli.py`):
the config file and `--set` overrides, sizes and integer lists, the device. Imports no torch."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from tiered.config import Config, ConfigError, load_config

# In the package (the top-level configs/ links it).
DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "default.yaml"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 2**40,
}


def parse_bytes(text: str) -> int:
    """'512MiB', '1.5GB', '1048576' -> bytes; anything else raises naming the value."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"'{text}' is not a size (examples: 1073741824, 512MiB, 2GB)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


def parse_int_list(text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4]; anything but positive integers raises naming the value."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"'{text}' must list positive integers")
    return values


def parse_float_list(text: str) -> list[float]:
    """'0.5,1,2' -> [0.5, 1.0, 2.0] (latency SLOs in seconds, offered loads)."""
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a comma-separated list of numbers") from None


def add_config_args(p: argparse.ArgumentParser) -> None:
    """Add `--config` (the YAML file) and repeatable `--set KEY=VALUE` overrides to a parser."""
    p.add_argument("--config", default=None, help=f"YAML config file (default: {DEFAULT_CONFIG.name} in configs/)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one config key, e.g. --set forward.chunk_tokens=512 (repeatable)",
    )


def add_pipeline_args(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """Add `--pipeline-parallel-size`/`-pp` (the number of pipeline stage processes) to a parser."""
    p.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        type=int,
        default=None,
        metavar="S",
        help="split the model's layers over S stage processes (engine.pipeline_stages; vLLM's flag); each "
        "stage keeps its layers' KV in its own device and host tiers. S > 1 refuses a disk or remote host tier, "
        "forward.mode=chunked, forward.spill_dir and replicas; see docs/pipeline.md",
    )


def engine_overrides(args: argparse.Namespace) -> list[str]:
    """`add_pipeline_args`' flags as `key=value` overrides (they win over the YAML and --set)."""
    size = getattr(args, "pipeline_parallel_size", None)
    return [] if size is None else [f"engine.pipeline_stages={size}"]


def config_from_args(args: argparse.Namespace) -> Config:
    """The config `--config` names (default: the packaged default.yaml) with `--set` and the flags applied."""
    path = args.config or (DEFAULT_CONFIG if DEFAULT_CONFIG.exists() else None)
    return load_config(path, list(args.overrides) + engine_overrides(args))


def resolve_device(device: str) -> str:
    """'auto' -> cuda where available, else cpu; a cuda device on a machine without one raises
    ConfigError naming it. torch is imported here, not at the top: `--help` stays free of it."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"config key 'device': '{device}' requested but CUDA is not available here")
    return device
