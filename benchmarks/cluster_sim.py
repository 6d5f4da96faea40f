"""A discrete-event simulation of N engine replicas sharing one remote (Redis) tier, fed with
per-visit costs measured on this machine (`benchmarks/project_replicas.py measure`), to project
what one machine cannot show: 8, 64, 512 replicas.

The model (benchmarks/RESULTS.md, "The simulation: 8, 64 and 512 replicas", says it in words):
- Users u = 0..U-1 visit as a Poisson process of rate `qps`; a visit is user u with probability
  proportional to 1 / (u + 1)^zipf. A visit is one call: `posts` prompts sharing the user's
  profile of P_u tokens (drawn once per user).
- A replica serves one visit at a time, first come first served (no batching across visits: a
  conservative choice). A visit's service time depends on where its profile is when it starts:
  in the replica's own tiers (`local`), only in the remote tier (`remote`: loaded, then kept
  locally), or nowhere (`miss`: computed, kept locally, and written to the remote tier when it
  finishes: write-through). Each is a + b·P_u, fitted on measured visits.
- A replica's own tiers (device + host) hold `local_tokens` of profiles, least recently used
  out; the remote tier holds `remote_tokens` (None: unbounded), least recently used out.
- Routing is the Ray Serve router's (`tiered.cluster.ring`): the ring on the user's key with the
  bounded load on queued tokens, or round robin.
- Redis bandwidth is what crosses the network: profiles read on remote hits and written after
  misses, at the model's KV bytes per token. With `remote_bandwidth` set, reads and writes queue
  on one link of that bandwidth: a remote hit costs what it cost here plus the time its own bytes
  and those queued ahead of them take on the link (conservative: the measured cost already
  includes a loopback transfer).
"""

from __future__ import annotations

import heapq
import math
import random
from collections import OrderedDict, deque
from dataclasses import dataclass

from tiered.cluster.ring import Ring, bounded_choice, user_key


@dataclass(frozen=True)
class Costs:
    """Seconds per visit as a + b·P (P: profile tokens), by where the profile was."""

    miss: tuple[float, float]
    local: tuple[float, float]
    remote: tuple[float, float]
    kv_bytes_per_token: int

    def seconds(self, where: str, profile: int) -> float:
        a, b = getattr(self, where)
        return a + b * profile


@dataclass(frozen=True)
class Cluster:
    replicas: int
    local_tokens: int  # a replica's device + host tiers, in tokens of KV
    remote_tokens: int | None = None  # None: the remote tier never evicts
    # The remote tier's bandwidth, bytes/s, shared by every replica's reads and writes (one queue,
    # first come first served); None: unlimited (each load costs what it cost on this machine).
    remote_bandwidth: float | None = None
    routing: str = "affinity"  # or round_robin
    load_factor: float = 0.25


@dataclass(frozen=True)
class Outcome:
    visits: int  # measured (after the warm-up)
    qps: float  # offered
    throughput: float  # visits/s answered over the measured span
    p50: float
    p99: float
    local: float  # share of visits whose profile was in the replica's own tiers
    remote: float  # ... only in the remote tier
    miss: float  # ... nowhere (computed)
    redis_read_bps: float  # bytes/s
    redis_write_bps: float
    busiest: float  # the busiest replica's share of busy time over the span (1.0: never idle)

    def meets(self, slo_p99: float, qps: float) -> bool:
        """P99 within `slo_p99`, and `qps` (the rate asked for) served: a queue that grows fails."""
        return self.p99 <= slo_p99 and self.throughput >= 0.95 * qps


@dataclass(frozen=True)
class SimOptions:
    """What `simulate` assumes beyond the cluster, its costs and the visits."""

    posts: int = 8  # prompts per visit
    post_tokens: int = 170  # each prompt's tokens beyond the profile (the router's load counts them)
    warmup: float = 0.3  # the share of the first visits left out of the statistics


@dataclass(frozen=True)
class Traffic:
    """The visits `max_qps` offers at each rate it tries: `visits` Poisson arrivals of Zipf-distributed users."""

    zipf: float
    visits: int
    seed: int = 0


