"""Scheduling policies on real tiers: the paper's Figure-5 case, starvation, prefetch overlap."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from tiered.config import load_config
from tiered.engine import Engine
from tiered.engine.results import refused_results
from tiered.request.score import RequestOptions, ScoreParams
from tiered.request.tokens import TierRequest
from tiered.scheduler.jct import JCTModel
from tiered.scheduler.pieces import PiecePolicy
from tiered.scheduler.scheduler import Scheduler
from tiered.scheduler.step import PieceStats, Refused, StepLimits, StepOutput

BT = 16
MS_PER_MISSED_TOKEN = JCTModel([0.0, 1e-3, 0.0, 0.0, 0.0])  # a job costs 1 ms per computed token


def _engine(tiny_dir: Path, tmp_path: Path, *overrides: str, jct: JCTModel = MS_PER_MISSED_TOKEN) -> Engine:
    cfg = load_config(
        None,
        [
            f"model.path={tiny_dir}",
            f"cache.block_tokens={BT}",
            f"scheduler.profile_cache_dir={tmp_path / 'jct'}",
            *overrides,
        ],
    )
    return Engine(cfg, jct_model=JCTModel(list(jct.coefficients)))


def _kv_bytes_per_block(engine: Engine) -> int:
    return BT * engine.model.args.kv_bytes_per_token(torch.float32)


def _figure5(tiny_dir: Path, tmp_path: Path, policy: str) -> int:
    """A < C < B < D in length; A, D share prefix P1 and B, C share P2; the device tier holds one prefix.

    The paper's setting: one request per forward (batching off), so only the order matters."""
    g = torch.Generator().manual_seed(5)
    p1, p2 = (torch.randint(0, 1300, (64,), generator=g) for _ in range(2))
    tail = {n: torch.randint(0, 1300, (n,), generator=g) for n in (16, 32, 48, 64)}
    a, c, b, d = (torch.cat(x) for x in ((p1, tail[16]), (p2, tail[32]), (p2, tail[48]), (p1, tail[64])))
    probe = _engine(tiny_dir, tmp_path, "cache.suffix=discard", "cache.device_tier_bytes=0")
    block_bytes = _kv_bytes_per_block(probe)
    probe.close()
    engine = _engine(
        tiny_dir,
        tmp_path,
        "cache.suffix=discard",
        f"cache.device_tier_bytes={4 * block_bytes}",
        f"scheduler.policy={policy}",
        "scheduler.fairness=0",
        "scheduler.max_batch_tokens=0",
    )
    for ids in (a, b, c, d):  # all arrive at once, in this order
        engine.submit(ids)
    results = engine.run()
    engine.close()
    assert sorted(r.num_tokens for r in results) == [80, 96, 112, 128]
    return sum(1 for r in results if r.split.num_device_hit_tokens > 0)


@pytest.mark.parametrize(("policy", "hits"), [("fcfs", 1), ("srjf", 1), ("calibrated", 2)])
def test_figure5_calibration_gets_one_more_prefix_hit(tiny_dir: Path, tmp_path: Path, policy: str, hits: int) -> None:
    assert _figure5(tiny_dir, tmp_path, policy) == hits


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("fairness", [0.0, 0.5])
def test_fairness_bounds_the_wait_of_a_long_request(tiny_dir: Path, tmp_path: Path, fairness: float) -> None:
    """A steady stream of short jobs: with λ = 0 the long one starves; with λ > 0 it runs by a bound."""
    engine = _engine(tiny_dir, tmp_path, "cache.suffix=discard", "cache.device_tier_bytes=0")
    clock = FakeClock()
    sched = Scheduler("calibrated", fairness, engine.tiers, engine.jct, clock=clock)
    g = torch.Generator().manual_seed(0)
    ids = itertools.count()

    def add(n: int) -> None:
        sched.add(engine.tiers.new_request(f"r{next(ids)}", torch.randint(0, 1300, (n,), generator=g)))

    add(2000)  # the long job: 2 s predicted
    add(100)
    served_at = None
    for _ in range(400):
        add(100)  # 0.1 s jobs keep arriving, one per job run
        decision = sched.pick()
        assert decision is not None
        if decision.waiting.request.token_ids.numel() == 2000:
            served_at = clock.now
            break
        clock.now += decision.predicted_jct
    engine.close()
    if fairness == 0:
        assert served_at is None  # 40 s of short jobs and still waiting
    else:
        # It runs once λ·(its wait) covers its extra predicted time: (2.0 − 0.1) / λ, plus one job.
        assert served_at is not None and served_at <= (2.0 - 0.1) / fairness + 0.1 + 1e-9


