"""Prefills that yield (tiered/scheduler/pieces.py): pieces equal one pass, parked on the device or in the
host tier; deadlines decide when a long request yields; its delay stays bounded; expired requests."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from tiered.config import load_config
from tiered.engine import Engine
from tiered.hybrid.forward import ForwardInputError
from tiered.hybrid.loader import read_args
from tiered.request.score import RequestOptions, Result, ScoreParams
from tiered.scheduler.jct import JCTModel
from tiered.scheduler.step import Refused

BT = 16
TOP = ScoreParams(top_logprobs=5)


def _engine(tiny_dir: Path, tmp_path: Path, *overrides: str, jct: JCTModel | None = None) -> Engine:
    cfg = load_config(
        None,
        [
            f"model.path={tiny_dir}",
            f"cache.block_tokens={BT}",
            "model.dtype=float32",
            "cache.host.lmcache.max_local_cpu_size=0.05",
            "scheduler.max_batch_tokens=0",
            f"scheduler.profile_cache_dir={tmp_path / 'jct'}",
            f"attention.profile_cache_dir={tmp_path / 'attention'}",
            "scheduler.late=serve",  # these cases serve late calls (how pieces order them); shedding: below
            *overrides,
        ],
    )
    return Engine(cfg, jct_model=jct or JCTModel([0.0, 1e-3]))


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(seed))


def _one(engine: Engine, ids: torch.Tensor, **kw: object) -> Result:
    rid = engine.submit(ids, TOP, options=RequestOptions(**kw))  # type: ignore[arg-type]
    (r,) = [r for r in engine.run() if r.request_id == rid]
    assert r.error is None, r.error
    return r


def _same(a: Result, b: Result) -> None:
    assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]
    for (_, x), (_, y) in zip(a.top_logprobs, b.top_logprobs, strict=True):
        assert abs(x - y) <= 1e-4


@pytest.mark.parametrize("evict", [False, True])
def test_fixed_pieces_equal_one_pass_parked_on_the_device_or_reloaded_from_the_host(
    tiny_dir: Path, tmp_path: Path, evict: bool
) -> None:
    """300 tokens in pieces of 64: five forwards, the parked blocks held on the device between
    them; or, evicted from the device after the first piece (what pressure from other requests
    does to blocks nobody holds), loaded back from the host tier, where every computed chunk went.
    The answer is the one-pass answer (fp32, within 1e-4)."""
    ids = _ids(300, 1)
    with _engine(tiny_dir, tmp_path, "scheduler.pieces=never", "cache.retention=none") as one:
        whole = _one(one, ids)
    with _engine(
        tiny_dir, tmp_path, "scheduler.pieces=fixed", "scheduler.piece_tokens=64", "cache.retention=none"
    ) as pieced:
        rid = pieced.submit(ids, TOP)
        assert pieced.step() == []  # the first piece: the request waits again
        parked = pieced.scheduler._waiting[rid]
        assert parked.num_pieces == 1 and len(parked.parked) == 4 and parked.split.num_device_hit_tokens == 64
        if evict:
            pieced.tiers.flush()
            pieced.tiers.device_tier.unpin(parked.parked)
            parked.parked = []
            pieced.tiers.device_tier.clear()
        (r,) = pieced.run()
        host = pieced.tiers.host_tier.stats()  # type: ignore[union-attr]
        if not evict:  # 4 blocks held after each of the first four pieces, none sent to the host tier
            assert pieced.pieces.parked_device_bytes == 16 * pieced.tiers.device_tier.bytes_per_block
            assert pieced.pieces.parked_host_bytes == 0 and pieced.pieces.num_pieces == 4
        assert pieced.tiers.device_tier.stats().num_pinned_blocks == 0  # every hold released
    assert whole.num_pieces == 1 and r.num_pieces == 5
    assert r.split.num_miss_tokens == 300  # the hits it had before its first piece: none
    _same(r, whole)
    assert host.num_hit_tokens == (64 if evict else 0)


@pytest.mark.parametrize("policy", ["fcfs", "srjf", "calibrated"])
def test_a_long_request_yields_to_a_request_that_would_miss_its_deadline(
    tiny_dir: Path, tmp_path: Path, policy: str
) -> None:
    """1 ms per computed token predicted: a 2,000-token request (2 s) ahead of a 50-token one
    whose objective is 60 ms. Not one block of the long one fits before it: the short one runs
    first, whatever the policy, then the long one (in pieces planned for arrivals like the short
    one). Without pieces, fcfs runs the long one first, whole."""
    long_ids, short_ids = _ids(2000, 2), _ids(50, 3)
    for pieces in ("deadline", "never"):
        if pieces == "never" and policy != "fcfs":
            continue  # srjf and calibrated run the short one first anyway
        with _engine(
            tiny_dir, tmp_path, f"scheduler.policy={policy}", f"scheduler.pieces={pieces}", "model.max_model_len=4096"
        ) as engine:
            long_id = engine.submit(long_ids, TOP)
            short_id = engine.submit(short_ids, TOP, options=RequestOptions(slo_ms=60_000 if pieces == "never" else 60))
            done = {r.request_id: r for r in engine.run()}
        first = min(done.values(), key=lambda r: r.finished_at).request_id
        assert first == (short_id if pieces == "deadline" else long_id)
        assert done[short_id].deadline_met is not None
        if pieces == "never":
            assert done[long_id].num_pieces == 1


@pytest.mark.parametrize(("slo_ms", "short_first"), [(3000, True), (10_000, False)])
def test_a_call_that_would_spend_over_half_its_slack_behind_a_long_one_goes_first(
    tiny_dir: Path, tmp_path: Path, slo_ms: int, short_first: bool
) -> None:
    """1 ms per computed token predicted: a 2,000-token request (2 s) ahead of a 50-token one
    (50 ms) under fcfs. With a 3 s objective the short one would still meet it behind the long
    one's whole rest (at 2.05 s), but only by waiting out more than half its slack (planned to end
    by 1.53 s): it goes first. With 10 s (planned end 5.03 s) it waits, and the long one runs
    whole (the piece left for an arrival like it is longer than the long one)."""
    with _engine(tiny_dir, tmp_path, "scheduler.policy=fcfs", "model.max_model_len=4096") as engine:
        long_id = engine.submit(_ids(2000, 40), TOP)
        short_id = engine.submit(_ids(50, 41), TOP, options=RequestOptions(slo_ms=slo_ms))
        done = {r.request_id: r for r in engine.run()}
    assert (done[short_id].finished_at < done[long_id].finished_at) == short_first
    assert done[long_id].num_pieces == (2 if short_first else 1)
    assert engine.pieces.num_deferrals == (1 if short_first else 0)


@pytest.mark.parametrize(("slo_ms", "short_first"), [(1190, True), (1210, False)])
def test_a_call_due_after_the_long_one_keeps_earliest_deadline_order(
    tiny_dir: Path, tmp_path: Path, slo_ms: int, short_first: bool
) -> None:
    """1 ms per computed token predicted: a 600-token request (0.6 s) due at 1.2 s, ahead of a
    50-token call under fcfs. Behind the long one's rest the call would end at 0.65 s, in time but
    past its planned end (0.62 s at a 1.19 s objective, 0.63 s at 1.21 s). Due before the long one
    (1.19 s), it goes first; due after it (1.21 s), the long one keeps its place and runs whole."""
    with _engine(tiny_dir, tmp_path, "scheduler.policy=fcfs", "model.max_model_len=4096") as engine:
        long_id = engine.submit(_ids(600, 42), TOP, options=RequestOptions(slo_ms=1200))
        short_id = engine.submit(_ids(50, 43), TOP, options=RequestOptions(slo_ms=slo_ms))
        done = {r.request_id: r for r in engine.run()}
    assert (done[short_id].finished_at < done[long_id].finished_at) == short_first
    assert engine.pieces.num_deferrals == (1 if short_first else 0)


@pytest.mark.parametrize(("policy", "defer"), [("fcfs", False), ("calibrated", False), ("calibrated", True)])
def test_a_request_already_late_goes_before_the_rest_of_a_long_one(
    tiny_dir: Path, tmp_path: Path, policy: str, defer: bool
) -> None:
    """A 2,000-token request (2 s predicted) is the head (calibrated with a large λ: it waited
    longest); a 50-token one's 1 ms objective is lost already. With `defer_late` off it no longer
    has to wait for the long one's end: shorter than the long one's rest, it runs first, and the
    long one's answer still equals one pass. Under fcfs, arrival order holds for the late (only the
    urgent go ahead); with `defer_late` the hopeful long one keeps its place ahead of the hopeless."""
    long_ids, short_ids = _ids(2000, 8), _ids(50, 9)
    with _engine(tiny_dir, tmp_path, "scheduler.pieces=never", "model.max_model_len=4096") as one:
        whole = _one(one, long_ids)
    with _engine(
        tiny_dir,
        tmp_path,
        f"scheduler.policy={policy}",
        f"scheduler.defer_late={str(defer).lower()}",
        "scheduler.fairness=1000",
        "model.max_model_len=4096",
    ) as engine:
        long_id = engine.submit(long_ids, TOP)
        time.sleep(0.01)  # 10 s forgiven to the long one by λ: it is the head
        short_id = engine.submit(short_ids, TOP, options=RequestOptions(slo_ms=1))
        done = {r.request_id: r for r in engine.run()}
    short, long_ = done[short_id], done[long_id]
    assert short.deadline_met is False
    assert (short.finished_at < long_.finished_at) == (policy == "calibrated" and not defer)
    _same(long_, whole)


def test_pieces_sized_by_deadline_leave_room_for_the_urgent_and_equal_one_pass(tiny_dir: Path, tmp_path: Path) -> None:
    """The short one (1 s objective) would miss behind the long one's whole rest (2 s): the long one
    yields before its first piece, the short one meets its deadline, and the long one then runs in
    pieces planned for arrivals like it, its answer equal to one pass."""
    long_ids, short_ids = _ids(2000, 4), _ids(50, 5)
    with _engine(
        tiny_dir, tmp_path, "scheduler.policy=fcfs", "scheduler.pieces=never", "model.max_model_len=4096"
    ) as one:
        whole = _one(one, long_ids)
    with _engine(tiny_dir, tmp_path, "scheduler.policy=fcfs", "model.max_model_len=4096") as engine:
        long_id = engine.submit(long_ids, TOP)
        short_id = engine.submit(short_ids, TOP, options=RequestOptions(slo_ms=1000))
        done = {r.request_id: r for r in engine.run()}
        assert engine.pieces.num_pieces >= 1
    # Its deadline holds as far as the JCT model predicts this machine (here: a fixed 1 ms per
    # token, slower than the tiny model): it is met, or, where the machine ran slower than that
    # (a loaded one), the short one at least went ahead of the long one's end.
    short, long_ = done[short_id], done[long_id]
    assert long_.num_pieces >= 2 and (short.deadline_met or short.finished_at < long_.finished_at)
    _same(done[long_id], whole)


def test_the_urgent_requests_a_long_head_waits_for_run_in_one_batch(tiny_dir: Path, tmp_path: Path) -> None:
    """A long head (20 s predicted at 10 ms a token) leaves no room for even one block before two
    urgent short ones (0.5 s each, 1.05 s objectives): it waits, and the urgent ones run together
    in the next forward, the second joining the first's batch as its predicted end still meets both
    deadlines, not one forward each."""
    with _engine(
        tiny_dir,
        tmp_path,
        "scheduler.policy=fcfs",
        "scheduler.max_batch_tokens=2048",
        "model.max_model_len=4096",
        jct=JCTModel([0.0, 1e-2]),
    ) as engine:
        long_id = engine.submit(_ids(2000, 11), TOP)
        urgent = {engine.submit(_ids(50, 12 + i), TOP, options=RequestOptions(slo_ms=1050)) for i in range(2)}
        first = engine.step()
        assert engine.pieces.num_deferrals == 1
        rest = engine.run()
    assert {r.request_id for r in first} == urgent and all(r.error is None for r in first)
    assert [r.request_id for r in rest] == [long_id]


@pytest.mark.parametrize(("max_yield_delay", "own_slo_ms"), [(0.1, None), (1e6, None), (0.1, 400), (0.1, 60_000)])
def test_a_long_request_under_a_stream_of_urgent_ones_finishes_within_its_bound(
    tiny_dir: Path, tmp_path: Path, max_yield_delay: float, own_slo_ms: int | None
) -> None:
    """Urgent short requests keep coming (each would miss behind the long one); the long one
    yields until (1 + max_yield_delay) x its predicted time alone (0.2 s here) has passed since
    its first yield, then runs. With an unbounded delay it would still be waiting; so would one
    whose own deadline (60 s) leaves room for (1 + max_yield_delay) x its rest, while one whose
    deadline (0.4 s) does not runs at the bound."""
    with _engine(
        tiny_dir,
        tmp_path,
        "scheduler.policy=fcfs",
        f"scheduler.max_yield_delay={max_yield_delay}",
        "model.max_model_len=4096",
        jct=JCTModel([0.0, 1e-4]),
    ) as engine:
        own = RequestOptions(slo_ms=own_slo_ms) if own_slo_ms is not None else RequestOptions()
        long_id = engine.submit(_ids(2000, 6), TOP, options=own)
        start, done = time.monotonic(), None
        for i in range(400):
            engine.submit(
                _ids(50, 100 + i), TOP, options=RequestOptions(slo_ms=6)
            )  # 5 ms predicted: no block of the long one fits
            done = next((r for r in engine.step() if r.request_id == long_id), None)
            if done is not None or time.monotonic() - start > 3.0:
                break
    if max_yield_delay < 1 and (own_slo_ms or 0) < 1000:
        # The bound, the step under way when it passed (a short one), then its own forward.
        assert done is not None and done.finished_at - start <= 1.1 * 0.2 + 0.3 + done.compute_seconds
        assert engine.pieces.num_deferrals >= 1
    else:
        assert done is None


def test_expired_requests_fail_clearly_only_with_drop_expired(tiny_dir: Path, tmp_path: Path) -> None:
    for drop in (True, False):
        with _engine(tiny_dir, tmp_path, f"scheduler.drop_expired={str(drop).lower()}") as engine:
            rid = engine.submit(_ids(40, 7), TOP, options=RequestOptions(slo_ms=1))
            time.sleep(0.01)
            (r,) = engine.run()
        assert r.request_id == rid
        if drop:
            assert r.expired and r.error is not None and "deadline exceeded" in r.error
        else:
            assert r.error is None and r.deadline_met is False and not r.expired


@pytest.mark.parametrize("bad", [-5, 0, 2e9, float("nan"), "10"])
def test_bad_objectives_are_refused_by_name(tiny_dir: Path, tmp_path: Path, bad: object) -> None:
    with _engine(tiny_dir, tmp_path) as engine, pytest.raises(ForwardInputError, match="slo_ms"):
        engine.submit(_ids(10, 8), options=RequestOptions(slo_ms=bad))  # type: ignore[arg-type]


def test_pieces_with_adapters_and_batches_equal_one_pass(
    tiny_dir: Path, tmp_path: Path, adapter_dirs: dict[tuple[str, str], Path]
) -> None:
    """A long request under a LoRA adapter, in fixed pieces (its parked KV keyed by the adapter),
    with short requests of the base model and of the adapter batched between its pieces: every
    answer equals its one-pass answer under the same adapter."""
    adapter = f"lora.modules.small={adapter_dirs[('tiny', 'small')]}"
    prompts = [(_ids(300, 9), "small"), (_ids(40, 10), None), (_ids(40, 11), "small"), (_ids(40, 12), None)]
    results = {}
    for pieces in ("never", "fixed"):
        with _engine(
            tiny_dir,
            tmp_path,
            f"scheduler.pieces={pieces}",
            "scheduler.piece_tokens=64",
            "scheduler.max_batch_tokens=256",
            "lora.enabled=true",
            adapter,
        ) as engine:
            ids = [engine.submit(p, TOP, options=RequestOptions(adapter=a)) for p, a in prompts]
            by_id = {r.request_id: r for r in engine.run()}
            results[pieces] = [by_id[i] for i in ids]
    assert results["fixed"][0].num_pieces == 5 and results["never"][0].num_pieces == 1
    assert max(r.batch_size for r in results["fixed"][1:]) >= 2  # the short ones were batched
    for one, pieced in zip(results["never"], results["fixed"], strict=True):
        _same(pieced, one)


def test_a_long_prefill_leaves_room_for_the_arrivals_its_recent_objectives_announce(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """Nobody waits when the long one starts; a request with a 500 ms objective came a moment
    ago. Pieces are planned so that one like it, arriving during the prefill, would still meet it
    (1 ms per token predicted, an arrival's half of its slack kept and pieces planned 15% longer:
    pieces of at most ~200 tokens). With no objective seen lately, the
    long one runs in one piece."""
    long_ids = _ids(2000, 20)
    with _engine(tiny_dir, tmp_path, "model.max_model_len=4096") as quiet:
        alone = _one(quiet, long_ids)
    with _engine(tiny_dir, tmp_path, "model.max_model_len=4096") as engine:
        _one(engine, _ids(40, 21), slo_ms=500)
        pieced = _one(engine, long_ids)
    assert alone.num_pieces == 1 and 2000 / 208 <= pieced.num_pieces <= 2000 / 64 + 1
    _same(pieced, alone)


def test_a_call_as_tight_as_the_arrivals_announced_is_not_cut_for_them(tiny_dir: Path, tmp_path: Path) -> None:
    """A 500 ms objective seen a moment ago announces arrivals; a 2,000-token request with the same
    objective (a lost cause here, 2 s predicted) runs whole: it is one of those calls, not a long
    prefill to cut for them. With a looser objective (60 s) it runs in pieces."""
    long_ids = _ids(2000, 24)
    with _engine(tiny_dir, tmp_path, "model.max_model_len=4096") as engine:
        _one(engine, _ids(40, 25), slo_ms=500)
        tight = _one(engine, long_ids, slo_ms=500)
        engine.tiers.clear()
        loose = _one(engine, long_ids, slo_ms=60_000)
    assert tight.num_pieces == 1 and loose.num_pieces >= 2000 / 448
    _same(tight, loose)


def test_objectives_nobody_could_meet_still_announce_arrivals(tiny_dir: Path, tmp_path: Path) -> None:
    """The only request seen lately was a lost cause (200 ms predicted at 1 ms a token, 100 ms
    objective: a new user's call). A like request with its prefix cached is expected to need a
    quarter of its objective: pieces leave half of the other 75 ms free, planned 15% longer than
    predicted (32 tokens). An objective a quarter
    of which is below any request's predicted time (20 ms: a one-block request takes 16) announces
    nothing: the long one then runs whole."""
    long_ids = _ids(2000, 22)
    for slo_ms, pieces in ((100, range(2000 // 48, 2000 // 32 + 2)), (20, range(1, 2))):
        with _engine(tiny_dir, tmp_path, "model.max_model_len=4096") as engine:
            _one(engine, _ids(200, 23), slo_ms=slo_ms)
            assert _one(engine, long_ids).num_pieces in pieces


def test_a_request_between_pieces_runs_alone(tiny_dir: Path, tmp_path: Path) -> None:
    """300 tokens in 64-token pieces with short requests waiting and a 256-token batch budget: once
    its remaining tokens fit the budget, it could ride in a batch, where no piece is cut (its whole
    rest in one forward, over its long prefix). It runs alone: all five pieces, the answer of one pass."""
    long_ids = _ids(300, 30)
    with _engine(tiny_dir, tmp_path, "scheduler.pieces=never") as one:
        whole = _one(one, long_ids)
    with _engine(
        tiny_dir,
        tmp_path,
        "scheduler.pieces=fixed",
        "scheduler.piece_tokens=64",
        "scheduler.max_batch_tokens=256",
        "scheduler.policy=fcfs",
    ) as engine:
        long_id = engine.submit(long_ids, TOP)
        for i in range(3):
            engine.submit(_ids(20, 31 + i), TOP)
        done = {r.request_id: r for r in engine.run()}
    assert len(done) == 4 and all(r.error is None for r in done.values())
    assert done[long_id].num_pieces == 5 and done[long_id].batch_size == 1
    _same(done[long_id], whole)


@pytest.mark.parametrize("write_policy", ["write-through", "on-evict"])
def test_a_request_between_pieces_leaves_room_to_load_a_cached_profile(
    tiny_dir: Path, tmp_path: Path, write_policy: str
) -> None:
    """A 20-block device tier. A 6-block profile was computed (in the host tier); a long request
    then parks 16 blocks in pieces of 4. Between its pieces it holds at most half the device tier,
    so the profile's next request finds all 6 blocks (device hits or host loads) instead of the 4
    that 16 held blocks would leave room for. The parked blocks it no longer holds are in the host
    tier (written through, or sent there when the profile's loads evict them): its next pieces load
    them back, and both answers equal one pass."""
    block = BT * read_args(tiny_dir).kv_bytes_per_token(torch.float32)
    profile, long_ids = _ids(6 * BT + 5, 11), _ids(24 * BT + 3, 12)
    visit = torch.cat([profile, _ids(7, 13)])
    with _engine(tiny_dir, tmp_path, "scheduler.pieces=never") as one:
        wholes = [_one(one, ids) for ids in (visit, long_ids)]
    with _engine(
        tiny_dir,
        tmp_path,
        "scheduler.pieces=fixed",
        f"scheduler.piece_tokens={4 * BT}",
        "scheduler.fairness=0",
        f"cache.device_tier_bytes={20 * block}",
        "cache.retention=none",
        f"cache.host.write_policy={write_policy}",
    ) as engine:
        assert engine.tiers.device_tier.num_blocks == 20
        _one(engine, profile)
        engine.tiers.flush()
        long_id = engine.submit(long_ids, TOP)
        for _ in range(4):
            assert engine.step() == []  # a piece: the long one waits again
        parked = engine.scheduler._waiting[long_id]
        assert parked.num_pieces == 4 and len(parked.parked) == 10
        again = engine.submit(visit, TOP)
        done = {r.request_id: r for r in engine.run()}
        split = done[again].split
        assert split.num_device_hit_tokens + split.num_host_hit_tokens == 6 * BT
        assert engine.tiers.device_tier.stats().num_pinned_blocks == 0
    _same(done[again], wholes[0])
    _same(done[long_id], wholes[1])
    assert done[long_id].num_pieces == 7


def test_a_batch_takes_no_request_that_would_make_a_member_miss_its_deadline(tiny_dir: Path, tmp_path: Path) -> None:
    """1 ms per computed token predicted. A 50-token request with a 2 s objective is the head; a
    3,000-token one waits too. Together they would take 3.05 s predicted, past the head's deadline:
    the long one runs in its own forward. Without the objective they share one."""
    for slo_ms in (2000, None):
        with _engine(
            tiny_dir, tmp_path, "scheduler.max_batch_tokens=4096", "model.max_model_len=4096", "scheduler.pieces=never"
        ) as engine:
            long_id = engine.submit(_ids(3000, 40), TOP)
            short_id = engine.submit(_ids(50, 41), TOP, options=RequestOptions(slo_ms=slo_ms))
            done = {r.request_id: r for r in engine.run()}
        assert done[short_id].batch_size == done[long_id].batch_size == (1 if slo_ms else 2)
        assert done[short_id].finished_at <= done[long_id].finished_at


def test_a_shed_call_is_answered_before_the_forward_that_would_make_it_late(tiny_dir: Path, tmp_path: Path) -> None:
    """`scheduler.late: shed` in the engine: a call whose own predicted time is over its objective
    is refused at submit (Refused, 429); one that turns hopeless because a longer, more urgent
    request runs first is handed to `answer_refused` before that request's forward starts, with a
    Retry-After, and never answered twice. 1 ms per computed token (predicted)."""
    with _engine(tiny_dir, tmp_path, "scheduler.late=shed", "scheduler.pieces=never") as engine:
        with pytest.raises(Refused) as refused:
            engine.submit(_ids(100, 30), TOP, options=RequestOptions(slo_ms=50))
        assert refused.value.status == 429 and engine.num_waiting == 0
        tight = engine.submit(_ids(50, 31), TOP, options=RequestOptions(slo_ms=100))
        plain = engine.submit(_ids(60, 32), TOP)
        urgent = engine.submit(_ids(400, 33), TOP, options=RequestOptions(priority=-1))
        early: list[tuple[float, Result]] = []
        results = engine.step(lambda refused: early.extend((time.monotonic(), r) for r in refused))
        ((when, shed),) = early
        assert shed.request_id == tight and shed.expired and shed.retry_after == pytest.approx(0.4 + 0.06, rel=0.2)
        assert shed.error is not None and shed.error.startswith("deadline unreachable")
        (first,) = results
        assert first.request_id == urgent and when <= first.finished_at - first.compute_seconds
        rest = engine.run()
        assert [r.request_id for r in rest] == [plain] and rest[0].error is None
