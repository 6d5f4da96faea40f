"""Where a server's time goes: py-spy samples of its processes during a run, sorted into parts.

`sampled(pid, out)` records every thread of the API process (`pid`) and of its engine process
(its child) with py-spy (`--idle --threads --native`: idle threads and native frames included,
one sample of each thread every 1/RATE s) while the block runs. `breakdown(raw)` sorts each
sample of a thread by the innermost frame that names a part (see `PARTS`); a thread's samples
are its wall time, so the engine's main thread gives where the engine's time goes, and a
thread that only waits (the host tier's store thread, the API's event loop) shows as idle.
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
from pathlib import Path

import psutil

RATE = 97  # samples per second per thread: not a multiple of common timer rates

# (part, pattern on one frame "function (file:line)"), tried from the innermost frame outwards;
# the first frame that matches any pattern names the sample's part.
PARTS: list[tuple[str, re.Pattern[str]]] = [
    (part, re.compile(pattern))
    for part, pattern in [
        ("forward: linear (GEMM)", r"gemm|brgemm|dnnl|mkl|jit_uni|addmm|\bmm\b|matmul|linear_out|cblas"),
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
        ("idle (waiting: poll, select, locks)", r"epoll|select|poll|futex|wait|sleep|acquire|_recv|recv_"),
    ]
]
OTHER = "other"


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


@contextmanager
def sampled(api_pid: int, out_dir: Path) -> Iterator[dict[str, Path]]:
    """Record the API process and its engine process while the block runs; yields role -> raw file."""
    out_dir.mkdir(parents=True, exist_ok=True)
    pids = {"api": api_pid, "engine": engine_pid(api_pid)}
    files: dict[str, Path] = {}
    procs = []
    for role, pid in pids.items():
        if pid is None:
            continue
        files[role] = out_dir / f"{role}.txt"
        cmd = [_py_spy(), "record", "--pid", str(pid), "--rate", str(RATE), "--format", "raw"]
        cmd += ["--idle", "--threads", "--native", "--nonblocking", "-o", str(files[role])]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    time.sleep(1.0)  # py-spy attaches
    try:
        yield files
    finally:
        for p in procs:
            p.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        for p in procs:
            p.wait(timeout=120)


IDLE = PARTS[-1][0]
# Parts whose waits are part of their work (a GEMM's barrier, a store's lock): a sample that waits
# inside one of them counts for it, a wait anywhere else (a ZMQ poll, the event loop) is idle.
WORK_PARTS = PARTS[:8]


def _part(frames: list[str]) -> str:
    """The part of one sample: the innermost frame that matches a part's pattern; a blocking wait
    is idle unless it happens inside a part that does work."""
    if frames and PARTS[-1][1].search(frames[-1]):
        for frame in reversed(frames):
            for part, pattern in WORK_PARTS:
                if pattern.search(frame):
                    return part
        return IDLE
    for frame in reversed(frames):
        for part, pattern in PARTS:
            if pattern.search(frame):
                return part
    return OTHER


def breakdown(raw: Path) -> dict[str, dict[str, float]]:
    """Per thread (py-spy's root frame names it): each part's share of its samples, and its
    number of samples under "samples"."""
    counts: dict[str, Counter[str]] = defaultdict(Counter)
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = stack.split(";")
        counts[frames[0]][_part(frames[1:])] += int(n)
    out: dict[str, dict[str, float]] = {}
    for thread, parts in counts.items():
        total = sum(parts.values())
        out[thread] = {part: n / total for part, n in parts.most_common()} | {"samples": float(total)}
    return out


def main_thread(threads: dict[str, dict[str, float]]) -> str | None:
    """The thread with the most samples outside idle waiting: the one that does the work."""
    busy = {t: v["samples"] * (1 - v.get(IDLE, 0.0)) for t, v in threads.items()}
    return max(busy, key=busy.__getitem__) if busy else None


def table(role: str, threads: dict[str, dict[str, float]]) -> list[str]:
    """Markdown rows: the working thread's parts, then every other thread's busy share."""
    work = main_thread(threads)
    if work is None:
        return []
    rows = [f"| {role}: {part} | {100 * share:.1f}% |" for part, share in threads[work].items() if part != "samples"]
    for t, v in threads.items():
        if t != work and v.get(IDLE, 0.0) < 0.98:
            rows.append(f"| {role}, other thread {t}: busy | {100 * (1 - v.get(IDLE, 0.0)):.1f}% |")
    return rows
