"""The servers the HTTP benchmarks drive (`bench visits`, `bench mixed`, `bench alone`): `tiered
serve` with a config written per system, or `vllm serve`, each warmed up alike before it is
yielded, each in its memory group where the run names one; and a wait until no server computes."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import yaml

from benchmarks.launch import start_server, stop_server
from benchmarks.load import WARM_UP, Call, HttpOptions, run_http
from benchmarks.memory_group import MemoryGroup
from benchmarks.report import commit_of
from benchmarks.vllm import VLLMServer
from tiered.config import Config, write_config
from tiered.config.yaml_io import config_to_dict

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Served:
    """A started, warmed-up server of one system."""

    system: str
    url: str
    pid: int
    launch: dict[str, Any]  # argv, env (the variables the harness set), startup_seconds
    vllm: VLLMServer | None = None  # the peer's handle (its prefix-cache reset), None for ours
    group: MemoryGroup | None = None  # the memory cgroup its processes run in

    @property
    def pids(self) -> list[int]:
        """The roots of its process trees: the server, and LMCache's server beside the peer's."""
        lmcache = self.vllm.lmcache if self.vllm is not None else None
        return [self.pid, *([lmcache.proc.pid] if lmcache is not None and lmcache.proc is not None else [])]


def _warm_up(url: str, calls: Sequence[Call], concurrency: int | None) -> None:
    """The same warm-up for every system: one short call, then `calls` (e.g. a trace's first visits)."""
    run_http(url, "model", [WARM_UP], [0.0], HttpOptions(cache_salt="warm-up"))
    if calls:
        run_http(url, "model", list(calls), [0.0] * len(calls), HttpOptions("warm-up", concurrency, "warm-up"))


def write_changed_config(cfg: Config, path: Path) -> Path:
    """Write only the values of `cfg` that differ from the defaults: what another checkout (`tiered-base`)
    reads, which may not know a key added since. It reads back to `cfg` where the defaults agree."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(_changed(config_to_dict(cfg), config_to_dict(Config())), sort_keys=False))
    return path


def _changed(values: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """The entries of a config's dict (nested by section) whose values differ from `defaults`."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        default = defaults.get(key)
        if isinstance(value, dict) and isinstance(default, dict):
            if inner := _changed(value, default):
                out[key] = inner
        elif key not in defaults or value != default:
            out[key] = value
    return out


@contextmanager
def serve_tiered(
    cfg: Config,
    system: str,
    out_dir: Path,
    warm_up: Sequence[Call] = (),
    concurrency: int | None = None,
    group: MemoryGroup | None = None,
    tree: Path | None = None,
) -> Iterator[Served]:
    """`tiered serve` with `cfg` (written to OUT_DIR/SYSTEM.yaml, its log beside it), served as
    `model`, in `group` where one is given, warmed up; stops it on exit. `tree`: serve the
    checkout there instead of this one (its commit goes to the launch record)."""
    path = out_dir / f"{system}.yaml"
    path = (write_config(cfg, path) if tree is None else write_changed_config(cfg, path)).resolve()
    began = time.perf_counter()
    proc, url = start_server(
        ["--config", str(path), "--served-model-name", "model"],
        log_path=out_dir / f"{system}.log",
        preexec=group.preexec if group else None,
        cwd=tree,
    )
    argv = [str(a) for a in proc.args] if isinstance(proc.args, list) else [str(proc.args)]
    launch: dict[str, object] = {"argv": argv, "env": {}, "startup_seconds": time.perf_counter() - began}
    if tree is not None:
        launch |= {"cwd": str(tree), "commit": commit_of(tree)}
    try:
        _warm_up(url, warm_up, concurrency)
        yield Served(system, url, proc.pid, launch, group=group)
    finally:
        stop_server(proc)


@contextmanager
def serve_vllm(
    vllm: VLLMServer,
    system: str,
    out_dir: Path,
    warm_up: Sequence[Call] = (),
    concurrency: int | None = None,
    group: MemoryGroup | None = None,
) -> Iterator[Served]:
    """Start `vllm` (its log at OUT_DIR/SYSTEM.log) in `group` where one is given and warm it up as
    ours; stops it on exit."""
    vllm.start(out_dir / f"{system}.log", preexec=group.preexec if group else None)
    try:
        _warm_up(vllm.url, warm_up, concurrency)
        assert vllm.proc is not None
        yield Served(system, vllm.url, vllm.proc.pid, vllm.launch_record(), vllm, group)
    finally:
        vllm.stop()


def wait_quiet(pids: Sequence[int], cpu_share: float = 0.1, settle_s: float = 1.0, timeout_s: float = 120) -> float:
    """Wait until the servers `pids` (with their children) use under `cpu_share` of one core over
    `settle_s`: a run never starts while another server still stores or compiles. Returns the wait."""
    began = time.perf_counter()
    procs = []
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs += [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue

    def cpu_seconds() -> float:
        total = 0.0
        for p in procs:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        return total

    while time.perf_counter() - began < timeout_s:
        before = cpu_seconds()
        time.sleep(settle_s)
        if cpu_seconds() - before < cpu_share * settle_s:
            break
    waited = time.perf_counter() - began
    if waited > 3 * settle_s:
        log.info("waited %.1f s for the servers to be idle before the next run", waited)
    return waited
