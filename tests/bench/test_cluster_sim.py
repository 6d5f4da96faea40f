"""The cluster simulation (benchmarks.cluster_sim): queueing, tiers and routing as its model says."""

from __future__ import annotations

import pytest

from benchmarks.cluster_sim import Cluster, Costs, SimOptions, Traffic, arrivals, max_qps, profiles, simulate

COSTS = Costs(miss=(0.1, 1e-4), local=(0.02, 0.0), remote=(0.02, 1e-5), kv_bytes_per_token=1000)


def test_one_replica_serves_first_come_first_served_at_the_measured_costs() -> None:
    sizes = [1000, 2000]
    visits = [(0.0, 0), (0.0, 0), (10.0, 1), (20.0, 1)]
    out = simulate(Cluster(1, 10**6), COSTS, sizes, visits, SimOptions(warmup=0.0))
    # user 0: computed (0.2 s), then the second waits for it and hits (0.2 + 0.02); user 1: 0.3, then 0.02
    assert out.miss == pytest.approx(0.5) and out.local == pytest.approx(0.5) and out.remote == 0
    assert out.p99 == pytest.approx(0.3) and out.p50 == pytest.approx(0.22)
    assert out.redis_write_bps > 0 and out.redis_read_bps == 0  # computed profiles are written through


def test_a_profile_computed_on_one_replica_is_loaded_from_the_remote_tier_on_another() -> None:
    sizes = [1000]
    visits = [(0.0, 0), (5.0, 0)]  # round robin: the second visit lands on the other replica
    out = simulate(Cluster(2, 10**6, routing="round_robin"), COSTS, sizes, visits, SimOptions(warmup=0.0))
    assert (out.miss, out.remote, out.local) == (0.5, 0.5, 0.0)
    span = 5.0 + COSTS.seconds("remote", 1000)  # from the first arrival to the last finish
    assert out.redis_read_bps == pytest.approx(1000 * 1000 / span)
    # Without room in the remote tier, it is computed again.
    out = simulate(
        Cluster(2, 10**6, remote_tokens=0, routing="round_robin"), COSTS, sizes, visits, SimOptions(warmup=0.0)
    )
    assert out.miss == 1.0


def test_remote_loads_queue_for_the_remote_tiers_bandwidth() -> None:
    sizes = [1000, 1000]
    # Both users computed on r0/r1, then each visits the other replica at the same moment.
    visits = [(0.0, 0), (0.0, 1), (5.0, 1), (5.0, 0)]
    free = simulate(Cluster(2, 10**6, routing="round_robin"), COSTS, sizes, visits, SimOptions(warmup=0.0))
    link = 1000 * 1000 / 0.1  # a profile (1 MB of KV) takes 0.1 s on the link
    slow = simulate(
        Cluster(2, 10**6, routing="round_robin", remote_bandwidth=link), COSTS, sizes, visits, SimOptions(warmup=0.0)
    )
    assert free.remote == slow.remote == 0.5
    assert free.p99 == pytest.approx(COSTS.seconds("miss", 1000))  # the computed visits are the slowest
    # The second remote load waits for the first one's transfer: 0.2 s on the link, then its own cost.
    assert slow.p99 == pytest.approx(0.2 + COSTS.seconds("remote", 1000))


def test_affinity_keeps_more_profiles_local_than_round_robin_when_one_replica_cannot_hold_them_all() -> None:
    sizes = profiles(400)
    visits = arrivals(20.0, 6000, 400, zipf=0.6)
    local = sum(sizes) // 6  # a replica holds a sixth of the profiles; eight of them hold them all
    aff = simulate(Cluster(8, local, routing="affinity"), COSTS, sizes, visits)
    rr = simulate(Cluster(8, local, routing="round_robin"), COSTS, sizes, visits)
    assert aff.local > 0.9 and rr.local < 0.5
    assert rr.redis_read_bps > 5 * aff.redis_read_bps
    assert aff.p99 < rr.p99


def test_the_bounded_load_spreads_a_hot_user_over_the_ring() -> None:
    sizes = [1000] * 4
    visits = arrivals(80.0, 3000, 4, zipf=4.0)  # user 0 makes ~93% of the visits; one replica serves ~45/s
    tight = simulate(Cluster(4, 10**6, load_factor=0.25), COSTS, sizes, visits)
    loose = simulate(Cluster(4, 10**6, load_factor=100.0), COSTS, sizes, visits)
    assert loose.busiest > 0.99 and loose.p99 > 10  # the owner alone, swamped
    assert tight.busiest < 0.9 and tight.p99 < 1.0  # spilled to the next replicas, which load it from Redis once


def test_max_qps_finds_the_rate_where_the_p99_meets_the_slo() -> None:
    sizes = [1000] * 50
    qps, out = max_qps(Cluster(2, 10**6), COSTS, sizes, slo_p99=0.5, traffic=Traffic(zipf=0.0, visits=3000))
    assert out.p99 <= 0.5
    assert 40 < qps < 100  # two replicas of 0.02 s per visit: below 100/s
    assert simulate(Cluster(2, 10**6), COSTS, sizes, arrivals(qps * 1.3, 3000, 50, 0.0)).p99 > 0.5