def test_prefetch_overlaps_the_host_load_with_another_compute(tiny_dir: Path, tmp_path: Path) -> None:
    engine = _engine(tiny_dir, tmp_path, "scheduler.policy=fcfs", "cache.retention=none")
    g = torch.Generator().manual_seed(1)
    profile = torch.randint(0, 1300, (1024,), generator=g)
    engine.submit(torch.cat([profile, torch.randint(0, 1300, (8,), generator=g)]))
    engine.run()
    engine.tiers.flush()
    engine.tiers.device_tier.clear()  # the profile now lives in the host tier only
    reference = engine.tiers.prepare(engine.tiers.new_request("sync", torch.cat([profile, torch.tensor([7])])))
    assert not engine.tiers.worker.load([reference])
    full_load = reference.load_seconds  # a synchronous lookup and load of the whole prefix
    engine.tiers.abort(reference)
    engine.tiers.device_tier.clear()
    engine.submit(torch.randint(0, 1300, (3000,), generator=g))  # runs first, long enough to hide the load
    late = engine.submit(torch.cat([profile, torch.randint(0, 1300, (8,), generator=g)]))
    results = {r.request_id: r for r in engine.run()}
    engine.close()
    r = results[late]
    assert r.split.num_host_hit_tokens == 1024
    assert r.prefetch_wait_seconds + r.load_seconds < full_load


def test_one_entry_per_waiting_request_and_a_reused_id_is_a_new_request(tiny_dir: Path, tmp_path: Path) -> None:
    """The scheduler's entry carries the request's params and arrival; an id may come back once
    its request left, and the new request is ranked by its own score, never by the heap entry
    the old one left behind (srjf: 1 ms per computed token)."""
    engine = _engine(tiny_dir, tmp_path, "cache.suffix=discard", "cache.device_tier_bytes=0")
    sched = Scheduler("srjf", 0.0, engine.tiers, engine.jct)
    g = torch.Generator().manual_seed(0)

    def req(rid: str, n: int) -> TierRequest:
        return engine.tiers.new_request(rid, torch.randint(0, 1300, (n,), generator=g))

    params = ScoreParams(top_logprobs=3)
    w = sched.add(req("x", 50), arrival=7.0, params=params)
    assert "x" in sched and len(sched) == 1 and w.params is params and w.arrival == 7.0
    with pytest.raises(ValueError, match="already waiting"):
        sched.add(req("x", 60))
    picked = sched.pick()
    assert picked is not None and picked.waiting is w and "x" not in sched
    sched.add(req("y", 300))
    sched.add(req("x", 900))  # the old x's heap entry (0.05 s) may still be in the heap
    order = [d.waiting.request_id for d in iter(sched.pick, None)]
    assert order == ["y", "x"]
    sched.add(req("z", 10))
    assert sched.remove("z") is not None and sched.remove("z") is None and sched.pick() is None
    engine.close()


@pytest.mark.parametrize("policy", ["calibrated", "srjf", "hrrn", "fcfs"])
@pytest.mark.parametrize("defer", [True, False])
def test_requests_past_hope_of_their_deadline_wait_behind_the_others(
    tiny_dir: Path, tmp_path: Path, policy: str, defer: bool
) -> None:
    """With `defer_late`, a request whose predicted time from now ends past its deadline runs after
    every request that can still meet its own and every one without a deadline; fcfs keeps arrival
    order. One that turns hopeless while another runs is deferred too (1 ms per computed token)."""
    engine = _engine(tiny_dir, tmp_path, "cache.suffix=discard", "cache.device_tier_bytes=0")
    clock = FakeClock()
    sched = Scheduler(policy, 0.0, engine.tiers, engine.jct, clock=clock, limits=StepLimits(defer_late=defer))
    g = torch.Generator().manual_seed(3)

    def add(rid: str, n: int, slo: float | None) -> None:
        sched.add(engine.tiers.new_request(rid, torch.randint(0, 1300, (n,), generator=g)), slo_seconds=slo)

    add("first", 300, None)  # 0.3 s, picked before the others arrive
    assert (head := sched.pick()) is not None and head.waiting.request_id == "first"
    add("hopeless", 100, 0.05)  # 0.1 s of work for a 0.05 s objective
    add("turns", 150, 0.2)  # can meet it now, not once 0.1 s more have passed
    add("hopeful", 200, 5.0)
    add("plain", 400, None)
    clock.now = 0.1
    order = [d.waiting.request_id for d in iter(sched.pick, None)]
    engine.close()
    # Every policy here ranks these by length (hrrn: equal waits, the shortest has the highest ratio).
    if defer and policy != "fcfs":
        assert order == ["hopeful", "plain", "hopeless", "turns"]
    else:
        assert order == ["hopeless", "turns", "hopeful", "plain"]


