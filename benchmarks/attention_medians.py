"""Attention kernels side by side, for a machine other processes share: rounds interleaved (the
kernel order reversed every other round), the median of each kernel's times, and its range.
`python -m benchmarks attention` keeps the best of 2, which load on a shared machine scatters.

    .venv/bin/python -m benchmarks.attention_medians \
        --vllm-library /tmp/vllmenv/lib/python3.11/site-packages --json benchmarks/out/attention-medians.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from benchmarks.kernels import ATTENTION_SHAPES
from tiered.hybrid.attention import KERNELS, reference_, vllm_cpu
from tiered.hybrid.attention.select import KernelShape, make_inputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", default="flash,flash-head,vllm-cpu")
    parser.add_argument("--heads", default="16,4,64", help="query heads, KV heads, head dim (bench-m's)")
    parser.add_argument("--rounds", type=int, default=7, help="rounds per shape (3 above 4 K tokens)")
    parser.add_argument("--vllm-library", default="auto", help="as attention.vllm_library")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    vllm_cpu.use_library(args.vllm_library)
    names = args.kernels.split(",")
    heads, kv_heads, head_dim = (int(x) for x in args.heads.split(","))
    rows = []
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            for shape in ATTENTION_SHAPES:
                q, k, v, pk, pv = make_inputs(shape, KernelShape(heads, kv_heads, head_dim, dtype, "cpu"))
                expected = q.clone()
                reference_(expected, k, v, shape.pieces(), pk, pv)
                times: dict[str, list[float]] = {n: [] for n in names}
                errors = {}
                for n in names:  # warm-up, and the error
                    got = q.clone()
                    KERNELS[n].attend_(got, k, v, shape.pieces(), pk, pv)
                    errors[n] = (got.float() - expected.float()).abs().max().item()
                for r in range(3 if shape.new_tokens > 4096 else args.rounds):
                    for n in names if r % 2 == 0 else names[::-1]:
                        work = q.clone()
                        start = time.perf_counter()
                        KERNELS[n].attend_(work, k, v, shape.pieces(), pk, pv)
                        times[n].append(time.perf_counter() - start)
                flops = shape.flops(heads, head_dim)
                for n in names:
                    row = {
                        "dtype": str(dtype).removeprefix("torch."),
                        "shape": shape.name,
                        "kernel": n,
                        "median_ms": 1e3 * statistics.median(times[n]),
                        "gflops": flops / statistics.median(times[n]) / 1e9,
                        "gflops_range": [flops / max(times[n]) / 1e9, flops / min(times[n]) / 1e9],
                        "max_error": errors[n],
                        "rounds": len(times[n]),
                    }
                    rows.append(row)
                    lo, hi = row["gflops_range"]
                    print(
                        f"{row['dtype']:9} {shape.name:22} {n:10} {row['median_ms']:8.1f} ms {row['gflops']:6.1f} "
                        f"GFLOP/s [{lo:5.1f}-{hi:5.1f}] error {errors[n]:.1e}",
                        flush=True,
                    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"threads": torch.get_num_threads(), "heads": [heads, kv_heads, head_dim], "rows": rows}, f, indent=1
            )


if __name__ == "__main__":
    main()
