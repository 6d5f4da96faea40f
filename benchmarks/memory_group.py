"""Memory counted the same way for every system: each server's processes in a memory cgroup.

A system's processes (ours: the API and engine; the peer: vLLM's processes and the LMCache
server) start inside one cgroup with the limit the run names. The kernel charges the page cache
of the files they read and write to it, so a disk tier's cached files are memory the system uses,
as its resident sets are. cgroup v1 (`/sys/fs/cgroup/memory`) and v2 (a folder with
`memory.max`) are both read. Where the machine gives no rights to make one, the group records
the resident sets of its processes and the page-cache bytes of its disk folders instead (the
figure is then a sample at the end of a run, not a peak), and says so.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

log = logging.getLogger(__name__)

V1_ROOT = Path("/sys/fs/cgroup/memory")
V2_ROOTS = (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup"))


@dataclass(slots=True)
class MemoryUse:
    """What a system's processes used over one run."""

    limit_bytes: int | None  # the cgroup's limit; None: no cgroup (see `method`)
    peak_bytes: int  # the cgroup's peak since the run started (RSS + page cache), or the sample
    page_cache_bytes: int  # file-backed pages charged at the end of the run
    disk_read_bytes: int  # read from storage (page-cache misses) by the group's processes over the run
    disk_written_bytes: int  # written toward storage by them over the run
    disk_folder_bytes: int  # bytes in their disk-tier folders at the end of the run
    method: str  # "cgroup-v1", "cgroup-v2" or "rss+fincore"
    oom_kills: int = 0  # processes the kernel killed at the limit over the run
    # CPU seconds (user + system) each of its processes spent over the run, by process name: where a
    # side's cores went (vLLM's worker and API server, LMCache's server; our engine and API)
    cpu_seconds: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True, frozen=True)
class _Sample:
    """One process at one moment, as a run's figures need it."""

    name: str
    cpu_seconds: float  # user + system so far
    read_bytes: int  # from storage so far (/proc/PID/io)
    write_bytes: int  # toward storage so far
    rss_bytes: int


def _read_int(path: Path, default: int = 0) -> int:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return default


def _stat(path: Path) -> dict[str, int]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    return {k: int(v) for k, v in (line.split() for line in lines if len(line.split()) == 2)}


def folder_bytes(folders: list[Path]) -> int:
    """Bytes of the files under `folders` (missing ones count 0)."""
    total = 0
    for folder in folders:
        for dirpath, _, files in os.walk(folder):
            for name in files:
                try:
                    total += os.lstat(os.path.join(dirpath, name)).st_size
                except OSError:
                    pass
    return total


def cached_bytes(folders: list[Path]) -> int:
    """Page-cache bytes of the files under `folders`, by `fincore` (0 where it is missing)."""
    files = [str(p) for f in folders if f.exists() for p in f.rglob("*") if p.is_file()]
    if not files:
        return 0
    try:
        out = subprocess.run(
            ["fincore", "--bytes", "--noheadings", "--output", "RES", *files], capture_output=True, text=True
        )
    except OSError:
        return 0
    return sum(int(line.split()[0]) for line in out.stdout.splitlines() if line.split())


