"""`python -m benchmarks precision` and `python -m benchmarks attention`: the machine's rates that decide the
compute precision and the attention kernel, measured side by side in one process.

- precision: the linear layer of the 126 M model's MLP (2,048 x 1,024 -> 4,096) and a 2,048³
  matmul in each dtype, the CPU's flags, and what `model.dtype: auto` picks for a bf16
  checkpoint here, with whether the measurement agrees (the rule reads flags; this checks them).
- attention: every kernel that runs on the device x the shape classes (the visit shape, a long
  suffix, fresh causal prompts up to 8 K), GFLOP/s, share of the matmul rate in the same dtype and
  of the machine's best (fp32 or bf16, whichever is faster here), and the error against the fp32
  reference.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.mil import matmul_flops_per_s
from benchmarks.traces import BenchError
from tiered.hybrid.attention import vllm_cpu
from tiered.hybrid.attention.select import (
    PREFIX_LAYOUTS,
    SHAPE_CLASSES,
    KernelShape,
    ShapeClass,
    available,
    fastest,
    time_kernels,
)
from tiered.hybrid.loader import DTYPES, read_args
from tiered.hybrid.precision import NATIVE_CPU_FLAGS, cpu_flags, cpu_name, resolve_precision

log = logging.getLogger(__name__)

# Beyond the engine's start-up shapes (run with --max-tokens past their length): a fresh 8 K prompt, a
# long prompt's last piece on its first 12 K tokens, and a visit's posts on a long profile.
ATTENTION_SHAPES = (
    *SHAPE_CLASSES,
    ShapeClass("causal 8192", 1, 8192, 0),
    ShapeClass("piece 4096 on 12288", 1, 4096, 12288),
    ShapeClass("visit 8x160 on 16384", 8, 160, 16384),
)


def machine() -> dict[str, Any]:
    """What a figure depends on: the CPU, its relevant flags, the cores torch uses, torch's version."""
    flags = cpu_flags()
    relevant = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16")
    return {
        "cpu": cpu_name(),
        "flags": [f for f in relevant if f in flags],
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def linear_flops_per_s(dtype: torch.dtype, device: str, tokens: int = 2048, repeats: int = 3) -> float:
    """Best rate of F.linear [tokens, 1024] -> [tokens, 4096]: the MLP's up projection of bench-m."""
    x = torch.randn(tokens, 1024, device=device).to(dtype)
    w = torch.randn(4096, 1024, device=device).to(dtype)
    best = float("inf")
    for _ in range(repeats + 1):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        F.linear(x, w)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * tokens * 1024 * 4096 / best


def run_precision_bench(device: str, json_path: str | None) -> dict[str, Any]:
    rates = {}
    for name in ("float32", "bfloat16", "float16"):
        dtype = DTYPES[name]
        # A 2,048³ matmul in an emulated dtype takes a minute on some CPUs: 1,024³ tells the same.
        rates[name] = {
            "linear_gflops": linear_flops_per_s(dtype, device) / 1e9,
            "matmul_gflops": matmul_flops_per_s(dtype, device, n=1024, repeats=2) / 1e9,
        }
        log.info(
            "%s: linear %.1f GFLOP/s, matmul %.1f GFLOP/s",
            name,
            rates[name]["linear_gflops"],
            rates[name]["matmul_gflops"],
        )
    auto = resolve_precision("auto", "auto", "bfloat16", device)
    measured_best = max(("float32", "bfloat16"), key=lambda n: rates[n]["linear_gflops"])
    doc = {
        "machine": machine(),
        "device": device,
        "rates": rates,
        "native_flags": NATIVE_CPU_FLAGS,
        "auto_for_bf16_checkpoint": asdict(auto),
        "fastest_measured": measured_best,
        "rule_agrees": auto.compute == measured_best,
    }
    m = machine()
    print(f"{m['cpu']} ({', '.join(m['flags'])}), {m['threads']} threads")
    print(f"{'dtype':9}  {'linear GFLOP/s':>14}  {'matmul GFLOP/s':>14}")
    for name, r in rates.items():
        print(f"{name:9}  {r['linear_gflops']:>14.1f}  {r['matmul_gflops']:>14.1f}")
    bf16, fp32 = rates["bfloat16"]["linear_gflops"], rates["float32"]["linear_gflops"]
    print(f"auto, bf16 checkpoint: {auto.describe()}")
    verdict = "agrees" if doc["rule_agrees"] else "DISAGREES"
    print(f"measured: fp32 linear {fp32 / bf16:.2f}x bf16's; the rule {verdict}")
    _write(json_path, doc)
    return doc


@dataclass(frozen=True, slots=True)
class AttentionOptions:
    """What `run_attention_bench` measures (the CLI's options, one to one)."""

    model_dir: str  # the model whose heads set the shapes
    dtype_name: str  # the compute dtype: float32, bfloat16 or float16
    device: str
    kernels: list[str] | None  # None: every kernel that runs on the device
    max_tokens: int  # shapes longer than this are skipped
    json_path: str | None
    vllm_library: str = "auto"  # attention.vllm_library: auto, none, a folder or a .so
    window: int | None = None  # a sliding window of this many keys (None: none)
    prefix_layouts: tuple[str, ...] = ("paged",)  # how the prefix is read (select.PREFIX_LAYOUTS), each timed
    block_tokens: int = 256  # the pool's block size for the paged and gathered layouts


def run_attention_bench(opts: AttentionOptions) -> dict[str, Any]:
    """Every kernel x the shape classes: GFLOP/s, share of the matmul rates, error (see the module docstring)."""
    bad = [layout for layout in opts.prefix_layouts if layout not in PREFIX_LAYOUTS]
    if bad or not opts.prefix_layouts:
        raise BenchError(f"--prefix {','.join(opts.prefix_layouts)}: each one of {', '.join(PREFIX_LAYOUTS)}")
    if opts.block_tokens < 1:
        raise BenchError(f"--block-tokens {opts.block_tokens}: a block holds at least one token")
    model_dir, dtype_name, device = opts.model_dir, opts.dtype_name, opts.device
    a = read_args(model_dir)
    dtype = DTYPES[dtype_name]
    vllm_cpu.use_library(opts.vllm_library)
    runs_here = available(device, dtype, a.head_dim)
    names = opts.kernels or runs_here
    unknown = [n for n in names if n not in runs_here]
    if unknown:
        raise BenchError(
            f"--kernels {','.join(unknown)}: not a kernel that runs here (on {device} at {dtype_name}, head dim "
            f"{a.head_dim}: {', '.join(runs_here)})"
        )
    shapes = tuple(s for s in ATTENTION_SHAPES if s.new_tokens + s.prefix_tokens <= opts.max_tokens)
    if not shapes:
        shortest = min(s.new_tokens + s.prefix_tokens for s in ATTENTION_SHAPES)
        raise BenchError(f"--max-tokens {opts.max_tokens} leaves no shape class (the shortest has {shortest} tokens)")
    rates = {d: matmul_flops_per_s(d, device, 1024, 1) / 1e9 for d in (torch.float32, torch.bfloat16) if d != dtype}
    # n = 1,024 for half precisions: a CPU without native bf16 takes ~1 min per 2,048^3 product.
    rates[dtype] = matmul_flops_per_s(dtype, device, *((2048, 5) if dtype == torch.float32 else (1024, 2))) / 1e9
    matmul, matmul_bf16 = rates[dtype], rates[torch.bfloat16]
    best = max(rates.values())  # the machine's matmul roofline in its fastest dtype (fp32 or bf16)
    if opts.window is not None and opts.window < 1:
        raise BenchError(f"--window {opts.window}: a window holds at least one key")
    heads = KernelShape(a.num_heads, a.num_kv_heads, a.head_dim, dtype, device)
    by_layout = {
        layout: time_kernels(
            names, shapes, heads, window=opts.window, prefix_layout=layout, block_tokens=opts.block_tokens
        )
        for layout in opts.prefix_layouts
    }
    timings = by_layout[opts.prefix_layouts[0]]
    doc = {
        "machine": machine(),
        "device": device,
        "dtype": dtype_name,
        "model": model_dir,
        "heads": [a.num_heads, a.num_kv_heads, a.head_dim],
        "window": opts.window,
        "prefix_layouts": list(opts.prefix_layouts),
        "block_tokens": opts.block_tokens,
        "matmul_gflops": matmul,
        "matmul_bf16_gflops": matmul_bf16,
        "best_matmul_gflops": best,
        "vllm_cpu_unavailable": vllm_cpu.unavailable_reason(),
        "timings": [dict(asdict(t), prefix=layout) for layout, ts in by_layout.items() for t in ts],
        "fastest": fastest(timings),
    }
    m = machine()
    print(
        f"{m['cpu']} ({', '.join(m['flags'])}), {m['threads']} threads; "
        f"{dtype_name} matmul {matmul:.1f} GFLOP/s, bf16 {matmul_bf16:.1f}, fp32 {rates[torch.float32]:.0f} "
        f"(best {best:.0f}); "
        f"heads {a.num_heads} / {a.num_kv_heads} of {a.head_dim}"
        + (f"; sliding window of {opts.window} keys" if opts.window else "")
    )
    if doc["vllm_cpu_unavailable"]:
        print(f"vllm-cpu: unavailable ({doc['vllm_cpu_unavailable']})")
    print(
        f"{'kernel':11} {'prefix':10} {'shape':22} {'ms':>8} {'GFLOP/s':>8} {'of matmul':>9} {'of best':>8} "
        f"{'max error':>9}"
    )
    for layout, ts in by_layout.items():
        for t in ts:
            print(
                f"{t.kernel:11} {layout:10} {t.shape:22} {1e3 * t.seconds:>8.1f} {t.gflops:>8.1f} "
                f"{t.gflops / matmul:>9.0%} {t.gflops / best:>8.0%} {t.max_error:>9.1e}{'' if t.ok else '  over bound'}"
            )
    print(f"fastest correct ({opts.prefix_layouts[0]} prefix): {doc['fastest']}")
    _write(opts.json_path, doc)
    return doc


def _write(json_path: str | None, doc: dict[str, Any]) -> None:
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(doc, indent=1) + "\n")
