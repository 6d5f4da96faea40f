"""The memory peak of one forward, measured: cuda max allocated, or the cpu resident high-water mark.

On cpu the kernel's peak counter is reset (`/proc/self/clear_refs` with 5) just before the
forward and VmHWM read after it; the forward's peak is VmHWM minus the resident size before it.
For a clean reading run it in a process of its own with a fixed glibc mmap threshold (see
`tiered.bench.mil`), so freed tensors go back to the OS and residency follows live memory.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tiered.config import ForwardMode
from tiered.hybrid.forward import forward
from tiered.hybrid.model import CausalLM


@dataclass(slots=True)
class ForwardPeak:
    num_tokens: int
    peak_bytes: int  # weights + the forward's activations
    weights_bytes: int
    seconds: float
    method: str


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


def weights_bytes(model: CausalLM) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def measure_forward_peak(model: CausalLM, num_tokens: int, mode: ForwardMode, chunk_tokens: int) -> ForwardPeak:
    """Run one forward of `num_tokens` random tokens and return its memory peak."""
    ids = torch.randint(0, model.args.vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(0))
    forward(model, ids[: min(64, num_tokens)], mode=mode, chunk_tokens=chunk_tokens)  # warm-up
    weights = weights_bytes(model)
    device = model.inv_freq.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        forward(model, ids, mode=mode, chunk_tokens=chunk_tokens)
        torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        return ForwardPeak(num_tokens, torch.cuda.max_memory_allocated(device), weights, seconds, "cuda max allocated")
    baseline = _status_bytes("VmRSS")
    method = "VmHWM after clear_refs" if _reset_cpu_peak() else "VmHWM (not resettable: an upper bound)"
    start = time.perf_counter()
    forward(model, ids, mode=mode, chunk_tokens=chunk_tokens)
    seconds = time.perf_counter() - start
    return ForwardPeak(num_tokens, max(0, _status_bytes("VmHWM") - baseline) + weights, weights, seconds, method)
