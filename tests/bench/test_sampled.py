"""Sorting py-spy samples into the parts of a server's time (benchmarks/sampled.py), on hand-made stacks."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.sampled import IDLE, OTHER, RATE, _part, breakdown, main_thread, table

LOOP = "serve_engine (tiered/api/engine_process.py:120)"
STEP = "step (tiered/engine/core.py:134)"
FWD = "forward_batch (tiered/hybrid/forward.py:200)"


@pytest.mark.parametrize(
    ("frames", "part"),
    [
        (
            [LOOP, STEP, FWD, "mlp_step_ (tiered/hybrid/model.py:204)", "_linear_into (tiered/hybrid/model.py:147)"],
            "linear",
        ),
        ([LOOP, STEP, FWD, "o_proj_step_ (tiered/hybrid/model.py:194)", "_linear_accumulate_ (x:153)"], "linear"),
        (
            [LOOP, STEP, FWD, "attend_ (tiered/hybrid/attention/native.py:150)", "__call__ (torch/_ops.py:1)"],
            "attention",
        ),
        ([LOOP, STEP, FWD, "mlp_step_ (tiered/hybrid/model.py:208)", "silu (torch/nn/functional.py:2)"], "norms"),
        ([LOOP, STEP, "schedule (tiered/scheduler/scheduler.py:360)"], "scheduling"),
        ([LOOP, STEP, "execute (tiered/engine/executor.py:92)", "plan_batch (tiered/engine/runner.py:90)"], "planning"),
        ([LOOP, "send (zmq/sugar/socket.py:20)"], "ZMQ"),
        ([LOOP, STEP, "put (lmcache/v1/storage_backend/local_cpu_backend.py:5)"], "host tier"),
        (["something (elsewhere.py:1)"], OTHER),
    ],
)
def test_a_sample_goes_to_the_part_of_its_innermost_named_frame(frames: list[str], part: str) -> None:
    assert part in _part(frames)


def test_shares_are_of_the_wall_time_and_the_rest_is_idle(tmp_path: Path) -> None:
    raw = tmp_path / "engine.txt"
    gemm = f"{LOOP};{STEP};{FWD};_linear_into (tiered/hybrid/model.py:147)"
    store = "run (threading.py:1);put (lmcache/v1/x.py:3)"
    seconds = 10.0  # the main thread ran 75% of it, the store thread 10%
    raw.write_text(f"thread (1): MainThread;{gemm} {int(0.75 * seconds * RATE)}\nthread (2): store;{store} {RATE}\n")
    threads = breakdown(raw, seconds)
    main = threads["thread (1): MainThread"]
    assert main["forward: linear (GEMM)"] == pytest.approx(0.75, abs=0.01) and main[IDLE] == pytest.approx(
        0.25, abs=0.01
    )
    assert threads["thread (2): store"]["host tier: loads and stores (LMCache)"] == pytest.approx(0.1)
    assert main_thread(threads) == "thread (1): MainThread"
    rows = table("engine", threads)
    assert rows[0].startswith("| engine: forward: linear (GEMM) | 7") and any("store: busy" in r for r in rows)
