"""The replicas' statistics merged as one engine's, as `/metrics` and the API's Retry-After read them."""

from __future__ import annotations

from tiered.api.protocol import EngineStats
from tiered.cluster.client import merge_stats


def test_queues_add_up_and_a_new_call_waits_behind_the_least_loaded_replica() -> None:
    merged = merge_stats(
        [EngineStats(num_waiting=3, predicted_wait_s=4.0), EngineStats(num_waiting=5, predicted_wait_s=1.5)]
    )
    assert merged is not None and merged.num_waiting == 8 and merged.predicted_wait_s == 1.5
    assert merge_stats([]) is None
