"""The memory peak of one forward, measured: cuda max allocated, or the cpu resident high-water mark.

On cpu the kernel's peak counter is reset (`/proc/self/clear_refs` with 5) just before the
forward and VmHWM read after it; the forward's peak is VmHWM minus the resident size before it.
For a clean reading run it in a process of its own with a fixed glibc mmap threshold (see
`benchmarks.mil`), so freed tensors go back to the OS and residency follows live memory.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from tiered.config import ForwardMode
from tiered.hybrid.forward import BatchItem, LayerKV, forward_batch
from tiered.hybrid.model import CausalLM
from tiered.hybrid.spill import Spill


@dataclass(slots=True)
class ForwardPeak:
    """One measured forward: its tokens, peak memory (weights included), weights, seconds and how it was measured."""

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
    """Bytes of the weights the model holds (a pipeline stage's parts on the meta device hold none)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta)


class GatheredPrefix(Sequence[LayerKV]):
    """A prefix that copies a layer's K,V out on each access, as the device tier's gather does."""

    def __init__(self, layers: list[LayerKV]) -> None:
        self._layers = layers
        self.num_tokens = layers[0][0].shape[0]

    def __len__(self) -> int:
        return len(self._layers)

    def __getitem__(self, layer: int) -> LayerKV:  # type: ignore[override]
        k, v = self._layers[layer]
        return k.clone(), v.clone()


@dataclass(frozen=True, slots=True)
class PeakShape:
    """The forward whose peak is measured: `num_requests` requests of `num_tokens` new tokens
    each, on one shared prefix of `prefix_tokens` (held outside the forward, as the device tier
    holds it; the forward's gather of each layer counts). A pipeline stage's part of the model: a
    stage after the first (`first_stage=False`) starts from a residual stream [N, D] of random
    values, allocated inside the measured forward as the stage allocates the buffer it receives
    into; a stage before the last (`last_stage=False`) ends with its residual stream, not logits."""

    num_tokens: int
    num_requests: int = 1
    prefix_tokens: int = 0
    first_stage: bool = True
    last_stage: bool = True


def measure_forward_peak(
    model: CausalLM, shape: PeakShape, mode: ForwardMode, chunk_tokens: int, spill: Spill | None = None
) -> ForwardPeak:
    """Run one forward of `shape` on random tokens (its residual stream in `spill`'s directory when
    it asks for one that long) and return its memory peak."""
    num_tokens, num_requests, prefix_tokens = shape.num_tokens, shape.num_requests, shape.prefix_tokens
    first_stage, last_stage = shape.first_stage, shape.last_stage
    a = model.args
    g = torch.Generator().manual_seed(0)
    device = model.inv_freq.device
    dtype = next(p.dtype for p in model.parameters() if not p.is_meta)
    prefix = None
    if prefix_tokens:
        kv_shape = (prefix_tokens, a.num_kv_heads, a.head_dim)
        layers = [
            tuple(torch.randn(kv_shape, generator=g).to(device, dtype) for _ in "kv") for _ in range(a.num_layers)
        ]
        prefix = GatheredPrefix(layers)  # type: ignore[arg-type]
    items = [BatchItem(torch.randint(0, a.vocab_size, (num_tokens,), generator=g), prefix) for _ in range(num_requests)]
    warm = [BatchItem(it.token_ids[: min(64, num_tokens)], prefix) for it in items[:2]]

    def run(items: list[BatchItem]) -> None:
        hidden = None
        if not first_stage:
            num_rows = sum(it.token_ids.numel() for it in items)
            hidden = torch.randn((num_rows, a.hidden_size), generator=g).to(device, dtype)
        forward_batch(
            model, items, mode=mode, chunk_tokens=chunk_tokens, hidden=hidden, last_stage=last_stage, spill=spill
        )

    run(warm)  # warm-up
    weights = weights_bytes(model)
    total = num_requests * num_tokens
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        run(items)
        torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        return ForwardPeak(total, torch.cuda.max_memory_allocated(device), weights, seconds, "cuda max allocated")
    baseline = _status_bytes("VmRSS")
    method = "VmHWM after clear_refs" if _reset_cpu_peak() else "VmHWM (not resettable: an upper bound)"
    start = time.perf_counter()
    run(items)
    seconds = time.perf_counter() - start
    return ForwardPeak(total, max(0, _status_bytes("VmHWM") - baseline) + weights, weights, seconds, method)
