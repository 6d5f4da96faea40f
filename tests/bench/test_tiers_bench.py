import torch

from tiered.bench.tiers import revisit_trace


def test_revisit_trace_is_seeded_round_robin_with_exact_lengths() -> None:
    trace = revisit_trace(vocab=100, users=3, profile_tokens=50, post_tokens=7, rounds=2, seed=0)
    assert len(trace) == 6 and all(t.numel() == 57 for t in trace)
    for u in range(3):
        assert torch.equal(trace[u][:50], trace[u + 3][:50])  # the user's profile comes back
        assert not torch.equal(trace[u][50:], trace[u + 3][50:])  # with a fresh post
    assert not torch.equal(trace[0][:50], trace[1][:50])
    again = revisit_trace(vocab=100, users=3, profile_tokens=50, post_tokens=7, rounds=2, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(trace, again, strict=True))
