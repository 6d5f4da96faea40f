"""The traffic of `python -m benchmarks mixed`: short visit calls with a tight objective among long, uncached prompts.

Two arrival processes over one window (seeded; strings seed `random.Random`, so the draws do not
depend on the Python process):
- short calls at `short_qps`: the visit workload's (`traces.visits`: a Zipf user's profile of
  ~1,800 tokens + a fresh post + the question, `posts` prompts a call), objective `short_slo_ms`;
  popular users return, so their profiles are cached within a run;
- long calls at `long_per_minute`: fresh random prompts of exactly `long_tokens`, objective
  `long_slo_ms`; one in each period of 60 / long_per_minute s, at a seeded uniform time within it.
  Not Poisson: a long call costs so much (half a minute of bench-m on 2 cores) that a window of a
  few minutes holds only a few, and a Poisson count of them would swing the offered load by half.
  Their times do not depend on `short_qps`: every load gets the same long calls at the same times
  (with --minutes), and only the short traffic grows.

The window is --minutes long, or, with --calls, ends at the last of the first N calls' arrivals.
A trace also holds `alone_repeats` more fresh long prompts: the idle-server reference each long
call's completion time is compared with.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass, replace

from benchmarks.load import Call
from benchmarks.systems import MixedSystem
from benchmarks.traces import BenchError, VisitsTraceOptions, credit_verification, visits
from benchmarks.visits import split_visits

SHORT, LONG = "short", "long"


def deadline_priority(call: MixedCall) -> int:
    """vLLM's `priority` on its priority systems (lower runs first): the call's deadline, ms from
    the trace's start, so that vLLM runs the earliest deadline first, as ours plans by deadline."""
    return round(1e3 * call.arrival_seconds + call.slo_ms)


@dataclass(slots=True, frozen=True)
class MixedParams:
    """The options of the traffic (lengths in tokens, objectives in ms from arrival).

    The defaults fit bench-m on 2 cores (fp32 compute): a short call alone takes ~0.6 s on a cached
    profile and ~4 s on a fresh one, an 8 K-token prompt ~28 s, so one a minute is half the machine,
    its objective ~2x its time alone, and the short one admits a fresh profile computed at once."""

    short_slo_ms: float = 5000.0
    long_tokens: int = 8192
    long_per_minute: float = 1.0
    long_slo_ms: float = 60000.0
    minutes: float | None = 5.0  # the arrival window; None: `calls` decides it
    calls: int | None = None  # calls in all (short and long), instead of `minutes`
    users: int = 16
    posts: int = 1  # prompts per short call
    profile_tokens: int = 1800  # mean; sd 1/6 of it, clipped to [2/3, 4/3] of it (the visits': 1,800 +- 300)
    post_tokens: int = 150
    zipf: float = 1.1
    alone_repeats: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        rules = (
            ("--short-slo-ms", self.short_slo_ms > 0, "> 0"),
            ("--long-slo-ms", self.long_slo_ms > 0, "> 0"),
            ("--long-tokens", self.long_tokens >= 1, ">= 1"),
            ("--long-per-minute", self.long_per_minute >= 0, ">= 0"),
            ("--minutes", self.minutes is None or self.minutes > 0, "> 0"),
            ("--calls", self.calls is None or self.calls >= 1, ">= 1"),
            ("--users", self.users >= 1, ">= 1"),
            ("--posts", self.posts >= 1, ">= 1"),
            ("--profile-tokens", self.profile_tokens >= 3, ">= 3"),
            ("--post-tokens", self.post_tokens >= 1, ">= 1"),
            ("--zipf", self.zipf >= 0, ">= 0"),
            ("--alone-repeats", self.alone_repeats >= 1, ">= 1"),
        )
        bad = [f"{name} must be {rule}" for name, ok, rule in rules if not ok]
        if bad:
            raise BenchError("; ".join(bad))
        if (self.minutes is None) == (self.calls is None):
            raise BenchError("give one of --minutes and --calls")


@dataclass(slots=True)
class MixedCall:
    """One call of the trace: what is sent (its objective and priority added per system) and when."""

    call: Call
    kind: str  # SHORT or LONG
    arrival_seconds: float
    slo_ms: float
    user: int = -1  # short: the visit's user
    returning: bool = False  # short: its user came earlier in the trace


