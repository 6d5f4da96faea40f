"""Start `tiered serve` in a child process and wait until it serves (tests and benchmarks)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(args: list[str], timeout_s: float = 900) -> tuple[subprocess.Popen[bytes], str]:
    """`tiered serve ARGS --port <free>`; returns the process and its base URL once /health is 200.

    Raises RuntimeError if the server exits or does not become healthy in time (it is killed)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tiered", "serve", *args, "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace")[-2000:] if proc.stderr else ""
            raise RuntimeError(f"tiered serve exited with code {proc.returncode}:\n{err}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"tiered serve did not become healthy within {timeout_s:.0f} s")


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    proc.wait(30)
