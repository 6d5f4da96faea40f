"""The 16 K mixed-workload plot of RESULTS.md (2026-12-02): goodput against offered load from three
`tiered bench mixed` JSONs (runs b, c and d of that section), one system from each."""

import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

src = {"tiered (deadline), run d": ("d", "tiered"), "tiered-fixed1024, run c": ("c", "tiered-fixed1024"),
       "vllm-chunk1024, run b": ("b", "vllm-chunk1024")}
fig, ax = plt.subplots(figsize=(5, 3.2), dpi=100)
for label, (run, system) in src.items():
    d = json.load(open(f"benchmarks/out/mixed-bench-m-16k-{run}.json"))
    pts = []
    for x in d["runs"]:
        if x["system"] != system:
            continue
        recs = x["records"]
        window = 240.0
        good = sum(1 for r in recs if r["deadline_met"]) / window
        pts.append((x["short_qps"], good))
    pts.sort()
    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
ax.set_xlabel("short calls offered per second")
ax.set_ylabel("calls in time per second")
ax.set_title("bench-m, 16 K prompts among short calls (2 cores)", fontsize=9)
ax.legend(fontsize=7)
ax.grid(alpha=0.3)
fig.tight_layout()
fig.savefig("benchmarks/mixed-bench-m-16k-goodput.png")
