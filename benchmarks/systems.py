"""The systems the load benchmarks compare, by name: config overrides of ours, and vLLM's variants.

Apart from the benchmark modules so that `tiered --help` can list them without importing torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from benchmarks.traces import BenchError
from tiered.config import Config

# The Python of the vllm systems unless --vllm-python: the venv `make bench-env` builds (its VLLM_VENV).
DEFAULT_VLLM_PYTHON = "/tmp/vllmenv/bin/python"

# `python -m benchmarks load`: our engine in-process (config overrides), over HTTP, and vLLM.
ENGINE_SYSTEMS: dict[str, list[str]] = {
    "tiered": ["scheduler.policy=calibrated", "cache.suffix=offload"],
    "prefillonly": ["scheduler.policy=calibrated", "cache.suffix=discard"],
    "tiered-onevict": ["scheduler.policy=calibrated", "cache.suffix=offload", "cache.host.write_policy=on-evict"],
    "fcfs": ["scheduler.policy=fcfs", "cache.suffix=offload"],
    "fcfs-discard": ["scheduler.policy=fcfs", "cache.suffix=discard"],  # fcfs's baseline under the same policy
    "lpm": ["scheduler.policy=lpm", "cache.suffix=offload"],
    "spf": ["scheduler.policy=spf", "cache.suffix=offload"],
    "hrrn": ["scheduler.policy=hrrn", "cache.suffix=offload"],
}
HTTP_SYSTEMS = {"tiered-http": ["scheduler.policy=calibrated", "cache.suffix=offload"]}
VLLM_SYSTEMS = {"vllm": True, "vllm-nochunk": False}  # chunked prefill on / off
SYSTEMS = [*ENGINE_SYSTEMS, *HTTP_SYSTEMS, *VLLM_SYSTEMS]

# `python -m benchmarks visits`: `tiered serve` variants and `vllm serve` over HTTP.
VISIT_TIERED_SYSTEMS: dict[str, list[str]] = {
    "tiered": [],
    "tiered-single": ["scheduler.max_batch_tokens=0"],
    "tiered-fcfs": ["scheduler.policy=fcfs"],  # the same batches, heads in arrival order
    "tiered-bf16": ["model.dtype=bfloat16"],  # bf16 compute forced, whatever the CPU (model.dtype: auto's baseline)
    "tiered-kv32": ["cache.kv_dtype=float32"],  # KV tiers in fp32 under fp32 compute: half the tokens per byte
    # the same config served from another checkout (--base-tree): a change measured against its base
    "tiered-base": [],
}
BASE_SYSTEM = "tiered-base"


@dataclass(slots=True, frozen=True)
class PeerSetup:
    """How a vLLM system of `bench visits` starts beyond vLLM's defaults (compiled, its own step budget)."""

    # KV memory: "total" = the RAM our device and host tiers hold together (on a CPU the same DRAM),
    # "device" = our device tier only (the GPU analogue: there the host tier is cheaper memory),
    # "working-set" = enough for every prompt of the trace at once (nothing is evicted).
    kv: Literal["total", "device", "working-set"] = "total"
    eager: bool = False  # --enforce-eager: no torch.compile
    # LMCache's server beside vLLM with our tiers: L1 = our host tier's memory, L2 = a folder beside our
    # disk tier of its size, chunk = our KV block (`kv` is then "device": vLLM's own KV is our device tier).
    lmcache: bool = False


VISIT_VLLM_SYSTEMS: dict[str, PeerSetup] = {
    "vllm": PeerSetup(),
    "vllm-devkv": PeerSetup(kv="device"),
    "vllm-eager": PeerSetup(eager=True),
    "vllm-full": PeerSetup(kv="working-set"),
    "vllm-lmcache": PeerSetup(kv="device", lmcache=True),
}
VISIT_SYSTEMS = [*VISIT_TIERED_SYSTEMS, *VISIT_VLLM_SYSTEMS]
LORA_SYSTEM = re.compile(r"^(tiered|vllm)-lora([1-9][0-9]*)$")  # K adapters, one per user (u mod K)


def check_vllm_sizing(cfg: Config, python: str | None) -> None:
    """What a run with vllm systems needs, checked before anything starts (BenchError naming it)."""
    check_vllm_python(python)
    if cfg.engine.memory_budget_bytes:
        raise BenchError(
            "vLLM's KV memory is sized from cache.device_tier_bytes (and the host tier's): set "
            "engine.memory_budget_bytes=0 so our device tier has that size too"
        )


