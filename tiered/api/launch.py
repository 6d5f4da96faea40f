"""Start `tiered serve` in a child process and wait until it serves (tests and benchmarks)."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess(subprocess.Popen[bytes]):
    """A `tiered serve` child; its stdout and stderr go to `log_path` (a pipe nobody reads would
    fill up and block the server's logging, and with it whatever thread logged)."""

    log_path: Path

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]


def start_server(
    args: list[str], timeout_s: float = 900, log_path: str | Path | None = None
) -> tuple[ServerProcess, str]:
    """`tiered serve ARGS --port <free>`; returns the process and its base URL once /health is 200.

    Raises RuntimeError if the server exits or does not become healthy in time (it is killed)."""
    port = free_port()
    if log_path is None:
        log_path = tempfile.NamedTemporaryFile(prefix="tiered-serve-", suffix=".log", delete=False).name
    with open(log_path, "wb") as log:
        proc = ServerProcess(
            [sys.executable, "-m", "tiered", "serve", *args, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT
        )
    proc.log_path = Path(log_path)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tiered serve exited with code {proc.returncode}:\n{proc.log_tail(2000)}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"tiered serve did not become healthy within {timeout_s:.0f} s; log: {log_path}")


def stop_server(proc: subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    proc.terminate()
    proc.wait(timeout_s)
