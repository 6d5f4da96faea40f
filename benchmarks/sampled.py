"""Where a server's time goes: py-spy samples of its processes during a run, sorted into parts.

`sampled(pid, out)` records every thread of the API process (`pid`) and of its engine process
(its child) with py-spy (`--threads --nonblocking`: a sample of each running thread every
1/RATE s, the process never paused; Python frames only, so a GEMM is the frame of the helper
that calls it) while the block runs. `breakdown(raw, seconds)` sorts each sample of a thread by
the innermost frame that names a part (see `PARTS`) and divides by the samples the thread would
have had running all the time: each part's share of the wall time, the rest idle.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psutil

RATE = 97  # samples per second per thread: not a multiple of common timer rates

# (part, pattern on one frame "function (file:line)"), tried from the innermost frame outwards;
# the first frame that matches any pattern names the sample's part.
PARTS: list[tuple[str, re.Pattern[str]]] = [
    (part, re.compile(pattern))
    for part, pattern in [
        ("forward: linear (GEMM)", r"_linear_into|_linear_accumulate_|gemm|dnnl|mkl|addmm|matmul|cblas"),
        ("forward: attention", r"tiered/hybrid/attention/|attend"),
        ("forward: norms, RoPE, SiLU, copies", r"tiered/hybrid/"),
        ("host tier: loads and stores (LMCache)", r"lmcache|tiered/offload/host|tiered/offload/loading"),
        ("device tier and KV bookkeeping", r"tiered/offload/"),
        ("scheduling", r"tiered/scheduler/"),
        ("batch planning", r"plan_batch|_common_prefix_len"),
        ("engine Python per step and request", r"tiered/engine/"),
        ("ZMQ and msgpack", r"zmq|msgpack|tiered/api/protocol|tiered/api/engine_client"),
        ("tokenizing", r"tokenizers|transformers|tiered/api/serving.*tokeni"),
        ("JSON, validation, HTTP (FastAPI, uvicorn)", r"json|pydantic|fastapi|starlette|uvicorn|h11|httptools"),
        ("API Python", r"tiered/api/"),
    ]
]
OTHER = "other"
IDLE = "idle (not running: waiting for work, I/O or a lock)"


def _py_spy() -> str:
    """The py-spy binary beside this interpreter, else on PATH (a clear error when neither)."""
    here = Path(sys.executable).parent / "py-spy"
    found = str(here) if here.exists() else shutil.which("py-spy")
    if found is None:
        raise RuntimeError("py-spy is not installed: pip install py-spy (a dev dependency of this project)")
    return found


def engine_pid(api_pid: int) -> int | None:
    """The engine process of a `tiered serve` (the API process's child that serves the engine)."""
    for child in psutil.Process(api_pid).children(recursive=True):
        try:
            if "resource_tracker" not in " ".join(child.cmdline()):
                return child.pid
        except psutil.Error:
            continue
    return None


@dataclass
class Recording:
    """The raw files of one recording, by role (api, engine), and how long it ran."""

    files: dict[str, Path] = field(default_factory=dict)
    seconds: float = 0.0


@contextmanager
def sampled(api_pid: int, out_dir: Path) -> Iterator[Recording]:
    """Record the API process and its engine process while the block runs."""
    out_dir.mkdir(parents=True, exist_ok=True)
    pids = {"api": api_pid, "engine": engine_pid(api_pid)}
    rec = Recording()
    procs = []
    for role, pid in pids.items():
        if pid is None:
            continue
        rec.files[role] = out_dir / f"{role}.txt"
        cmd = [_py_spy(), "record", "--pid", str(pid), "--rate", str(RATE), "--format", "raw"]
        cmd += ["--threads", "--nonblocking", "-o", str(rec.files[role])]
        log = (out_dir / f"{role}.py-spy.log").open("w")
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
    time.sleep(1.0)  # py-spy attaches
    failed = [p for p in procs if p.poll() is not None]
    if failed:
        for p in procs:
            p.kill()
        logs = "; ".join((out_dir / f"{r}.py-spy.log").read_text().strip() for r in rec.files)
        raise RuntimeError(f"py-spy stopped at once: {logs}")
    start = time.perf_counter()
    try:
        yield rec
    finally:
        rec.seconds = time.perf_counter() - start
        for p in procs:
            p.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        for p in procs:
            p.wait(timeout=120)


def _part(frames: list[str]) -> str:
    """The part of one sample: the innermost frame that matches a part's pattern."""
    for frame in reversed(frames):
        for part, pattern in PARTS:
            if pattern.search(frame):
                return part
    return OTHER


def breakdown(raw: Path, seconds: float) -> dict[str, dict[str, float]]:
    """Per thread (py-spy's root frame names it): each part's share of the recording's wall time
    (py-spy samples a thread only while it runs, RATE times a second), and "idle" for the rest."""
    counts: dict[str, Counter[str]] = defaultdict(Counter)
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = stack.split(";")
        counts[frames[0]][_part(frames[1:])] += int(n)
    expected = max(1.0, seconds * RATE)
    out: dict[str, dict[str, float]] = {}
    for thread, parts in counts.items():
        shares = {part: n / expected for part, n in parts.most_common()}
        out[thread] = shares | {IDLE: max(0.0, 1.0 - sum(shares.values()))}
    return out


def main_thread(threads: dict[str, dict[str, float]]) -> str | None:
    """The thread py-spy names MainThread (the engine's loop, the API's event loop)."""
    return next((t for t in threads if t.endswith("MainThread")), None)


def table(role: str, threads: dict[str, dict[str, float]]) -> list[str]:
    """Markdown rows: the main thread's parts, then every other thread busy over 2% of the time."""
    main = main_thread(threads)
    if main is None:
        return []
    rows = [f"| {role}: {part} | {100 * share:.1f}% |" for part, share in threads[main].items()]
    for t, v in threads.items():
        busy = 1 - v.get(IDLE, 0.0)
        if t != main and busy > 0.02:
            top = max((p for p in v if p != IDLE), key=v.__getitem__)
            rows.append(f"| {role}, thread {t.split(': ', 1)[-1]}: busy (mostly {top}) | {100 * busy:.1f}% |")
    return rows