@dataclass(slots=True)
class MixedTrace:
    short_qps: float
    window_seconds: float
    calls: list[MixedCall]  # in arrival order
    alone_prompts: list[list[int]]  # fresh prompts of long_tokens, run alone on the idle server

    def of(self, kind: str) -> list[MixedCall]:
        return [c for c in self.calls if c.kind == kind]

    @property
    def max_tokens(self) -> int:
        return max(len(p) for c in self.calls for p in [*c.call.prompts, *self.alone_prompts])

    def describe(self) -> str:
        short, long = self.of(SHORT), self.of(LONG)
        returning = sum(c.returning for c in short)
        return (
            f"short QPS {self.short_qps:g}: {len(short)} short calls ({returning} from returning users) and "
            f"{len(long)} long over {self.window_seconds:.0f} s"
        )


def poisson_times(rate_per_s: float, rng: random.Random) -> Iterator[float]:
    """Arrival times of a Poisson process at `rate_per_s`, without end (none at rate 0)."""
    t = 0.0
    while rate_per_s > 0:
        t += rng.expovariate(rate_per_s)
        yield t


def periodic_times(rate_per_s: float, rng: random.Random) -> Iterator[float]:
    """One arrival in each period of 1 / `rate_per_s` s, uniform within it; without end (none at rate 0)."""
    for k in itertools.count() if rate_per_s > 0 else ():
        yield (k + rng.random()) / rate_per_s


def arrivals(p: MixedParams, short_qps: float) -> tuple[list[tuple[float, str]], float]:
    """(time, kind) of every call in arrival order, and the window's length in seconds."""
    short = ((t, SHORT) for t in poisson_times(short_qps, random.Random(f"{p.seed}-short")))
    long = ((t, LONG) for t in periodic_times(p.long_per_minute / 60, random.Random(f"{p.seed}-long")))
    merged = heapq.merge(short, long)
    if p.minutes is not None:
        window = 60 * p.minutes
        return list(itertools.takewhile(lambda a: a[0] < window, merged)), window
    taken = list(itertools.islice(merged, p.calls))
    return taken, taken[-1][0]


def build_trace(vocab: list[int], p: MixedParams, short_qps: float) -> MixedTrace:
    """The seeded calls of one offered load (see the module docstring)."""
    if short_qps <= 0:
        raise BenchError(f"--short-qps values must be > 0, got {short_qps:g}")
    times, window = arrivals(p, short_qps)
    num_short = sum(kind == SHORT for _, kind in times)
    num_long = len(times) - num_short
    n = p.profile_tokens
    shorts = iter(
        split_visits(
            visits(
                vocab,
                VisitsTraceOptions(
                    users=p.users,
                    visits=max(1, num_short),
                    posts=p.posts,
                    profile_mean=n,
                    profile_sd=n // 6,
                    profile_min=2 * n // 3,
                    profile_max=4 * n // 3,
                    post_tokens=p.post_tokens,
                    zipf=p.zipf,
                    seed=p.seed,
                ),
            )
        )
    )
    # Another seed than the visits': no long prompt starts as a profile does.
    longs = credit_verification(vocab, num_long + p.alone_repeats, p.long_tokens, p.long_tokens, seed=p.seed + 1)
    long_prompts = (r.token_ids for r in longs.requests)
    calls: list[MixedCall] = []
    counts = {SHORT: 0, LONG: 0}
    for t, kind in times:  # ids count within a class: long call j is the same call at every load
        j = counts[kind]
        counts[kind] += 1
        if kind == SHORT:
            v = next(shorts)
            call = replace(v.call, call_id=f"s{j}-u{v.user}")
            calls.append(MixedCall(call, SHORT, t, p.short_slo_ms, v.user, v.returning))
        else:
            calls.append(MixedCall(Call(f"l{j}", [next(long_prompts)]), LONG, t, p.long_slo_ms))
    return MixedTrace(short_qps, window, calls, list(long_prompts))


def calls_for(trace: MixedTrace, system: MixedSystem) -> list[Call]:
    """The calls as `system` gets them: ours with their objective (`slo_ms`), vLLM's priority systems
    with their deadline as `priority` (earliest deadline first); neither field to the others (vLLM
    refuses a priority it does not use)."""
    return [
        replace(
            c.call,
            slo_ms=None if system.is_vllm else c.slo_ms,
            priority=deadline_priority(c) if system.priority else None,
        )
        for c in trace.calls
    ]
