"""The harness's honesty rules: provenance in every document, the peer's launch at its defaults with
our KV bytes, paired ratios, a wait for quiet servers, and the committed results tables equal to
what `python -m benchmarks report` writes."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks.report import (
    END,
    START,
    headline_row,
    render_summary,
    render_table,
    splice,
    write_report,
    write_tables,
)
from benchmarks.servers import wait_quiet
from benchmarks.vllm import PeerOptions, VLLMServer, kv_memory_bytes, peer_launch
from tiered.config import load_config
from tiered.config.options import DEFAULT_CONFIG

ROOT = Path(__file__).resolve().parents[2]


def test_every_document_carries_its_provenance(tmp_path: Path) -> None:
    doc = write_report(str(tmp_path / "r.json"), "demo", "cpu", {"x": 1})
    saved = json.loads((tmp_path / "r.json").read_text())
    prov = saved["provenance"]
    assert saved == doc and saved["x"] == 1
    assert set(prov) - {"gpu"} == {"commit", "cpu_model", "cpu_flags", "cores", "threads", "torch", "command"}
    assert ("gpu" in prov) == torch.cuda.is_available()
    assert len(prov["commit"].split("+")[0]) == 40 and prov["threads"] >= 1 and prov["torch"].startswith("2.13")


def test_the_table_names_the_gpu_a_run_had(tmp_path: Path) -> None:
    row = headline_row("load", "s", ("offload", [1.0, 1.0, 1.0]), ("discard", [2.0, 2.0, 2.0]), False)
    for name, gpu in (("gpu", {"gpu": "NVIDIA H200"}), ("cpu", {})):
        doc = write_report(None, "demo", "cuda" if gpu else "cpu", {"headline": [row]})
        doc["provenance"].pop("gpu", None)
        doc["provenance"].update(gpu, cpu_model="Host CPU", cpu_flags=["avx2"], threads=16)
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
    table = render_table(tmp_path)
    assert "**NVIDIA H200; host: Host CPU (avx2); 16 threads**" in table and "**Host CPU (avx2); 16 threads**" in table


def test_ratios_are_paired_run_by_run_and_say_which_way_is_better() -> None:
    up = headline_row("visits/s", "visits/s", ("tiered", [1.0, 2.0, 3.0]), ("vllm", [2.0, 1.0, 1.5]), True)
    assert up["ratio"]["values"] == [0.5, 2.0, 2.0] and up["ratio"]["median"] == 2.0
    assert (up["ours"]["median"], up["ours"]["min"], up["ours"]["max"], up["ours"]["n"]) == (2.0, 1.0, 3.0, 3)
    down = headline_row("latency", "s", ("tiered", [1.0, 4.0]), ("vllm", [3.0, 2.0]), False)
    assert down["ratio"]["values"] == [3.0, 0.5] and down["ratio_is"] == "peer / ours"
    with pytest.raises(ValueError):
        headline_row("x", "s", ("a", [1.0]), ("b", [1.0, 2.0]), True)


def test_the_peer_starts_compiled_with_the_ram_of_both_our_tiers(tiny_dir: Path) -> None:
    cfg = load_config(
        DEFAULT_CONFIG,
        [f"model.path={tiny_dir}", "cache.device_tier_bytes=1048576", "cache.host.lmcache.max_local_cpu_size=0.5"],
    )
    assert kv_memory_bytes(cfg) == 2**20 + 2**29
    discard = load_config(DEFAULT_CONFIG, [f"model.path={tiny_dir}", "cache.suffix=discard"])
    assert kv_memory_bytes(discard) == discard.cache.device_tier_bytes  # no host tier is started
    v = VLLMServer(peer_launch(cfg, "/py", 4096))
    assert "--enforce-eager" not in v.args and "--num-gpu-blocks-override" not in v.args
    assert v.args[v.args.index("--kv-cache-memory-bytes") + 1] == str(2**20 + 2**29)
    assert "--max-num-batched-tokens" not in v.args and "--block-size" not in v.args  # vLLM's defaults
    assert set(v.launch_record()) == {"argv", "env", "startup_seconds"} and "VLLM_CPU_KVCACHE_SPACE" not in v.env
    eager = VLLMServer(peer_launch(cfg, "/py", 4096, 2**20, PeerOptions(eager=True, chunked=False)))
    assert "--enforce-eager" in eager.args and eager.args[eager.args.index("--max-num-batched-tokens") + 1] == "4096"
    # 1 MiB does not hold one 4,096-token request: raised to what vLLM needs, and said so
    per_token = eager.launch.kv_bytes_per_token
    assert eager.enlarged and eager.kv_bytes == (4096 // 128 + 1) * 128 * per_token


def test_a_run_waits_until_no_server_computes() -> None:
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    busy = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 2.5: pass"])
    try:
        time.sleep(0.3)
        assert wait_quiet([idle.pid], settle_s=0.5) < 2.0
        assert wait_quiet([idle.pid, busy.pid], settle_s=0.5) >= 1.5  # until the busy one ended
    finally:
        idle.kill()
        busy.kill()


def test_the_committed_results_tables_are_the_generated_ones() -> None:
    targets = [
        (ROOT / "benchmarks" / "RESULTS.md", "results/", False),
        (ROOT / "README.md", "benchmarks/results/", True),
    ]
    stale = write_tables(targets, ROOT / "benchmarks" / "results", check=True)
    assert stale == [], (
        f"run `python -m benchmarks report`: {', '.join(map(str, stale))} differ from the generated table"
    )


def test_the_table_holds_every_headline_row_and_its_command(tmp_path: Path) -> None:
    row = headline_row(
        "visits/s at saturation", "visits/s", ("tiered", [0.8, 0.9, 1.0]), ("vllm", [0.7, 0.8, 0.8]), True
    )
    once = headline_row("a sweep's single run", "s", ("tiered", [1.0]), ("vllm", [2.0]), False)
    write_report(str(tmp_path / "a.json"), "visits", "cpu", {"headline": [row, once]})
    write_report(str(tmp_path / "b.json"), "load", "cpu", {})  # no headline: not in the table
    write_report(str(tmp_path / "c.json"), "mixed", "cpu", {"headline": [once]})  # a sweep's single runs: neither
    table = render_table(tmp_path, "results/")
    assert table.startswith(START) and table.endswith(END)
    assert "| visits/s at saturation | `tiered` 0.9 visits/s (0.8–1) | `vllm` 0.8 visits/s (0.7–0.8) |" in table
    assert "**1.14x** (1.12–1.25)" in table and "a sweep's single run" not in table
    assert "[a](results/a.json)" in table and "[b]" not in table and "[c]" not in table
    text = f"# R\n{START}\nold\n{END}\nafter\n"
    assert splice(text, table, "R") == f"# R\n{table}\nafter\n"
    with pytest.raises(ValueError, match="R has no generated-table markers"):
        splice("# R\n", table, "R")


def test_a_lone_prompt_refuses_what_it_cannot_size(tmp_path: Path) -> None:
    from benchmarks.alone import AloneOptions, run_alone_bench
    from benchmarks.traces import BenchError

    cfg = load_config(DEFAULT_CONFIG)
    with pytest.raises(BenchError, match="unknown system.*vllm-full"):
        run_alone_bench(cfg, AloneOptions(["tiered", "vllm-full"], out_dir=tmp_path))
    with pytest.raises(BenchError, match="--tokens must be >= 2"):
        run_alone_bench(cfg, AloneOptions(["tiered"], tokens=1, out_dir=tmp_path))


def test_rows_are_grouped_by_machine_newest_first_and_the_readme_keeps_the_newest_alone(tmp_path: Path) -> None:
    row = headline_row("visits/s", "visits/s", ("tiered", [2.0, 2.0, 2.0]), ("vllm", [1.0, 1.0, 1.0]), True)
    for name, cpu, date in (
        ("old-amd", "AMD", "2026-12-01"),
        ("xeon", "Xeon", "2026-12-04"),
        ("amd", "AMD", "2026-12-06"),
    ):
        doc = write_report(None, "visits", "cpu", {"headline": [row]})
        doc["provenance"].update(cpu_model=cpu, cpu_flags=["avx2"], threads=2)
        doc["date"] = date
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
    table = render_table(tmp_path, "results/")
    amd, xeon = table.index("**AMD (avx2); 2 threads**"), table.index("**Xeon (avx2); 2 threads**")
    assert amd < xeon  # the machine with the newest run first
    amd_rows = table[amd:xeon]
    assert amd_rows.index("[amd](results/amd.json)") < amd_rows.index("[old-amd](results/old-amd.json)")
    assert "[xeon]" not in amd_rows
    summary = render_summary(tmp_path, "results/")
    assert "Measured on AMD, 2 threads" in summary and "Xeon" not in summary and "avx2" not in summary
    # one workload: its newest document alone
    assert "[visits](results/amd.json)" in summary and "old-amd" not in summary


def test_the_readme_summary_keeps_one_row_a_workload_against_the_better_peer(tmp_path: Path) -> None:
    for i in range(10):
        rows = [
            headline_row("visits/s", "visits/s", ("tiered", [3.0] * 3), ("vllm-lmcache", [1.0] * 3), True),
            headline_row("tokens/s", "tokens/s", ("tiered", [3.0] * 3), ("vllm", [2.9] * 3), True),
            headline_row("visits/s", "visits/s", ("tiered", [3.0] * 3), ("vllm", [1.5] * 3), True),
        ]
        doc = write_report(None, f"load{i}", "cpu", {"headline": rows})
        doc["date"] = f"2026-12-{i + 10}"
        (tmp_path / f"run{i}.json").write_text(json.dumps(doc))
    summary = render_summary(tmp_path, "results/")
    body = [line for line in summary.splitlines() if line.startswith("| [load")]
    assert len(body) == 8 and body[0].startswith("| [load9](results/run9.json)") and "run1" not in summary
    # the first measure, against the peer it leads by least
    assert all("`vllm` 1.5 visits/s" in line and "**2.00x**" in line and "tokens/s" not in line for line in body)


def test_a_capacity_the_peer_never_reached_is_said_so_not_divided(tmp_path: Path) -> None:
    """A side at 0 in every run (no load met the objectives) leaves no ratio: the tables say whose
    is 0, and the summary ranks that row as ours ahead, not as a NaN."""
    zero = headline_row("short calls/s sustained", "short/s", ("tiered", [0.5, 0.75, 0.5]), ("vllm", [0.0] * 3), True)
    none = headline_row("short calls/s sustained", "short/s", ("tiered", [0.0] * 3), ("vllm-lmcache", [0.5] * 3), True)
    assert [r == r for r in zero["ratio"]["values"]] == [False] * 3  # NaN: no ratio
    write_report(str(tmp_path / "cap.json"), "mixed", "cpu", {"headline": [zero, none]})
    table = render_table(tmp_path, "results/")
    assert "| no ratio: the peer's is 0 | 3 |" in table and "| no ratio: ours is 0 | 3 |" in table
    assert "nan" not in table
    summary = render_summary(tmp_path, "results/")
    assert "`vllm-lmcache` 0.5 short/s (0.5–0.5) | no ratio: ours is 0 |" in summary


def test_headline_sh_holds_the_command_of_every_json_in_the_table() -> None:
    script = (ROOT / "benchmarks" / "headline.sh").read_text()
    for path in sorted((ROOT / "benchmarks" / "results").glob("*.json")):
        doc = json.loads(path.read_text())
        if not any(row["ratio"]["n"] >= 3 for row in doc.get("headline") or []):
            continue
        lines = [line for line in script.splitlines() if f"$R/{path.name}" in line]
        assert lines, f"benchmarks/headline.sh has no command that writes {path.name}"
        words = doc["provenance"][
            "command"
        ].split()  # python -m benchmarks BENCH ..., or earlier `tiered bench BENCH ...`
        bench = words[words.index("benchmarks" if "benchmarks" in words else "bench") + 1]
        command = script[: script.index(lines[0]) + len(lines[0])].rsplit("$B ", 1)[1]
        assert command.startswith(bench), f"{path.name} was written by `{bench}`, headline.sh runs `{command[:40]}`"


def test_each_workload_shows_its_newest_document_named_by_its_file(tmp_path: Path) -> None:
    """Documents of one workload (a file name's prefix) give one row, the newest's; a beyond-memory
    visits run is its own workload, not the visits one."""
    row = headline_row("visits/s", "visits/s", ("tiered", [2.0] * 3), ("vllm", [1.0] * 3), True)
    for name, date in (
        ("visits-bench-m", "2026-12-01"),
        ("visits-bench-m-loads", "2026-12-03"),
        ("visits-beyond-memory-x", "2026-12-02"),
        ("mixed-bench-m-16k", "2026-12-02"),
    ):
        doc = write_report(None, "visits" if name.startswith("visits") else "mixed", "cpu", {"headline": [row]})
        doc["date"] = date
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
    body = [line for line in render_summary(tmp_path, "results/").splitlines() if line.startswith("| [")]
    assert [line.split("](")[0] for line in body] == [
        "| [visits",
        "| [KV beyond memory",  # the same date: by name, as the full table orders them
        "| [short calls among 16 K prompts",
    ]
    assert "visits-bench-m-loads.json" in body[0]


def test_of_two_documents_of_one_day_the_later_written_is_the_newest(tmp_path: Path) -> None:
    """Documents of one workload and date are ordered by when they were written, whatever their
    names; one written before documents carried that time is the older of its day."""
    row = headline_row("visits/s", "visits/s", ("tiered", [2.0] * 3), ("vllm", [1.0] * 3), True)
    for name, written in (
        ("mixed-a", None),
        ("mixed-a-rerun", "2026-12-07T09:42:00Z"),
        ("mixed-b", "2026-12-07T08:00:00Z"),
    ):
        doc = write_report(None, "mixed", "cpu", {"headline": [row]})
        assert doc["written_at"].endswith("Z")
        doc["date"] = "2026-12-07"
        if written is None:
            del doc["written_at"]
        else:
            doc["written_at"] = written
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
    table = render_table(tmp_path, "results/")
    assert [n for n in ("mixed-a-rerun.json", "mixed-b.json", "mixed-a.json") if n in table] == [
        "mixed-a-rerun.json",
        "mixed-b.json",
        "mixed-a.json",
    ]
    order = [table.index(f"results/{n}") for n in ("mixed-a-rerun.json", "mixed-b.json", "mixed-a.json")]
    assert order == sorted(order)
    summary = [line for line in render_summary(tmp_path, "results/").splitlines() if line.startswith("| [")]
    assert len(summary) == 1 and "mixed-a-rerun.json" in summary[0]


def test_a_beyond_memory_row_without_a_memory_limit_says_so(tmp_path: Path) -> None:
    """Beyond memory, a run without a memory cgroup let our disk tier's page cache hold KV the peer
    did not get: the summary says so beside that row, and not beside one run under a limit."""
    row = headline_row("visits/s", "visits/s", ("tiered", [2.0] * 3), ("vllm", [1.0] * 3), True)
    for limit in (None, 4 << 30):
        doc = write_report(
            None, "visits", "cpu", {"headline": [row]} | ({"memory_limit_bytes": limit} if limit else {})
        )
        (tmp_path / "visits-beyond-memory-x.json").write_text(json.dumps(doc))
        line = next(x for x in render_summary(tmp_path, "results/").splitlines() if x.startswith("| [KV"))
        assert ("page cache uncounted" in line) == (limit is None), line
