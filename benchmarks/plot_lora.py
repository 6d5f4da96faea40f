"""Saturated visits/s per system of a `python -m benchmarks visits` run with LoRA systems, as a bar chart.

.venv/bin/python -m benchmarks.plot_lora benchmarks/out/visits-lora-bench-m.json \
    benchmarks/plots/visits-lora-bench-m.png
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(json_path: str, png_path: str) -> None:
    doc = json.loads(open(json_path).read())  # noqa: SIM115
    rates = {s["system"]: s["visits_per_s"] for s in doc["saturation"]}
    groups = [("base", "tiered", "vllm"), *[(f"K={k}", f"tiered-lora{k}", f"vllm-lora{k}") for k in (1, 8, 64)]]
    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=100)
    width = 0.38
    for i, (_, ours, theirs) in enumerate(groups):
        for dx, name, color in ((-width / 2, ours, "tab:blue"), (width / 2, theirs, "tab:orange")):
            value = rates.get(name)
            ax.bar(i + dx, value or 0.0, width, color=color, label=name.split("-")[0] if i == 0 else None)
            ax.text(
                i + dx,
                value or 0.0,
                "not run" if value is None else f"{value:.2f}",
                ha="center",
                va="bottom",
                fontsize=8,
            )
    ax.set_xticks(range(len(groups)), [g[0] for g in groups])
    ax.set_ylabel("visits/s at saturation")
    ax.set_title("LoRA adapters on bench-m, visit workload (8 prompts per call)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
