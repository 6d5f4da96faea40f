"""One forward in a fresh process, reporting its true memory peak (run as a subprocess).

On cuda the peak is torch's max allocated bytes (weights included). On cpu it is the process's
resident high-water mark: after the model is loaded and warmed up, the kernel's peak counter is
reset (`/proc/self/clear_refs` with 5), the forward runs, and VmHWM is read; the forward's peak
is VmHWM minus the resident size just before it, plus the weights' bytes. Running each probe in
its own process keeps one probe's allocator state from hiding another's peak.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tiered.hybrid.forward import forward
from tiered.hybrid.loader import load_model


@dataclass(slots=True)
class ProbeResult:
    num_tokens: int
    peak_bytes: int
    weights_bytes: int
    seconds: float
    peak_method: str


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_cpu_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def run_probe(model_dir: str, dtype: str, device: str, mode: str, chunk_tokens: int, num_tokens: int) -> ProbeResult:
    model = load_model(model_dir, dtype, device)
    weights_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    ids = torch.randint(0, model.args.vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(0))
    forward(model, ids[: min(64, num_tokens)], mode=mode, chunk_tokens=chunk_tokens)  # type: ignore[arg-type]
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        forward(model, ids, mode=mode, chunk_tokens=chunk_tokens)  # type: ignore[arg-type]
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        return ProbeResult(
            num_tokens, torch.cuda.max_memory_allocated(), weights_bytes, seconds, "cuda max_memory_allocated"
        )
    baseline = _status_bytes("VmRSS")
    method = "VmHWM after clear_refs" if _reset_cpu_peak() else "VmHWM (not resettable: upper bound)"
    start = time.perf_counter()
    forward(model, ids, mode=mode, chunk_tokens=chunk_tokens)  # type: ignore[arg-type]
    seconds = time.perf_counter() - start
    peak = max(0, _status_bytes("VmHWM") - baseline) + weights_bytes
    return ProbeResult(num_tokens, peak, weights_bytes, seconds, method)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Run one forward and print its memory peak as JSON.")
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cpu")
    p.add_argument("--mode", required=True)
    p.add_argument("--chunk-tokens", type=int, default=1024)
    p.add_argument("--tokens", type=int, required=True)
    a = p.parse_args(argv)
    result = run_probe(a.model, a.dtype, a.device, a.mode, a.chunk_tokens, a.tokens)
    json.dump(asdict(result), sys.stdout)


if __name__ == "__main__":
    main()
