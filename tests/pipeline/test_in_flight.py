"""Batches in the pipe at once (`engine.pipeline_batches_in_flight`, default stages + 1): the engine
plans the next batch while the stages still compute the one before, from the blocks that batch
will have written (indexed when it is sent; every stage takes batches in order). Answers and hit
splits equal the one-process engine's; a stage that stops answering (SIGSTOP: alive, stuck) fails
every batch in the pipe with a 503 after `engine.pipeline_timeout_s`, each request answered once."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_stages import PARAMS, _assert_equal, _cfg, _prompts, _run

from tiered.api.engine_process import _response
from tiered.engine import Engine
from tiered.engine.pipeline import PipelineRunner

SMALL_BATCHES = "scheduler.max_batch_tokens=64"  # a 300-token prefix's posts go in batches of 1-2


@pytest.fixture(scope="module")
def engines(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, Engine]]:
    jct = tmp_path_factory.mktemp("jct")
    one = Engine(_cfg(tiny_dir, jct, SMALL_BATCHES))
    two = Engine(
        _cfg(tiny_dir, jct, SMALL_BATCHES, "engine.pipeline_stages=2", "engine.threads_per_stage=1"), jct_model=one.jct
    )
    yield one, two
    two.close()
    one.close()


def _count_in_flight_at_submit(runner: PipelineRunner) -> list[int]:
    """Batches already in the pipe each time one is submitted (recorded until the test ends)."""
    seen: list[int] = []
    submit = runner.submit

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(runner._in_flight)
        return submit(*args, **kwargs)

    runner.submit = counting  # type: ignore[method-assign]
    return seen


def test_the_next_batch_is_planned_from_the_blocks_the_batch_in_the_pipe_computes(
    engines: tuple[Engine, Engine],
) -> None:
    one, two = engines
    runner = two.runner
    assert isinstance(runner, PipelineRunner) and runner.max_in_flight == 3  # the default: stages + 1
    seen = _count_in_flight_at_submit(runner)
    try:
        prompts = _prompts(31, 6)
        ref, got = _run(one, prompts), _run(two, prompts)
    finally:
        del runner.submit  # the class's method again
    assert max(seen) >= 1 and len(seen) >= 3  # batches were sent while others were in the pipe
    # The first prompt computes the prefix; every later one hits it, planned before it was written.
    assert got[0].split.num_device_hit_tokens == 0
    assert all(r.split.num_device_hit_tokens == 288 for r in got[1:])
    _assert_equal(got, ref)  # answers, and the same hits as one process that runs batch after batch
    assert runner.forward_seconds > 0 and len(runner.stats()) == 2


def test_a_stuck_stage_fails_every_batch_in_the_pipe_with_503_once(engines: tuple[Engine, Engine]) -> None:
    one, two = engines
    runner = two.runner
    assert isinstance(runner, PipelineRunner)
    old, timeout = runner.pids, runner.timeout_s
    runner.timeout_s = 3.0
    os.kill(old[1], signal.SIGSTOP)  # alive, never answering
    prompts = _prompts(41, 5)
    try:
        ids = [two.submit(p, PARAMS) for p in prompts]
        results = two.run()
    finally:
        runner.timeout_s = timeout
        try:
            os.kill(old[1], signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert sorted(r.request_id for r in results) == sorted(ids)  # each answered once
    failed = [r for r in results if r.error is not None]
    assert len(failed) >= 2  # the two batches in the pipe (each of 1-2 requests), and nothing else failed
    assert all(r.unavailable and "no answer in 3 s (engine.pipeline_timeout_s)" in (r.error or "") for r in failed)
    assert {_response(r).error_status for r in failed} == {503}
    assert set(runner.pids).isdisjoint(old) and len(runner.pids) == 2 and runner.num_restarts >= 1
    by_id = {r.request_id: r for r in results}
    served = [i for i, rid in enumerate(ids) if by_id[rid].error is None]  # after the restart
    ref = _run(one, prompts)
    for i in served:
        assert max(abs(by_id[ids[i]].logprobs[t] - ref[i].logprobs[t]) for t in ref[i].logprobs) < 1e-4
    assert two.tiers.device_tier.stats().num_pinned_blocks == 0  # the lost batches' pins went
    prompts = _prompts(42, 4)
    _assert_equal(_run(two, prompts), _run(one, prompts))  # served again, hits and all