@dataclass(frozen=True)
class _Tally:
    """What a simulation counted over its measured visits (after the warm-up), before the rates."""

    latencies: list[float]
    where_count: dict[str, int]  # visits by where their profile was: local, remote, miss
    read_bytes: float  # from the remote tier
    written_bytes: float  # to the remote tier
    busiest_seconds: float  # the busiest replica's busy time over the span


class _LRU:
    def __init__(self, capacity: int | None) -> None:
        self.capacity, self.used, self.items = capacity, 0, OrderedDict[int, int]()

    def hit(self, user: int) -> bool:
        if user in self.items:
            self.items.move_to_end(user)
            return True
        return False

    def put(self, user: int, tokens: int) -> None:
        if user in self.items:
            self.items.move_to_end(user)
            return
        self.items[user] = tokens
        self.used += tokens
        while self.capacity is not None and self.used > self.capacity and self.items:
            self.used -= self.items.popitem(last=False)[1]


def profiles(
    users: int, mean: int = 1800, sd: int = 300, low: int = 1200, high: int = 2400, seed: int = 0
) -> list[int]:
    """Profile lengths as the visit trace draws them (benchmarks.traces.visits)."""
    rng = random.Random(seed)
    return [min(high, max(low, round(rng.gauss(mean, sd)))) for _ in range(users)]


def arrivals(qps: float, visits: int, users: int, zipf: float, seed: int = 0) -> list[tuple[float, int]]:
    """(time, user) of `visits` Poisson arrivals at `qps`, users Zipf-distributed."""
    rng = random.Random(seed + 1)
    weights = [1 / (u + 1) ** zipf for u in range(users)]
    who = rng.choices(range(users), weights, k=visits)
    t, out = 0.0, []
    for u in who:
        t += rng.expovariate(qps)
        out.append((t, u))
    return out


def simulate(
    cluster: Cluster, costs: Costs, sizes: list[int], visits: list[tuple[float, int]], opts: SimOptions = SimOptions()
) -> Outcome:
    """Run the visits through the cluster; statistics over the visits after the first `opts.warmup` share."""
    posts, post_tokens = opts.posts, opts.post_tokens
    n = cluster.replicas
    names = [f"r{i}" for i in range(n)]
    ring = Ring(names) if cluster.routing == "affinity" else None
    local = [_LRU(cluster.local_tokens) for _ in range(n)]
    remote = _LRU(cluster.remote_tokens)
    queues: list[deque[tuple[int, float, int]]] = [deque() for _ in range(n)]  # (visit, arrival, user)
    busy_time = [0.0] * n
    loads: dict[str, float] = {}
    total_load = 0.0
    events = [(t, 1, -1, i) for i, (t, _) in enumerate(visits)]  # (time, kind 0 = finish / 1 = arrive, replica, visit)
    heapq.heapify(events)
    first = int(len(visits) * opts.warmup)
    span_start = visits[first][0] if first < len(visits) else 0.0
    latencies: list[float] = []
    where_count = {"local": 0, "remote": 0, "miss": 0}
    read = written = 0
    running: list[tuple[int, str, float] | None] = [None] * n  # (user, where, tokens) of the visit in service
    last_finish = 0.0
    link = _Link(cluster.remote_bandwidth, costs.kv_bytes_per_token)

    def start(r: int, now: float) -> None:
        nonlocal read
        visit, arrived, user = queues[r].popleft()
        size = sizes[user]
        if local[r].hit(user):
            where = "local"
        elif remote.hit(user):
            where = "remote"
            local[r].put(user, size)
        else:
            where = "miss"
            local[r].put(user, size)
        seconds = costs.seconds(where, size) + (link.transfer(now, size) if where == "remote" else 0.0)
        running[r] = (user, where, float(size + posts * post_tokens))
        if visit >= first:
            where_count[where] += 1
            read += size if where == "remote" else 0
            latencies.append(now + seconds - arrived)
        if now >= span_start:
            busy_time[r] += seconds
        heapq.heappush(events, (now + seconds, 0, r, visit))

    rr = 0
    while events:
        now, kind, r, visit = heapq.heappop(events)
        if kind == 1:  # an arrival: route it
            user = visits[visit][1]
            tokens = float(sizes[user] + posts * post_tokens)
            if ring is not None:
                name = bounded_choice(ring, user_key(str(user)), loads, tokens, cluster.load_factor, total_load)
                r = int(name[1:])
            else:
                r, rr = rr, (rr + 1) % n
            loads[names[r]] = loads.get(names[r], 0.0) + tokens
            total_load += tokens
            queues[r].append((visit, now, user))
            if running[r] is None:
                start(r, now)
        else:  # a finish
            user, where, tokens = running[r]  # type: ignore[misc]
            running[r] = None
            loads[names[r]] -= tokens
            total_load -= tokens
            if where == "miss":  # write-through: the computed profile goes to the remote tier
                remote.put(user, sizes[user])
                link.transfer(now, sizes[user])  # occupies the link; the visit does not wait for it
                written += sizes[user] if visit >= first else 0
            last_finish = now
            if queues[r]:
                start(r, now)
    span = max(last_finish - span_start, 1e-9)
    tally = _Tally(
        latencies, where_count, read * costs.kv_bytes_per_token, written * costs.kv_bytes_per_token, max(busy_time)
    )
    return _outcome(tally, len(visits) / visits[-1][0], span)