@pytest.mark.parametrize("defer", [True, False])
def test_a_hopeless_request_rides_along_only_where_deferral_is_off(tiny_dir: Path, tmp_path: Path, defer: bool) -> None:
    """A batch's filler that can no longer meet its deadline would run ahead of the hopeful
    requests still waiting: with `defer_late` it stays out of a hopeful head's batch."""
    engine = _engine(tiny_dir, tmp_path, "cache.suffix=discard", "cache.device_tier_bytes=0")
    sched = Scheduler(
        "calibrated", 0.0, engine.tiers, engine.jct, clock=FakeClock(), limits=StepLimits(defer_late=defer)
    )
    g = torch.Generator().manual_seed(4)
    prefix = torch.randint(0, 1300, (64,), generator=g)
    for rid, slo in (("head", 5.0), ("late", 0.01), ("hopeful", 5.0)):
        tail = torch.randint(0, 1300, (40,), generator=g)
        sched.add(engine.tiers.new_request(rid, torch.cat([prefix, tail])), slo_seconds=slo)
    batch = [d.waiting.request_id for d in sched.pick_batch(2048, 1 << 30)]
    engine.close()
    assert sorted(batch) == (["head", "hopeful"] if defer else ["head", "hopeful", "late"])


def _shedding(
    tiny_dir: Path, tmp_path: Path, policy: str, limits: StepLimits, device_blocks: int = 0
) -> tuple[Engine, Scheduler, FakeClock]:
    """A scheduler of its own on an engine's tiers, on a fake clock; no host tier, and a device tier
    of `device_blocks` blocks (what a finished request keeps for a later one)."""
    engine = _engine(tiny_dir, tmp_path, "cache.suffix=discard", "cache.device_tier_bytes=0")
    if device_blocks:
        block_bytes = _kv_bytes_per_block(engine)
        engine.close()
        engine = _engine(
            tiny_dir, tmp_path, "cache.suffix=discard", f"cache.device_tier_bytes={device_blocks * block_bytes}"
        )
    clock = FakeClock()
    return engine, Scheduler(policy, 0.0, engine.tiers, engine.jct, clock=clock, limits=limits), clock


