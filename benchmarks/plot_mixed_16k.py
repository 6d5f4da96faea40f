"""The 16 K mixed-workload plot of RESULTS.md (2026-12-02, evening): calls answered within their
objective per second against offered load, from `python -m benchmarks mixed` JSONs: ours and the fixed piece
sizes on the final code (run h, and fixed 512 under srjf), ours before the last fixes and vLLM's
chunked prefill from run g (see RESULTS.md)."""

import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

src = {
    "tiered (deadline), run h": ("h", "tiered"),
    "tiered (deadline), run g": ("g", "tiered"),
    "tiered-fixed512, run h": ("h", "tiered-fixed512"),
    "tiered-fixed1024, run h": ("h", "tiered-fixed1024"),
    "tiered-fixed512 srjf, run h": ("h-srjf", "tiered-fixed512"),
    "vllm-chunk1024, run g": ("g", "vllm-chunk1024"),
}
fig, ax = plt.subplots(figsize=(5, 3.2), dpi=100)
for label, (run, system) in src.items():
    d = json.load(open(f"benchmarks/out/mixed-bench-m-16k-{run}.json"))
    window = 60.0 * d["params"]["minutes"]
    pts = sorted(
        (
            x["short_qps"],
            sum(1 for r in x["records"] if r["error"] is None and 1000 * r["latency_seconds"] <= r["slo_ms"]) / window,
        )
        for x in d["runs"]
        if x["system"] == system
    )
    ax.plot(
        [p[0] for p in pts],
        [p[1] for p in pts],
        marker="o",
        label=label,
        linestyle="--" if run == "g" and system == "tiered" else "-",
    )
ax.set_xlabel("short calls offered per second")
ax.set_ylabel("calls in time per second")
ax.set_title("bench-m, 16 K prompts among short calls (2 cores)", fontsize=9)
ax.legend(fontsize=7)
ax.grid(alpha=0.3)
fig.tight_layout()
fig.savefig("benchmarks/mixed-bench-m-16k-goodput.png")