@dataclass
class MemoryGroup:
    """One system's memory cgroup: made with `limit_bytes`, its processes join through `preexec`.

    `preexec` runs in a child between fork and exec (pass it as Popen's `preexec_fn`): the child
    and everything it starts are then in the group. `begin_run` resets the peak and takes the
    disk counters; `end_run` reads them. `close` removes the group once its processes are gone."""

    name: str
    limit_bytes: int | None
    disk_folders: list[Path] = field(default_factory=list)
    path: Path | None = None
    method: str = "rss+fincore"
    _start: dict[int, _Sample] = field(default_factory=dict)
    _oom_start: int = 0

    def __post_init__(self) -> None:
        if self.limit_bytes is None:
            return
        v1 = V1_ROOT / f"tiered-bench-{self.name}-{os.getpid()}"
        try:
            v1.mkdir(exist_ok=True)
            (v1 / "memory.limit_in_bytes").write_text(str(self.limit_bytes))
            self.path, self.method = v1, "cgroup-v1"
            return
        except OSError:
            if v1.exists():
                v1.rmdir()
        for root in V2_ROOTS:
            if not (root / "cgroup.controllers").exists() or "memory" not in (root / "cgroup.controllers").read_text():
                continue
            v2 = root / f"tiered-bench-{self.name}-{os.getpid()}"
            try:
                (root / "cgroup.subtree_control").write_text("+memory")
                v2.mkdir(exist_ok=True)
                (v2 / "memory.max").write_text(str(self.limit_bytes))
                self.path, self.method = v2, "cgroup-v2"
                return
            except OSError:
                if v2.exists():
                    v2.rmdir()
        log.warning(
            "no memory cgroup could be made (no rights here): %s's memory is its processes' RSS plus the "
            "page cache of its disk folders, sampled at the end of each run, and no limit holds it",
            self.name,
        )

    def preexec(self) -> None:
        """Move the calling process (a child before exec) into the group."""
        if self.path is not None:
            (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def pids(self) -> list[int]:
        """The processes in the group now."""
        if self.path is None:
            return []
        return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]

    def _sample(self, roots: list[int]) -> dict[int, _Sample]:
        """Each live process of the group (and of the trees of `roots`: all of them where there is no
        cgroup): its name, CPU seconds and storage traffic so far, and its resident bytes."""
        pids = set(self.pids())
        for root in roots:
            try:
                proc = psutil.Process(root)
                pids |= {proc.pid, *(c.pid for c in proc.children(recursive=True))}
            except psutil.NoSuchProcess:
                continue
        out = {}
        for pid in pids:
            try:
                proc = psutil.Process(pid)
                with proc.oneshot():
                    times, io = proc.cpu_times(), proc.io_counters()
                    out[pid] = _Sample(
                        proc.name(), times.user + times.system, io.read_bytes, io.write_bytes, proc.memory_info().rss
                    )
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return out

    def _oom_kills(self) -> int:
        if self.path is None:
            return 0
        name = "memory.oom_control" if self.method == "cgroup-v1" else "memory.events"
        return _stat(self.path / name).get("oom_kill", 0)

    def killed_at_limit(self) -> int:
        """Processes the kernel killed at the limit since the group was made or `begin_run`."""
        return self._oom_kills() - self._oom_start

    def begin_run(self, roots: list[int]) -> None:
        """Before a run: the peak starts again from now; the disk counters are taken."""
        if self.method == "cgroup-v1" and self.path is not None:
            (self.path / "memory.max_usage_in_bytes").write_text("0")
        elif self.method == "cgroup-v2" and self.path is not None and (self.path / "memory.peak").exists():
            try:
                (self.path / "memory.peak").write_text("0")  # kernels from 6.12 reset it on a write
            except OSError:
                pass
        self._start = self._sample(roots)
        self._oom_start = self._oom_kills()

    def end_run(self, roots: list[int]) -> MemoryUse:
        """After a run: the peak, the page cache, the disk traffic since `begin_run`."""
        now = self._sample(roots)
        zero = _Sample("", 0.0, 0, 0, 0)
        read = sum(x.read_bytes - self._start.get(pid, zero).read_bytes for pid, x in now.items())
        written = sum(x.write_bytes - self._start.get(pid, zero).write_bytes for pid, x in now.items())
        cpu: dict[str, float] = {}
        for pid, x in now.items():
            cpu[x.name] = cpu.get(x.name, 0.0) + x.cpu_seconds - self._start.get(pid, zero).cpu_seconds
        on_disk = folder_bytes(self.disk_folders)
        oom = self.killed_at_limit()
        if self.method == "cgroup-v1" and self.path is not None:
            peak = _read_int(self.path / "memory.max_usage_in_bytes")
            cache = _stat(self.path / "memory.stat").get("total_cache", 0)
        elif self.method == "cgroup-v2" and self.path is not None:
            peak = _read_int(self.path / "memory.peak", _read_int(self.path / "memory.current"))
            cache = _stat(self.path / "memory.stat").get("file", 0)
        else:
            cache = cached_bytes(self.disk_folders)
            peak = sum(x.rss_bytes for x in now.values()) + cache
        return MemoryUse(self.limit_bytes, peak, cache, read, written, on_disk, self.method, oom, cpu)

    def close(self, timeout_s: float = 30) -> None:
        """Remove the group once its processes have exited (a server's children may outlive it by a
        moment; any still there after `timeout_s` are killed)."""
        if self.path is None or not self.path.exists():
            return
        deadline = time.monotonic() + timeout_s
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in self.pids():
            log.warning("%s: process %d still in its memory group after its server stopped: killed", self.name, pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while True:
            try:
                self.path.rmdir()
                return
            except OSError as e:
                if time.monotonic() > deadline:
                    log.warning("could not remove %s: %s", self.path, e)
                    return
                time.sleep(0.2)