def _tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 1300, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("policy", ["fcfs", "calibrated"])
def test_a_call_that_cannot_make_its_objective_is_refused_when_it_arrives(
    tiny_dir: Path, tmp_path: Path, policy: str
) -> None:
    """With late calls shed, a call whose predicted wait (the work the policy runs before it) plus
    its own time ends past its deadline is refused with a 429 and that wait as Retry-After; the
    wait follows the policy (fcfs: everything queued; calibrated: only what it ranks ahead). A call
    without an objective, or with late calls served, is admitted. 1 ms per computed token."""
    engine, sched, _ = _shedding(tiny_dir, tmp_path, policy, StepLimits(shed_late=True))
    new = engine.tiers.new_request
    sched.add(new("first", _tokens(300, 1)))  # 0.3 s, no objective
    tight = new("tight", _tokens(100, 2))  # 0.1 s of its own within 0.35 s
    if policy == "fcfs":
        assert sched.predicted_wait(sched.add(new("probe", _tokens(50, 3)))) == pytest.approx(0.3)
        sched.remove("probe")
        with pytest.raises(Refused) as refused:
            sched.add(tight, slo_seconds=0.35)
        assert refused.value.status == 429 and refused.value.retry_after == pytest.approx(0.3)
        assert "deadline unreachable" in str(refused.value) and "scheduler.late: shed" in str(refused.value)
        assert "tight" not in sched
    else:  # the shorter call runs first: nothing waits ahead of it
        sched.add(tight, slo_seconds=0.35)
        assert "tight" in sched
    sched.add(new("roomy", _tokens(100, 4)), slo_seconds=0.45)  # 0.3 + 0.1 fits even behind "first"
    sched.add(new("plain", _tokens(900, 5)))  # no objective: never shed
    assert {"roomy", "plain"} <= set(sched._waiting)
    with pytest.raises(Refused, match="objective unmeetable: alone this call is predicted to take 0.10 s") as refused:
        sched.add(new("hopeless", _tokens(100, 6)), slo_seconds=0.05)  # its own 0.1 s is over 0.05 s
    assert refused.value.reason == "unmeetable" and refused.value.retry_after is None  # no warm-up here
    serve = _shedding(tiny_dir, tmp_path, policy, StepLimits())[1]
    serve.add(serve.tiers.new_request("first", _tokens(300, 1)))
    serve.add(serve.tiers.new_request("hopeless", _tokens(100, 6)), slo_seconds=0.05)
    assert "hopeless" in serve
    engine.close()


