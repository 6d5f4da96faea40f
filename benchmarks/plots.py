"""PNG plots of a `python -m benchmarks load` JSON: latency against QPS, throughput, latency CDFs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def plot_load(doc_or_path: dict[str, Any] | str | Path, out_dir: str | Path) -> list[Path]:
    """Write latency.png, throughput.png and cdf.png for one load run; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    doc = doc_or_path if isinstance(doc_or_path, dict) else json.loads(Path(doc_or_path).read_text())
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summaries = doc["summaries"]
    systems = list(dict.fromkeys(s["system"] for s in summaries))
    title = f"{doc['trace']['kind']} ({doc['trace']['requests']} requests), {doc['machine']['device']}"
    paths = []

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, slo, name in (
        (axes[0], "mean_latency_seconds", doc["slo_mean_seconds"], "mean latency (s)"),
        (axes[1], "p99_latency_seconds", doc["slo_p99_seconds"], "P99 latency (s)"),
    ):
        for system in systems:
            mine = sorted((s for s in summaries if s["system"] == system), key=lambda s: s["offered_qps"])
            ax.plot([s["offered_qps"] for s in mine], [s[key] for s in mine], marker="o", label=system)
        for i, value in enumerate(slo if isinstance(slo, list) else [slo]):
            ax.axhline(value, color="grey", linestyle="--", linewidth=1, label="SLOs" if i == 0 else None)
        ax.set_xlabel("offered load (requests/s)")
        ax.set_ylabel(name)
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    paths.append(out / "latency.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5.5, 4.2))
    top = max(s["offered_qps"] for s in summaries)
    ax.plot([0, top], [0, top], color="grey", linestyle=":", linewidth=1, label="offered")
    for system in systems:
        mine = sorted((s for s in summaries if s["system"] == system), key=lambda s: s["offered_qps"])
        ax.plot([s["offered_qps"] for s in mine], [s["throughput_qps"] for s in mine], marker="o", label=system)
    ax.set_xlabel("offered load (requests/s)")
    ax.set_ylabel("throughput (requests/s)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    paths.append(out / "throughput.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    multiples = sorted({s["multiple"] for s in summaries})
    shown = sorted({multiples[0], min(multiples, key=lambda m: abs(m - 1)), multiples[-1]})
    fig, axes = plt.subplots(1, len(shown), figsize=(4.2 * len(shown), 4), squeeze=False)
    for ax, m in zip(axes[0], shown, strict=True):
        for run in doc["runs"]:
            if run["summary"]["multiple"] != m or run.get("repeat", 0) != 0:  # the first of repeated runs
                continue
            lat = sorted(r["latency_seconds"] for r in run["records"] if r["error"] is None)
            if lat:
                ax.plot(lat, [(i + 1) / len(lat) for i in range(len(lat))], label=run["summary"]["system"])
        ax.set_xscale("log")
        ax.set_xlabel("latency (s)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{m:g} x saturation")
        ax.grid(True, alpha=0.3)
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(f"latency CDF: {title}")
    fig.tight_layout()
    paths.append(out / "cdf.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def _per_load(scores: list[dict[str, Any]], system: str, value: Any) -> tuple[list[float], list[list[float]]]:
    """One system's loads and, per load, the values `value(score)` of its runs there."""
    by_load: dict[float, list[float]] = {}
    for s in scores:
        if s["system"] == system:
            by_load.setdefault(s["short_qps"], []).append(value(s))
    loads = sorted(by_load)
    return loads, [by_load[q] for q in loads]


def _median_line(ax: Any, loads: list[float], runs: list[list[float]], **style: Any) -> Any:
    """The median per load, with a bar from the lowest to the highest run where there are several."""
    import statistics

    med = [statistics.median(r) for r in runs]
    low = [m - min(r) for m, r in zip(med, runs, strict=True)]
    high = [max(r) - m for m, r in zip(med, runs, strict=True)]
    return ax.errorbar(loads, med, yerr=[low, high], capsize=3, **style)


def plot_goodput(doc: dict[str, Any], out_path: str | Path) -> Path:
    """The PNG of a `python -m benchmarks mixed` run: calls in time per class and in all against the
    offered short calls/s (dotted: the offered rate), and the short calls' P50 / P99 against their
    objective; each point the median of the runs at that load, its bar their min-max."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scores = doc["scores"]
    systems = list(dict.fromkeys(s["system"] for s in scores))
    fig, axes = plt.subplots(1, 4, figsize=(17, 3.8))
    for ax, kind in zip(axes[:3], ("short", "long", "total"), strict=True):
        for i, system in enumerate(systems):
            if i == 0:
                loads, offered = _per_load(scores, system, lambda s, k=kind: s[k]["offered_per_s"])
                ax.plot(loads, [o[0] for o in offered], color="grey", linestyle=":", linewidth=1, label="offered")
            loads, runs = _per_load(scores, system, lambda s, k=kind: s[k]["goodput_per_s"])
            _median_line(ax, loads, runs, marker="o", label=system)
        ax.set_xlabel("offered short calls/s")
        ax.set_ylabel(f"{'all' if kind == 'total' else kind} calls/s within objective")
        ax.grid(True, alpha=0.3)
    ax = axes[3]
    for system in systems:
        loads, runs = _per_load(scores, system, lambda s: s["short"]["p99_latency_seconds"])
        line = _median_line(ax, loads, runs, marker="o", label=f"{system} P99")
        loads, runs = _per_load(scores, system, lambda s: s["short"]["p50_latency_seconds"])
        _median_line(ax, loads, runs, marker=".", linestyle="--", color=line[0].get_color(), label=f"{system} P50")
    ax.axhline(doc["params"]["short_slo_ms"] / 1e3, color="grey", linestyle="--", linewidth=1, label="objective")
    ax.set_xlabel("offered short calls/s")
    ax.set_ylabel("short call latency (s)")
    ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    ax.legend(fontsize=7)
    p = doc["params"]
    fig.suptitle(
        f"mixed: short calls (<= {p['short_slo_ms'] / 1e3:g} s) among {p['long_per_minute']:g}/min "
        f"{p['long_tokens']}-token prompts (<= {p['long_slo_ms'] / 1e3:g} s), "
        f"{doc.get('provenance', {}).get('cpu_model') or doc['machine']['device']}; median of runs, bars min-max",
        fontsize=9,
    )
    return _save(fig, out_path)


def plot_longest(doc: dict[str, Any], out_path: str | Path) -> Path:
    """A `python -m benchmarks longest` run: the longest prompt each engine answered against the
    memory budget (left; a length it started with but did not answer is not drawn), and each
    engine's seconds per 1,000 tokens of a prompt of vLLM's length (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = sorted(doc["budgets"], key=lambda b: b["budget_bytes"])
    mib = [b["budget_bytes"] / 2**20 for b in budgets]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for name, tokens, served, at_peer_length in (
        ("tiered (hybrid)", "ours_served_tokens", "ours", "ours_at_peer_length"),
        ("vLLM at its defaults", "peer_tokens", "peer", "peer"),
    ):
        answered = [(m, b[tokens]) for m, b in zip(mib, budgets, strict=True) if b[tokens] and b[served]]
        left.plot([p[0] for p in answered], [p[1] for p in answered], marker="o", label=name)
        timed = [(m, b[at_peer_length]) for m, b in zip(mib, budgets, strict=True) if b[at_peer_length]]
        right.plot([m for m, _ in timed], [1e3 * t["seconds"] / t["tokens"] for _, t in timed], marker="o", label=name)
    left.set_xlabel("memory budget: weights + activations + KV (MiB)")
    left.set_ylabel("longest prompt answered (tokens)")
    right.set_xlabel("memory budget (MiB)")
    right.set_ylabel("s per 1,000 tokens at vLLM's length")
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"The longest prompt within a memory budget ({doc['date']}, {doc['provenance'].get('cpu_model', '')})",
        fontsize=9,
    )
    return _save(fig, out_path)


def plot_working_set(docs: list[dict[str, Any]], out_path: str | Path) -> Path:
    """`python -m benchmarks visits` runs of one KV budget at several working sets: each system's
    saturation visits/s (median, min-max bars) against the KV of the users' profiles (each once) as a
    multiple of our KV memory (vLLM is given the same)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    series: dict[str, list[tuple[float, float, float, float]]] = {}
    for doc in docs:
        x = doc["profiles_bytes"] / doc["kv_bytes"]["ours"]
        for system, runs in doc["saturation_runs"].items():
            rates = sorted(r["visits_per_s"] for r in runs)
            series.setdefault(system, []).append((x, rates[len(rates) // 2], rates[0], rates[-1]))
    for system, points in sorted(series.items()):
        points.sort()
        xs, mid = [p[0] for p in points], [p[1] for p in points]
        err = [[p[1] - p[2] for p in points], [p[3] - p[1] for p in points]]
        ax.errorbar(xs, mid, yerr=err, marker="o", capsize=3, label=system)
    budget = docs[0]["kv_bytes"]["ours"] / 2**20
    ax.set_xlabel(f"the users' profiles' KV / KV memory ({budget:.0f} MiB for each engine)")
    ax.set_ylabel("visits/s at saturation")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"Visits beyond memory ({docs[0]['date']}, {docs[0]['provenance'].get('cpu_model', '')})", fontsize=9)
    return _save(fig, out_path)


def visit_load_points(
    runs: list[tuple[dict[str, Any], list[dict[str, Any]]]], system: str, key: str
) -> dict[float, list[float]]:
    """Per offered load (a multiple of the saturation it was scaled by), the figure `key` of each of
    `system`'s load runs without faults, over every (JSON, load runs) pair of `runs`."""
    by_load: dict[float, list[float]] = {}
    for _, summaries in runs:
        for r in summaries:
            if r["summary"]["system"] == system and not r.get("faults"):
                by_load.setdefault(r["summary"]["multiple"], []).append(r["summary"][key])
    return by_load


def plot_visit_loads(runs: list[tuple[dict[str, Any], list[dict[str, Any]]]], out_path: str | Path) -> Path:
    """`python -m benchmarks visits` runs of one trace at several loads (one JSON or several, each with its
    load runs' summaries from the records beside it): each system's mean and P99 visit latency against the
    offered load as a multiple of the saturation it was scaled by (measured beside it). A dot per run,
    the line through each load's median; faulty runs are left out."""
    import statistics

    import matplotlib

    from benchmarks.stats import tail_name

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    systems = list(dict.fromkeys(s for doc, _ in runs for s in doc["systems"]))
    tails = {tail_name(r["summary"]["num_requests"]) for _, summaries in runs for r in summaries}
    for ax, key, name in (
        (axes[0], "mean_latency_seconds", "mean visit latency (s)"),
        (axes[1], "p99_latency_seconds", f"{' / '.join(sorted(tails))} visit latency (s)"),
    ):
        for i, system in enumerate(systems):
            by_load = visit_load_points(runs, system, key)
            if not by_load:
                continue
            loads = sorted(by_load)
            for x in loads:
                ax.scatter([x] * len(by_load[x]), by_load[x], color=f"C{i}", s=14, alpha=0.6)
            ax.plot(loads, [statistics.median(by_load[x]) for x in loads], color=f"C{i}", marker="o", label=system)
        ax.set_xlabel(f"offered visits/s / {runs[0][0]['load_of']}'s saturation")
        ax.set_ylabel(name)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    doc = runs[0][0]
    dates = sorted({d["date"] for d, _ in runs})
    when = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"
    fig.suptitle(
        f"Visit latency against load ({doc['trace']['requests']} visits a run, {when}, "
        f"{doc['provenance'].get('cpu_model', '')})",
        fontsize=9,
    )
    return _save(fig, out_path)


def plot_saturation(doc: dict[str, Any], out_path: str | Path) -> Path:
    """A `python -m benchmarks visits` run's saturation runs: each system's visits/s (median bar, min-max
    over its runs, faulty runs left out) and where its median run's prompt tokens came from."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = doc["systems"]
    fig, (rate_ax, token_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for i, system in enumerate(systems):
        rates = sorted(r["visits_per_s"] for r in doc["saturation_runs"][system] if not r.get("faults"))
        if not rates:
            continue
        mid = rates[(len(rates) - 1) // 2]
        rate_ax.bar(i, mid, yerr=[[mid - rates[0]], [rates[-1] - mid]], capsize=4, color=f"C{i}")
        rate_ax.text(i, mid / 2, f"{mid:.3g}", ha="center", fontsize=8)
    rate_ax.set_xticks(range(len(systems)), systems, fontsize=8)
    rate_ax.set_ylabel("visits/s at saturation")
    rate_ax.grid(True, axis="y", alpha=0.3)
    parts = (
        ("device_hit_tokens", "device tier / vLLM's cache"),
        ("host_hit_tokens", "host memory / LMCache"),
        ("disk_hit_tokens", "our disk tier"),
        ("shared_tokens", "computed once for a batch"),
        ("computed_tokens", "computed"),
    )
    by_system = {s["system"]: s["cache"] for s in doc["saturation"]}
    for i, system in enumerate(systems):
        left = 0.0
        for k, (key, label) in enumerate(parts):
            share = by_system[system][key] / max(1, by_system[system]["prompt_tokens"])
            token_ax.barh(i, share, left=left, color=f"C{k + 3}", label=label if i == 0 else None)
            left += share
    token_ax.set_yticks(range(len(systems)), systems, fontsize=8)
    token_ax.set_xlabel("share of prompt tokens (median run)")
    token_ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=3)
    limit = doc.get("memory_limit_bytes")
    memory = f", {limit / 2**30:g} GiB cgroup each" if limit else ""
    fig.suptitle(f"Visits at saturation ({doc['date']}, {doc['provenance'].get('cpu_model', '')}{memory})", fontsize=9)
    return _save(fig, out_path)


def _save(fig: Any, out_path: str | Path) -> Path:
    """Write a small PNG of `fig` (its folder made) and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
