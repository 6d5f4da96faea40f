"""`python -m benchmarks mil`: maximum input length (MIL) under a memory budget, and prefill speed.

For each forward mode:
- peak memory of one forward against input length, each length probed in a fresh process
  (`benchmarks.probe`), and the longest input whose peak fits the budget, found by doubling
  then bisection to `resolution` tokens. Measured, never computed from a formula.
- single-request prefill throughput (tokens/s) at a few lengths, in this process, and the
  achieved FLOP/s as a fraction of this machine's measured matmul rate in the same dtype.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from benchmarks.report import write_report
from tiered.hybrid.args import ModelArgs
from tiered.hybrid.forward import forward
from tiered.hybrid.loader import DTYPES, load_model, read_args
from tiered.hybrid.memory import ForwardPeak
from tiered.hybrid.spill import Spill

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Throughput:
    num_tokens: int
    seconds: float
    tokens_per_s: float
    flops_per_s: float
    fraction_of_matmul: float


@dataclass(slots=True)
class ModeResult:
    mode: str
    budget_bytes: int
    mil_tokens: int
    mil_capped: bool  # True when even max_tokens fit: the MIL is at least this
    peak_bytes_by_len: dict[int, int] = field(default_factory=dict)
    throughput: list[Throughput] = field(default_factory=list)


def forward_flops(a: ModelArgs, num_tokens: int, num_prefix_tokens: int = 0) -> float:
    """Multiply-add FLOPs (2 per MAC) of one forward, last-token LM head only."""
    d, hd = a.hidden_size, a.head_dim
    per_token = 2 * (d * a.num_heads * hd + 2 * d * a.num_kv_heads * hd + a.num_heads * hd * d)
    per_token += 2 * 3 * d * a.intermediate_size
    # Causal pairs (query, key), each costing QK^T and PV: 2 * 2 * head_dim per head.
    pairs = num_tokens * num_prefix_tokens + num_tokens * (num_tokens + 1) / 2
    attn = 4 * hd * a.num_heads * pairs
    return a.num_layers * (per_token * num_tokens + attn) + 2 * d * a.vocab_size


def matmul_flops_per_s(dtype: torch.dtype, device: str, n: int = 2048, repeats: int = 5) -> float:
    """Best-of-`repeats` rate of an n^3 matmul: the roofline the forward is compared with."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    best = float("inf")
    for _ in range(repeats + 1):
        _sync(device)
        start = time.perf_counter()
        torch.mm(a, b)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@dataclass(frozen=True, slots=True)
class ForwardSetup:
    """The model a probe or a timing runs, and how: checkpoint folder, compute dtype, device, chunk size."""

    model_dir: str
    dtype: str  # float32, bfloat16 or float16
    device: str
    chunk_tokens: int  # the chunk size of the hybrid and chunked modes
    spill: Spill | None = None  # hybrid: where a long forward keeps its residual stream
    attention: str | None = None  # the attention kernel (None: the model's default on its device)


def probe_peak(setup: ForwardSetup, mode: str, num_tokens: int, num_requests: int = 1, prefix_tokens: int = 0) -> int:
    """Peak bytes of one forward of `num_tokens` (per request of a batch on one shared prefix),
    measured in a fresh process."""
    return probe(setup, mode, num_tokens, num_requests, prefix_tokens).peak_bytes


def probe(
    setup: ForwardSetup, mode: str, num_tokens: int, num_requests: int = 1, prefix_tokens: int = 0
) -> ForwardPeak:
    """One forward of `num_tokens` measured in a fresh process: its peak (weights included), weights
    and seconds; a forward that ran out of memory has a peak of `sys.maxsize`."""
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.probe",
        "--model",
        setup.model_dir,
        "--dtype",
        setup.dtype,
        "--device",
        setup.device,
        "--mode",
        mode,
        "--chunk-tokens",
        str(setup.chunk_tokens),
        "--tokens",
        str(num_tokens),
        "--requests",
        str(num_requests),
        "--prefix-tokens",
        str(prefix_tokens),
    ]
    if setup.attention is not None:
        cmd += ["--attention", setup.attention]
    if setup.spill is not None:
        cmd += ["--spill-dir", setup.spill.directory, "--spill-min-tokens", str(setup.spill.min_tokens)]
    # The probe is a module of this harness: its repository root goes on the child's path.
    root = str(Path(__file__).resolve().parent.parent)
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        if "out of memory" in done.stderr.lower() or done.returncode in (-9, 137):
            return ForwardPeak(num_tokens * num_requests, sys.maxsize, 0, 0.0, "did not fit at all")
        raise RuntimeError(f"probe failed ({' '.join(cmd)}):\n{done.stderr[-2000:]}")
    return ForwardPeak(**json.loads(done.stdout))


def find_mil(
    setup: ForwardSetup, mode: str, budget_bytes: int, start_tokens: int, resolution: int, max_tokens: int
) -> ModeResult:
    """Longest input (to `resolution` tokens) whose forward peak fits `budget_bytes`."""
    result = ModeResult(mode=mode, budget_bytes=budget_bytes, mil_tokens=0, mil_capped=False)

    def fits(n: int) -> bool:
        peak = probe_peak(setup, mode, n)
        result.peak_bytes_by_len[n] = peak
        log.info(
            "  %-8s %7d tokens: peak %8.1f MiB %s",
            mode,
            n,
            peak / 2**20,
            "fits" if peak <= budget_bytes else "over budget",
        )
        return peak <= budget_bytes

    lo, hi = 0, 0
    n = start_tokens
    while True:
        if not fits(n):
            hi = n
            break
        lo = n
        if n >= max_tokens:
            result.mil_capped = True
            break
        n = min(2 * n, max_tokens)
    while hi and hi - lo > resolution:
        mid = (lo + hi) // 2 // resolution * resolution
        if mid <= lo:
            break
        if fits(mid):
            lo = mid
        else:
            hi = mid
    result.mil_tokens = lo
    return result