def test_a_call_over_its_objective_alone_is_refused_and_its_prefix_warmed_behind_every_call(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """A call whose own predicted time exceeds its objective, however idle the machine, is refused
    as unmeetable (429), and its prompt queued as a warm-up below every call (the Retry-After: when
    it is predicted done); a second call over the same profile is served by that warm-up, not
    given another; with `warm_unmeetable` warm-ups taken the oldest queued one gives its slot up,
    and with all of them running a refusal has no Retry-After; a call that misses even with its
    whole prefix cached is a 400. 1 ms per computed token."""
    limits = StepLimits(shed_late=True, warm_unmeetable=1)
    engine, sched, _ = _shedding(tiny_dir, tmp_path, "calibrated", limits, device_blocks=32)
    new, profile = engine.tiers.new_request, _tokens(4 * BT, 7)

    def refused_for(rid: str, ids: torch.Tensor, slo: float = 0.08) -> Refused:
        with pytest.raises(Refused) as refused:
            sched.add(new(rid, ids), slo_seconds=slo)
        assert refused.value.reason == "unmeetable" and rid not in sched
        return refused.value

    # 104 ms alone, 80 ms allowed; 40 ms with its profile cached
    refused = refused_for("c1", torch.cat([profile, _tokens(40, 10)]))
    assert refused.status == 429 and refused.retry_after == pytest.approx(0.104) and "retry in 0.1 s" in str(refused)
    assert "c1#warm" in sched and sched.warming == {"c1#warm"}
    assert sched.backlog() == 0.0 and sched.backlog(warm_ups=True) == pytest.approx(0.104)  # calls go first
    refused = refused_for("c2", torch.cat([profile, _tokens(40, 11)]))  # the warm-up queued serves it
    assert refused.retry_after == pytest.approx(0.104) and sched.warming == {"c1#warm"}
    sched.add(new("plain", _tokens(300, 14)))  # no objective, arrived later, three times as long
    # a call ranked behind "plain" waits for it, not for the warm-up
    assert sched.predicted_wait(sched.add(new("probe", _tokens(400, 15)), slo_seconds=1.0)) == pytest.approx(0.3)
    sched.remove("probe")
    assert sched.pick().waiting.request_id == "plain"  # a warm-up runs when nothing else waits
    assert sched.pick().waiting.request_id == "c1#warm"
    refused = refused_for("c3", _tokens(104, 12))  # another profile, the one warm-up running
    assert refused.status == 429 and refused.retry_after is None
    assert "no warm-up is free (scheduler.warm_unmeetable: 1)" in str(refused)
    assert sched.finish_warm("c1#warm") and not sched.finish_warm("plain") and not sched.warming
    assert refused_for("c3", _tokens(104, 12)).retry_after == pytest.approx(0.104)
    assert refused_for("c5", _tokens(120, 16)).retry_after == pytest.approx(0.120)  # takes c3's queued slot
    assert sched.warming == {"c5#warm"} and "c3#warm" not in sched
    refused = refused_for("c4", _tokens(104, 13), slo=0.005)  # its last 8 tokens alone take 8 ms
    assert refused.status == 400 and "0.01 s with its prefix cached" in str(refused)
    engine.close()


def test_an_unmeetable_calls_warm_up_is_answered_to_no_one_and_lets_the_next_call_through(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """On an engine: the refused call's warm-up runs, yields no result, and caches the profile, so a
    later call over it is admitted and reads it from the device tier. 1 ms per computed token."""
    engine = _engine(tiny_dir, tmp_path, "scheduler.late=shed", "cache.suffix=discard")
    profile = _tokens(8 * BT, 7)
    with pytest.raises(Refused) as refused:  # 168 ms alone, 100 ms allowed; 40 ms with its profile cached
        engine.submit(torch.cat([profile, _tokens(40, 10)]), options=RequestOptions(slo_ms=100))
    assert refused.value.status == 429 and refused.value.retry_after == pytest.approx(0.168)
    assert engine.num_unfinished == 1 and engine.run() == [] and not engine.scheduler.warming
    rid = engine.submit(torch.cat([profile, _tokens(40, 11)]), options=RequestOptions(slo_ms=100))
    (result,) = engine.run()
    assert result.request_id == rid and result.error is None and result.split.num_device_hit_tokens == 8 * BT
    engine.close()


def test_a_prefix_that_several_waiting_calls_compute_is_counted_once_in_their_wait(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """A visit's posts over one profile: the first computes the 64 shared tokens (4 blocks), the
    others find them cached when they run, so the wait ahead of a new call (and the queue's
    backlog, and the call's own time) count them once: the device tier keeps a profile that waiting
    calls share. Without a tier that keeps it, each counts it. 1 ms per computed token, fcfs."""
    engine, sched, _ = _shedding(tiny_dir, tmp_path, "fcfs", StepLimits(shed_late=True), device_blocks=32)
    new, profile = engine.tiers.new_request, _tokens(4 * BT, 7)
    post = {i: torch.cat([profile, _tokens(40, 10 + i)]) for i in range(4)}
    sched.add(new("p0", post[0]))  # 104 ms: the profile and its post
    sched.add(new("p1", post[1]))  # 40 ms: the profile is cached by the time it runs
    sched.add(new("other", _tokens(104, 20)))  # 104 ms: shares nothing
    assert sched.backlog() == pytest.approx(0.104 + 0.040 + 0.104)
    assert sched.predicted_wait(sched.add(new("probe", _tokens(10, 21)))) == pytest.approx(0.248)
    sched.remove("probe")
    # 0.248 s of wait and 0.040 s of its own fit 0.3 s; counted alone, 0.312 s + 0.104 s would not
    sched.add(new("p2", post[2]), slo_seconds=0.3)
    with pytest.raises(Refused, match=r"0\.29 s and 0\.04 s of its own"):  # 0.288 s ahead now
        sched.add(new("p3", post[3]), slo_seconds=0.3)
    engine.close()
    engine, sched, _ = _shedding(tiny_dir, tmp_path, "fcfs", StepLimits(shed_late=True))  # keeps nothing
    sched.add(engine.tiers.new_request("p0", post[0]))
    sched.add(engine.tiers.new_request("p1", post[1]))
    assert sched.backlog() == pytest.approx(0.208)
    engine.close()


def test_a_waiting_call_finds_the_prefix_of_the_step_before_it_cached(tiny_dir: Path, tmp_path: Path) -> None:
    """The shed at a step, and the admission of a call while its forward runs, count the blocks the
    step computes as cached for the calls that share them: a post whose profile the running step
    computes needs 40 ms of its own after it, not 104. 1 ms per computed token, fcfs."""
    engine, sched, _ = _shedding(tiny_dir, tmp_path, "fcfs", StepLimits(shed_late=True), device_blocks=32)
    new, profile = engine.tiers.new_request, _tokens(4 * BT, 7)
    sched.add(new("p0", torch.cat([profile, _tokens(40, 10)])))  # 104 ms: runs first, alone
    sched.add(new("p1", torch.cat([profile, _tokens(40, 11)])), slo_seconds=0.16)  # 0.104 + 0.040
    sched.add(new("other", _tokens(104, 12)), slo_seconds=0.25)  # 0.144 + 0.104
    step = sched.schedule()
    assert [d.waiting.request_id for d in step.batch] == ["p0"] and step.shed == []
    sched.running(step)
    assert sched.running_until == pytest.approx(0.104)
    # ahead: 0.104 s of the running forward, p1's 0.040 s and other's 0.104 s; its own 0.040 s fits 0.3 s
    sched.add(new("p2", torch.cat([profile, _tokens(40, 13)])), slo_seconds=0.3)
    assert sched.take_unreachable(0.104, sched.running_blocks) == []
    assert [w.request_id for w in sched.take_unreachable(0.104)] == ["p1"]  # the profile counted again
    sched.running(None)
    assert sched.running_until == 0.0 and not sched.running_blocks
    engine.close()


def test_a_call_admitted_for_a_prefix_cached_since_is_not_shed_on_its_arrival_estimate(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """fcfs scores a request once, at arrival: after the request ahead ran and its profile became a
    device hit, the shed estimates a call again before refusing it on the split it arrived with."""
    engine, sched, clock = _shedding(tiny_dir, tmp_path, "fcfs", StepLimits(shed_late=True), device_blocks=32)
    new, profile = engine.tiers.new_request, _tokens(4 * BT, 7)
    sched.add(new("p0", torch.cat([profile, _tokens(40, 10)])))
    sched.add(new("p1", torch.cat([profile, _tokens(40, 11)])), slo_seconds=0.16)  # 0.104 + 0.040
    step = sched.schedule()
    sched.update_from_output(step, StepOutput(finished=step.prepared))  # p0 ran: its profile is cached
    clock.now = 0.104
    step = sched.schedule()  # 0.104 s + its arrival estimate (0.104 s) is past 0.16 s; 0.040 s is not
    assert step.shed == [] and [d.waiting.request_id for d in step.batch] == ["p1"]
    assert step.batch[0].waiting.split.num_miss_tokens == 104  # the split it was scored with, kept
    engine.close()


def test_admission_control_refuses_any_call_over_the_predicted_wait_cap(tiny_dir: Path, tmp_path: Path) -> None:
    """`max_predicted_wait`: a call whose predicted wait is over the cap is refused with a 503,
    objective or not; one the policy runs ahead of the queued work is not."""
    engine, sched, _ = _shedding(tiny_dir, tmp_path, "calibrated", StepLimits(max_predicted_wait=0.25))
    new = engine.tiers.new_request
    sched.add(new("long", _tokens(300, 1)))
    with pytest.raises(Refused) as refused:
        sched.add(new("longer", _tokens(400, 2)))  # 0.3 s of shorter work ranks ahead of it
    assert refused.value.status == 503 and refused.value.retry_after == pytest.approx(0.3)
    assert "scheduler.max_predicted_wait_s" in str(refused.value)
    sched.add(new("short", _tokens(50, 3)))  # ranks first: no wait
    assert "short" in sched and "longer" not in sched and sched.backlog() == pytest.approx(0.35)
    engine.close()


def test_a_waiting_call_is_shed_before_the_step_that_would_make_it_late(tiny_dir: Path, tmp_path: Path) -> None:
    """At each step, before its forward: the waiting calls that cannot start once the step's
    predicted time has passed and still meet their deadline are taken out (`Step.shed`, with the
    queue's predicted work as Retry-After); the others, and calls without an objective, wait on.
    Each refusal carries the last moment its prediction had it in time (its delay is timed from it)."""
    engine, sched, clock = _shedding(tiny_dir, tmp_path, "calibrated", StepLimits(shed_late=True))
    new = engine.tiers.new_request
    clock.now = 0.25
    sched.add(new("tight", _tokens(100, 2)), slo_seconds=0.5)  # admitted: nothing waits ahead of it
    clock.now = 0.5
    sched.add(new("roomy", _tokens(100, 3)), slo_seconds=2.0)
    sched.add(new("plain", _tokens(200, 4)))
    sched.add(new("urgent-long", _tokens(800, 1)), priority=-1)  # then 0.8 s that runs first (priority)
    step = sched.schedule()
    assert [d.waiting.request_id for d in step.batch] == ["urgent-long"]
    assert [w.request_id for w in step.shed] == ["tight"]  # 0.8 s + 0.1 s > 0.75 s
    assert step.retry_after == pytest.approx(0.8 + 0.1 + 0.2)  # the step, then what still waits
    assert {"roomy", "plain"} == set(sched._waiting)
    # in time when it was admitted at 0.25 s, and still at 0.5 s before the pick (starting at once)
    assert [r.late_since for r in refused_results(step)] == [0.5]
    clock.now = 1.2
    assert sched.take_unreachable(0.5) == []  # "roomy" still in time once 0.5 s more have passed
    clock.now = 1.3
    assert sched.take_unreachable(0.0, note_in_time=False) == []  # a forward overran: a guess, not noted
    clock.now = 2.45  # "roomy" can no longer start and end by 2.5 s: shed before anything runs
    step = sched.schedule()
    assert [w.request_id for w in step.shed] == ["roomy"] and [d.waiting.request_id for d in step.batch] == ["plain"]
    assert [r.late_since for r in refused_results(step)] == [1.2]
    engine.close()


def test_a_long_request_that_yields_is_not_counted_in_an_urgent_calls_wait(tiny_dir: Path, tmp_path: Path) -> None:
    """With pieces cut by deadlines, a long request ranked ahead of a call with an objective yields
    to it (the call runs before its next piece), so admission does not count the long one's time
    in the call's wait: behind 600 ms ranked ahead (fcfs), a 50 ms call within 0.3 s is admitted,
    and the next step runs it, not a piece cut to spend its slack.
    Without pieces the call is refused; so it is once the long one's bounded delay is spent with
    no deadline of its own to leave room, and by the predicted-wait cap. A call that would end
    behind the long one's whole rest within its planned end (half its slack waited) lets it run
    that rest first: the long one counts in its wait then. 1 ms per computed token."""
    limits = StepLimits(max_batch_tokens=256, shed_late=True)
    engine, plain, clock = _shedding(tiny_dir, tmp_path, "fcfs", limits, device_blocks=64)
    new = engine.tiers.new_request
    plain.add(new("long", _tokens(600, 1)))
    with pytest.raises(Refused, match=r"wait of 0\.60 s"):
        plain.add(new("short", _tokens(50, 2)), slo_seconds=0.3)

    def cutting(lim: StepLimits = limits) -> Scheduler:
        pieces = PiecePolicy(load_config(None, [f"cache.block_tokens={BT}"]).scheduler, BT, engine.jct, PieceStats())
        return Scheduler("fcfs", 0.0, engine.tiers, engine.jct, clock=clock, limits=lim, pieces=pieces)

    sched = cutting()
    sched.add(new("long", _tokens(600, 1)))
    sched.add(new("short", _tokens(50, 2)), slo_seconds=0.3)
    step = sched.schedule()
    assert step.shed == [] and [d.waiting.request_id for d in step.batch] == ["short"]
    assert step.piece_tokens is None and "long" in sched
    for p in step.prepared:
        engine.tiers.abort(p)
    spent = cutting()
    spent.add(new("long", _tokens(600, 1))).yield_until = clock() - 1.0  # yielded as long as it may
    with pytest.raises(Refused, match=r"wait of 0\.60 s"):
        spent.add(new("short", _tokens(50, 2)), slo_seconds=0.3)
    # Behind the long one's whole rest a call with a 0.7 s objective would still end in time (0.65 s)
    # but past its planned end (0.375 s: half its slack waited): it goes before the long one's next
    # piece, and only the 120 ms call ahead counts. With 1.3 s (planned end 0.675 s) it would wait out
    # the whole rest: the long one counts.
    loose = cutting()
    loose.add(new("long", _tokens(600, 1)))
    loose.add(new("plain", _tokens(120, 3)))
    assert loose.predicted_wait(loose.add(new("tight", _tokens(50, 2)), slo_seconds=0.7)) == pytest.approx(0.12)
    assert loose.predicted_wait(loose.add(new("roomy", _tokens(50, 4)), slo_seconds=1.3)) == pytest.approx(0.77)
    # The predicted-wait cap counts every request ranked ahead, a long one that would let the call go first too.
    capped = cutting(StepLimits(max_batch_tokens=256, shed_late=True, max_predicted_wait=0.3))
    capped.add(new("long", _tokens(600, 1)))
    with pytest.raises(Refused) as refused:
        capped.add(new("short", _tokens(50, 2)), slo_seconds=0.3)
    assert refused.value.status == 503 and refused.value.retry_after == pytest.approx(0.6)
    engine.close()


@pytest.mark.parametrize("delay_spent", [True, False])
def test_a_long_request_yields_only_while_every_long_deadline_leaves_room(
    tiny_dir: Path, tmp_path: Path, delay_spent: bool
) -> None:
    """A long request yields, within its bounded delay or past it, only while its rest and then
    those of the other long requests waiting with a deadline, in deadline order at
    (1 + max_yield_delay) x their rest (1.5 x 0.6 s here), all end by their deadlines. Alone, a
    0.6 s request due at 1.2 s has room (0.9 s) and lets a 0.3 s call go first; with another 0.6 s
    request due at 1.6 s behind it (0.9 + 0.9 s > 1.6 s) it has none: the call is refused at once
    and the long one runs whole, instead of yielding on until the one behind it can no longer make
    it. 1 ms per computed token."""
    limits = StepLimits(max_batch_tokens=256, shed_late=True)
    engine, _, clock = _shedding(tiny_dir, tmp_path, "fcfs", limits, device_blocks=64)
    new = engine.tiers.new_request

    def cutting() -> Scheduler:
        pieces = PiecePolicy(load_config(None, [f"cache.block_tokens={BT}"]).scheduler, BT, engine.jct, PieceStats())
        return Scheduler("fcfs", 0.0, engine.tiers, engine.jct, clock=clock, limits=limits, pieces=pieces)

    def long(sched: Scheduler) -> None:
        sched.add(new("long", _tokens(600, 1)), slo_seconds=1.2).yield_until = clock() - 1.0 if delay_spent else None

    alone = cutting()
    long(alone)
    alone.add(new("short", _tokens(50, 2)), slo_seconds=0.3)
    step = alone.schedule()
    assert [d.waiting.request_id for d in step.batch] == ["short"] and "long" in alone
    for p in step.prepared:
        engine.tiers.abort(p)

    two = cutting()
    long(two)
    two.add(new("short", _tokens(50, 2)), slo_seconds=0.3)  # admitted while the long one has room
    two.add(new("other", _tokens(600, 3)), slo_seconds=1.6)
    with pytest.raises(Refused, match=r"wait of 0\.65 s"):  # the long one, then "short"
        two.add(new("late", _tokens(50, 4)), slo_seconds=0.3)
    step = two.schedule()
    assert [d.waiting.request_id for d in step.batch] == ["long"] and step.piece_tokens is None
    assert [w.request_id for w in step.shed] == ["short"] and "other" in two
    engine.close()


def test_a_long_request_that_misses_its_own_deadline_anyway_still_yields_within_its_delay(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """Late calls served (`late: serve`): a 0.6 s request due at 0.4 s misses its deadline even if it
    runs at once, so yielding costs it nothing: within its bounded delay it lets a 0.3 s call go
    first; past that delay it runs whole. 1 ms per computed token."""
    limits = StepLimits(max_batch_tokens=256)
    engine, _, clock = _shedding(tiny_dir, tmp_path, "fcfs", limits, device_blocks=64)
    new = engine.tiers.new_request
    for spent, first in ((False, "short"), (True, "long")):
        pieces = PiecePolicy(load_config(None, [f"cache.block_tokens={BT}"]).scheduler, BT, engine.jct, PieceStats())
        sched = Scheduler("fcfs", 0.0, engine.tiers, engine.jct, clock=clock, limits=limits, pieces=pieces)
        sched.add(new("long", _tokens(600, 1)), slo_seconds=0.4).yield_until = clock() - 1.0 if spent else None
        sched.add(new("short", _tokens(50, 2)), slo_seconds=0.3)
        step = sched.schedule()
        assert [d.waiting.request_id for d in step.batch] == [first] and step.piece_tokens is None
        for p in step.prepared:
            engine.tiers.abort(p)
    engine.close()