class _Link:
    """The remote tier's link: KV queued on it goes through in order, at its bandwidth (None: instantly)."""

    def __init__(self, bandwidth: float | None, bytes_per_token: int) -> None:
        self.bandwidth, self.bytes_per_token = bandwidth, bytes_per_token
        self.free = 0.0  # when it has sent everything queued so far

    def transfer(self, now: float, tokens: int) -> float:
        """Queue `tokens` of KV; seconds until they are through."""
        if self.bandwidth is None:
            return 0.0
        self.free = max(self.free, now) + tokens * self.bytes_per_token / self.bandwidth
        return self.free - now


def _outcome(tally: _Tally, qps: float, span: float) -> Outcome:
    """The outcome of a simulation whose measured span lasted `span` seconds, offered at `qps`."""
    measured = len(tally.latencies)
    latencies, where_count = sorted(tally.latencies), tally.where_count
    return Outcome(
        visits=measured,
        qps=qps,
        throughput=measured / span,
        p50=latencies[measured // 2] if latencies else math.nan,
        p99=latencies[min(measured - 1, int(0.99 * measured))] if latencies else math.nan,
        local=where_count["local"] / max(1, measured),
        remote=where_count["remote"] / max(1, measured),
        miss=where_count["miss"] / max(1, measured),
        redis_read_bps=tally.read_bytes / span,
        redis_write_bps=tally.written_bytes / span,
        busiest=tally.busiest_seconds / span,
    )


def max_qps(
    cluster: Cluster, costs: Costs, sizes: list[int], slo_p99: float, traffic: Traffic, opts: SimOptions = SimOptions()
) -> tuple[float, Outcome]:
    """The highest offered QPS whose P99 stays within `slo_p99` (bisection on the offered rate),
    and the outcome there."""
    zipf, visits, seed = traffic.zipf, traffic.visits, traffic.seed
    mean_local = sum(costs.seconds("local", s) for s in sizes) / len(sizes)
    low, high = 0.0, 2.0 * cluster.replicas / mean_local  # above what the replicas can serve
    best: Outcome | None = None
    for _ in range(14):
        mid = (low + high) / 2
        out = simulate(cluster, costs, sizes, arrivals(mid, visits, len(sizes), zipf, seed), opts)
        if out.meets(slo_p99, mid):
            low, best = mid, out
        else:
            high = mid
    if best is None:
        best = simulate(cluster, costs, sizes, arrivals(max(low, 1e-3), visits, len(sizes), zipf, seed), opts)
    return low, best
