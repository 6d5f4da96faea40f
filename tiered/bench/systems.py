"""The systems the load benchmarks compare, by name: config overrides of ours, and vLLM's variants.

Apart from the benchmark modules so that `tiered --help` can list them without importing torch.
"""

from __future__ import annotations

import re
from pathlib import Path

from tiered.bench.traces import BenchError

# The Python of the vllm systems unless --vllm-python: the venv `make bench-env` builds (its VLLM_VENV).
DEFAULT_VLLM_PYTHON = "/tmp/vllmenv/bin/python"

# `tiered bench load`: our engine in-process (config overrides), over HTTP, and vLLM.
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

# `tiered bench visits`: `tiered serve` variants and `vllm serve` over HTTP.
VISIT_TIERED_SYSTEMS: dict[str, list[str]] = {
    "tiered": [],
    "tiered-single": ["scheduler.max_batch_tokens=0"],
    "tiered-fcfs": ["scheduler.policy=fcfs"],  # the same batches, heads in arrival order
    "tiered-bf16": ["model.dtype=bfloat16"],  # bf16 compute forced, whatever the CPU (model.dtype: auto's baseline)
    "tiered-kv32": ["cache.kv_dtype=float32"],  # KV tiers in fp32 under fp32 compute: half the tokens per byte
}
VISIT_VLLM_SYSTEMS = ("vllm", "vllm-full")
VISIT_SYSTEMS = [*VISIT_TIERED_SYSTEMS, *VISIT_VLLM_SYSTEMS]
LORA_SYSTEM = re.compile(r"^(tiered|vllm)-lora([1-9][0-9]*)$")  # K adapters, one per user (u mod K)


def check_vllm_python(python: str | None) -> str:
    """The Python that runs `vllm serve` for the vllm systems; a BenchError that says how to get one."""
    if not python:
        raise BenchError(f"the vllm systems need --vllm-python (a Python with vLLM; `make bench-env` builds "
                         f"{DEFAULT_VLLM_PYTHON})")  # fmt: skip
    if not Path(python).exists():
        raise BenchError(f"--vllm-python {python} does not exist: run `make bench-env` (it builds "
                         f"{DEFAULT_VLLM_PYTHON}) or pass a Python with vLLM")  # fmt: skip
    return python