def measure_throughput(
    setup: ForwardSetup, modes: list[str], lengths: list[int], repeats: int
) -> dict[str, list[Throughput]]:
    """Best-of-`repeats` single-request prefill speed per mode and length, in this process."""
    dtype, device, chunk_tokens = setup.dtype, setup.device, setup.chunk_tokens
    model = load_model(setup.model_dir, dtype, device)
    rate = matmul_flops_per_s(DTYPES[dtype], device)
    log.info("matmul rate (%s, 2048^3): %.1f GFLOP/s", dtype, rate / 1e9)
    out: dict[str, list[Throughput]] = {m: [] for m in modes}
    gen = torch.Generator().manual_seed(0)
    for n in lengths:
        ids = torch.randint(0, model.args.vocab_size, (n,), generator=gen)
        flops = forward_flops(model.args, n)
        best = dict.fromkeys(modes, float("inf"))
        for mode in modes:
            forward(model, ids[:256], mode=mode, chunk_tokens=chunk_tokens)  # type: ignore[arg-type]
        for _ in range(repeats):  # modes interleaved, so a slow spell of the machine hits all of them
            for mode in modes:
                _sync(device)
                start = time.perf_counter()
                forward(model, ids, mode=mode, chunk_tokens=chunk_tokens)  # type: ignore[arg-type]
                _sync(device)
                best[mode] = min(best[mode], time.perf_counter() - start)
        for mode in modes:
            t = Throughput(n, best[mode], n / best[mode], flops / best[mode], flops / best[mode] / rate)
            out[mode].append(t)
            log.info(
                "  %-8s %7d tokens: %.2f s, %.0f tokens/s, %.0f%% of matmul rate",
                mode,
                n,
                t.seconds,
                t.tokens_per_s,
                100 * t.fraction_of_matmul,
            )
    return out


def format_table(results: list[ModeResult]) -> str:
    lines = [f"{'mode':<9} {'budget MiB':>10} {'MIL tokens':>11} {'vs vanilla':>10}"]
    base = next((r.mil_tokens for r in results if r.mode == "vanilla"), 0)
    for r in results:
        ratio = f"{r.mil_tokens / base:.2f}x" if base else "-"
        mil = f"{'>=' if r.mil_capped else ''}{r.mil_tokens}"
        lines.append(f"{r.mode:<9} {r.budget_bytes / 2**20:>10.0f} {mil:>11} {ratio:>10}")
    if any(r.throughput for r in results):
        lines.append("")
        lines.append(f"{'mode':<9} {'tokens':>7} {'seconds':>8} {'tokens/s':>9} {'of matmul':>9} {'vs vanilla':>10}")
        speeds = {r.mode: {t.num_tokens: t.tokens_per_s for t in r.throughput} for r in results}
        for r in results:
            for t in r.throughput:
                v = speeds.get("vanilla", {}).get(t.num_tokens)
                rel = f"{t.tokens_per_s / v:.3f}" if v else "-"
                lines.append(
                    f"{r.mode:<9} {t.num_tokens:>7} {t.seconds:>8.2f} {t.tokens_per_s:>9.0f} "
                    f"{100 * t.fraction_of_matmul:>8.0f}% {rel:>10}"
                )
    return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class MilOptions:
    """What `run_mil_bench` runs beyond the model (the CLI's options, one to one)."""

    budget_bytes: int  # weights + one forward's activations must fit this
    json_path: str | None
    modes: list[str]  # forward modes: vanilla, chunked, hybrid
    lengths: list[int]  # input lengths of the throughput measurement
    resolution: int  # the bisection stops at this many tokens
    start_tokens: int  # the first probe's length (then doubling)
    max_tokens: int  # the search stops above this length
    repeats: int  # timed runs per length; the best is kept
    skip_mil: bool  # throughput only
    skip_throughput: bool  # MIL only


def run_mil_bench(setup: ForwardSetup, opts: MilOptions) -> list[ModeResult]:
    """Per mode, the MIL under the budget and the prefill speed at `opts.lengths` (see the module docstring)."""
    args = read_args(setup.model_dir)
    budget_bytes = opts.budget_bytes
    results: list[ModeResult] = []
    for mode in opts.modes:
        if opts.skip_mil:
            results.append(ModeResult(mode, budget_bytes, 0, False))
            continue
        log.info("MIL of %s under %.0f MiB", mode, budget_bytes / 2**20)
        results.append(find_mil(setup, mode, budget_bytes, opts.start_tokens, opts.resolution, opts.max_tokens))
    if not opts.skip_throughput:
        speeds = measure_throughput(setup, opts.modes, opts.lengths, opts.repeats)
        for r in results:
            r.throughput = speeds[r.mode]
    print(format_table(results))
    write_report(
        opts.json_path,
        "mil",
        setup.device,
        {
            "model": {"path": setup.model_dir, "dtype": setup.dtype, "args": asdict(args)},
            "chunk_tokens": setup.chunk_tokens,
            "modes": [asdict(r) for r in results],
        },
    )
    return results