def check_vllm_python(python: str | None) -> str:
    """The Python that runs `vllm serve` for the vllm systems; a BenchError that says how to get one."""
    if not python:
        raise BenchError(
            f"the vllm systems need --vllm-python (a Python with vLLM; `make bench-env` builds {DEFAULT_VLLM_PYTHON})"
        )
    if not Path(python).exists():
        raise BenchError(
            f"--vllm-python {python} does not exist: run `make bench-env` (it builds "
            f"{DEFAULT_VLLM_PYTHON}) or pass a Python with vLLM"
        )
    return python


# `python -m benchmarks mixed`: `tiered serve` by how its prefills yield, and `vllm serve` by its chunk size.
MIXED_TIERED_SYSTEMS: dict[str, list[str]] = {
    # SLOWeave: pieces sized so urgent waiting requests meet their deadlines; calls predicted to
    # miss theirs refused at once (429, scheduler.late: shed, the default)
    "tiered": ["scheduler.pieces=deadline"],
    "tiered-never": ["scheduler.pieces=never"],  # every prefill in one pass
    # deadline pieces, calls predicted to miss served late, behind those that can be in time
    "tiered-serve-late": ["scheduler.pieces=deadline", "scheduler.late=serve"],
    # ... and keeping their place in the policy's order
    "tiered-in-order": ["scheduler.pieces=deadline", "scheduler.late=serve", "scheduler.defer_late=false"],
    # `tiered` served from another checkout (--base-tree): a change measured against its base
    BASE_SYSTEM: ["scheduler.pieces=deadline"],
}
MIXED_FIXED_SYSTEM = re.compile(r"^tiered-fixed([1-9][0-9]*)$")  # pieces of N tokens, always (chunked prefill's way)
# chunked prefill, N tokens a step; -capM: a long prefill takes at most M of them while others wait
# -adaptive: the cap floored at a fair share of the step budget (--long-prefill-token-threshold-adaptive).
# vLLM 0.32's V1 scheduler has no --max-num-partial-prefills: the cap is its one knob for a long prefill.
MIXED_VLLM_SYSTEM = re.compile(r"^vllm-(priority-)?chunk([1-9][0-9]*)(?:-cap([1-9][0-9]*)(-adaptive)?)?$")
MIXED_SYSTEM_FORMS = [
    *MIXED_TIERED_SYSTEMS,
    "tiered-fixedN",
    "vllm-chunkN",
    "vllm-priority-chunkN",
    "vllm-[priority-]chunkN-capM[-adaptive]",
]


@dataclass(slots=True, frozen=True)
class MixedSystem:
    """One system of `python -m benchmarks mixed`, parsed from its name."""

    name: str
    overrides: tuple[str, ...] = ()  # ours: config overrides (`scheduler.pieces` ...)
    vllm_step_tokens: int = 0  # vLLM: --max-num-batched-tokens (chunked prefill); 0: the system is ours
    priority: bool = False  # vLLM: --scheduling-policy priority, short calls sent with a better `priority`
    vllm_long_prefill_cap: int = 0  # vLLM: --long-prefill-token-threshold (0: none, vLLM's default)
    vllm_adaptive_cap: bool = False  # vLLM: --long-prefill-token-threshold-adaptive

    @property
    def is_vllm(self) -> bool:
        return self.vllm_step_tokens > 0

    @property
    def vllm_args(self) -> list[str]:
        """`vllm serve` options beyond VLLMServer's own."""
        policy = ["--scheduling-policy", "priority"] if self.priority else []
        cap = ["--long-prefill-token-threshold", str(self.vllm_long_prefill_cap)] if self.vllm_long_prefill_cap else []
        adaptive = ["--long-prefill-token-threshold-adaptive"] if self.vllm_adaptive_cap else []
        return policy + cap + adaptive


def mixed_system(name: str) -> MixedSystem | None:
    """The system a `python -m benchmarks mixed` name stands for; None for a name that is none of them."""
    if name in MIXED_TIERED_SYSTEMS:
        return MixedSystem(name, tuple(MIXED_TIERED_SYSTEMS[name]))
    if m := MIXED_FIXED_SYSTEM.match(name):
        return MixedSystem(name, ("scheduler.pieces=fixed", f"scheduler.piece_tokens={m.group(1)}"))
    if m := MIXED_VLLM_SYSTEM.match(name):
        return MixedSystem(
            name,
            vllm_step_tokens=int(m.group(2)),
            priority=bool(m.group(1)),
            vllm_long_prefill_cap=int(m.group(3) or 0),
            vllm_adaptive_cap=bool(m.group(4)),
        )
    return None
