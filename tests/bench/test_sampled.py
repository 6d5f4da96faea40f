"""Sorting py-spy samples into the parts of a server's time (benchmarks/sampled.py), on hand-made stacks."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.sampled import IDLE, _part, breakdown, main_thread, table

LOOP = "serve_engine (tiered/api/engine_process.py:120)"
STEP = "step (tiered/engine/core.py:134)"
FWD = "forward_batch (tiered/hybrid/forward.py:200)"


@pytest.mark.parametrize(
    ("frames", "part"),
    [
        ([LOOP, STEP, FWD, "mlp_step_ (tiered/hybrid/model.py:90)", "dnnl_sgemm (libtorch_cpu.so)"], "forward: linear"),
        (
            [LOOP, STEP, FWD, "attend_ (tiered/hybrid/attention/native.py:150)", "attend_avx512 (attend.so)"],
            "attention",
        ),
        ([LOOP, STEP, FWD, "rms_norm (tiered/hybrid/model.py:40)", "at::native::mul (libtorch_cpu.so)"], "norms"),
        ([LOOP, STEP, FWD, "dnnl_sgemm (libtorch_cpu.so)", "futex_wait (libc.so.6)"], "forward: linear"),
        ([LOOP, "recv (zmq/sugar/socket.py:10)", "zmq_poll (libzmq.so)", "epoll_wait (libc.so.6)"], IDLE),
        ([LOOP, STEP, "schedule (tiered/scheduler/scheduler.py:360)"], "scheduling"),
        ([LOOP, "send (zmq/sugar/socket.py:20)", "zmq_msg_send (libzmq.so)"], "ZMQ"),
        ([LOOP, STEP, "put (lmcache/v1/storage_backend/local_cpu_backend.py:5)"], "host tier"),
        (["something (elsewhere.py:1)"], "other"),
    ],
)
def test_a_sample_goes_to_the_part_of_its_innermost_named_frame(frames: list[str], part: str) -> None:
    assert _part(frames).startswith(part) or part in _part(frames)


def test_each_thread_s_shares_sum_to_one_and_the_busy_thread_is_the_main_one(tmp_path: Path) -> None:
    raw = tmp_path / "engine.txt"
    gemm = f"{LOOP};{STEP};{FWD};dnnl_sgemm (libtorch_cpu.so)"
    wait = f"{LOOP};recv (zmq/sugar/socket.py:10);epoll_wait (libc.so.6)"
    store = "run (threading.py:1);put (lmcache/v1/x.py:3);futex_wait (libc.so.6)"
    raw.write_text(
        f"thread (0x1);{gemm} 75\nthread (0x1);{wait} 25\nthread (0x2);{store} 10\n"
        "thread (0x2);run (threading.py:1);wait (threading.py:2);futex_wait (libc.so.6) 90\n"
    )
    threads = breakdown(raw)
    main = threads["thread (0x1)"]
    assert main["samples"] == 100 and main["forward: linear (GEMM)"] == pytest.approx(0.75) and main[IDLE] == 0.25
    assert threads["thread (0x2)"]["host tier: loads and stores (LMCache)"] == pytest.approx(0.1)
    assert main_thread(threads) == "thread (0x1)"
    rows = table("engine", threads)
    assert rows[0] == "| engine: forward: linear (GEMM) | 75.0% |" and any("busy | 10.0%" in r for r in rows)
