"""The peer's host tier: LMCache's multi-process server beside `vllm serve` (`vllm-lmcache`).

On a CPU this is the one way vLLM offloads KV: vLLM's own `--kv-offloading-size` refuses a CPU
device, and the in-process `LMCacheConnectorV1` finds no CPU connector and silently recomputes.
The server runs in the vLLM venv (`make bench-env` installs LMCache there) with the same tiers as
ours: its L1 is our host tier's memory, its L2 (`fs`) a folder on the file system of our disk
tier, its chunk our KV block. vLLM reaches it through `LMCacheMPConnector` (engine-driven
transfers). Its counters come from its HTTP port's `/metrics`: hits per tier, stores dropped for
want of L1 memory, L2 stores that failed.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmarks.launch import free_port, prometheus_totals, start_session, stop_session

# Counters read per run (after minus before), summed over their labels.
COUNTERS = (
    "lmcache_mp_lookup_hit_tokens_total",
    "lmcache_mp_lookup_hit_l1_tokens_total",
    "lmcache_mp_lookup_hit_l2_tokens_total",
    "lmcache_mp_l1_allocation_failure_chunks_total",
    "lmcache_mp_l2_store_submitted_objects_chunks_total",
    "lmcache_mp_l2_store_completed_objects_chunks_total",
)
# The words vLLM logs when its LMCache connector cannot move KV on this device and recomputes instead.
NO_CONNECTOR = "No supported cpu connector found"


@dataclass(slots=True, frozen=True)
class LMCacheTiers:
    """The peer's LMCache tiers, sized as ours."""

    l1_bytes: int  # our host tier's memory
    chunk_tokens: int  # our KV block
    l2_folder: Path | None  # on our disk tier's file system; None: no disk tier
    l2_bytes: int = 0  # our disk tier's size (recorded; the `fs` adapter does not evict)


def kv_transfer_config(port: int) -> str:
    """vLLM's `--kv-transfer-config` for the LMCache server on `port`."""
    return json.dumps(
        {
            "kv_connector": "LMCacheMPConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "lmcache.mp.host": "tcp://127.0.0.1",
                "lmcache.mp.port": port,
                "lmcache.mp.mp_transfer_mode": "engine_driven",
            },
        }
    )


class LMCacheServer:
    """`lmcache server` on loopback, in the vLLM venv; started before vLLM, stopped after it."""

    def __init__(self, python: str, tiers: LMCacheTiers) -> None:
        self.tiers = tiers
        self.port, self.http_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.http_port}"
        l2 = (
            ["--l2-adapter", json.dumps({"type": "fs", "base_path": str(tiers.l2_folder)})]
            if tiers.l2_folder is not None
            else []
        )
        self.args = [
            str(Path(python).parent / "lmcache"),
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--http-host",
            "127.0.0.1",
            "--http-port",
            str(self.http_port),
            "--chunk-size",
            str(tiers.chunk_tokens),
            "--eviction-policy",
            "LRU",
            "--supported-transfer-mode",
            "engine_driven",
            "--l1-size-gb",
            f"{tiers.l1_bytes / 2**30:.6f}",
            *l2,
        ]
        self.env = {"LMCACHE_DISABLE_BANNER": "1", "LMCACHE_TRACK_USAGE": "false"}  # no usage report leaves the machine
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, log_path: Path, preexec: Callable[[], None] | None = None, timeout_s: float = 120) -> None:
        """Start it (its L2 folder emptied first: every server starts with a cold disk) and wait
        until `/healthcheck` answers."""
        if not Path(self.args[0]).exists():
            raise RuntimeError(f"{self.args[0]} does not exist: `make bench-env` installs LMCache in the vLLM venv")
        if self.tiers.l2_folder is not None:
            shutil.rmtree(self.tiers.l2_folder, ignore_errors=True)
            self.tiers.l2_folder.mkdir(parents=True)
        self._log = log_path.open("wb")
        self.proc = start_session(self.args, self._log, self.env, preexec)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"lmcache server exited with code {self.proc.returncode}; see {log_path}")
            if self.healthy():
                return
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"lmcache server did not become healthy within {timeout_s:.0f} s; see {log_path}")

    def healthy(self) -> bool:
        """Its `/healthcheck` answers 200."""
        try:
            return httpx.get(f"{self.url}/healthcheck", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    def counters(self) -> dict[str, float]:
        """COUNTERS now, each summed over its labels (absent ones 0)."""
        return dict.fromkeys(COUNTERS, 0.0) | prometheus_totals(self.url, lambda name: name in COUNTERS)

    def settled_counters(self, timeout_s: float = 60) -> dict[str, float]:
        """COUNTERS once the L2 stores submitted so far have completed (or after `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while True:
            c = self.counters()
            done = c["lmcache_mp_l2_store_completed_objects_chunks_total"]
            if done >= c["lmcache_mp_l2_store_submitted_objects_chunks_total"] or time.monotonic() > deadline:
                return c
            time.sleep(0.5)

    def launch_record(self) -> dict[str, Any]:
        """How it was started, for the run's JSON."""
        return {"argv": self.args, "env": self.env, "l2_bytes": self.tiers.l2_bytes}

    def stop(self) -> None:
        """Stop it and its children; its L2 folder is left for the run's disk figures."""
        if self.proc is not None:
            stop_session(self.proc, timeout_s=30)
            self._log.close()


def run_faults(delta: dict[str, float], vllm_log: Path) -> list[str]:
    """What makes a peer run unfit to report: stores it dropped, L2 stores that did not complete,
    or a connector that fell back to recomputing. `delta` is COUNTERS over the run."""
    faults = []
    dropped = delta.get("lmcache_mp_l1_allocation_failure_chunks_total", 0.0)
    if dropped:
        faults.append(f"LMCache dropped {dropped:.0f} chunk stores (L1 allocation failures)")
    submitted = delta.get("lmcache_mp_l2_store_submitted_objects_chunks_total", 0.0)
    completed = delta.get("lmcache_mp_l2_store_completed_objects_chunks_total", 0.0)
    if submitted > completed:
        faults.append(f"LMCache completed {completed:.0f} of {submitted:.0f} L2 chunk stores")
    if vllm_log.exists() and NO_CONNECTOR in vllm_log.read_text(errors="replace"):
        faults.append(f"vLLM logged {NO_CONNECTOR!r}: it recomputed instead of loading")
    return faults
