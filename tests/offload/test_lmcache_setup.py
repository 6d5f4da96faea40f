"""LMCache's conventions and the fixes we apply to it."""

from __future__ import annotations

import threading

from tiered.offload.lmcache_setup import reentrant_observability_lock


def test_a_thread_safe_function_can_be_entered_again_by_its_own_thread() -> None:
    """What the garbage collector does when it frees an LMCache memory object inside one of
    LMCache's `thread_safe` functions: with LMCache's own lock that thread waits on itself forever."""
    import lmcache.utils

    reentrant_observability_lock()
    lock = lmcache.utils._shared_observability_lock
    reentrant_observability_lock()
    assert lmcache.utils._shared_observability_lock is lock  # idempotent: one lock for every caller

    inner = lmcache.utils.thread_safe(lambda: "freed")
    outer = lmcache.utils.thread_safe(lambda: inner())
    result: list[str] = []
    t = threading.Thread(target=lambda: result.append(outer()), daemon=True)
    t.start()
    t.join(timeout=10)
    assert result == ["freed"], "a nested thread_safe call deadlocked"
