"""Which block keys the host tier holds, as far as this engine knows: what the scheduler's
estimate reads before every pick, without asking LMCache.

Keys enter when a store lands (or a load found them in a shared remote store) and leave when a
load finds LMCache has evicted them, when the tiers are cleared, or when the index outgrows its
bound (LMCache evicts silently, so keys of long-gone chunks would pile up: the oldest go past
twice what the tier holds, and a live key dropped costs one recomputation). Keys queued for the
store thread count as held: the chunks are readable before they are put.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator


class BoundedKeys:
    """A set of keys that forgets its oldest ones past `cap` (insertion order)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._keys: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[int]:
        return iter(self._keys)

    def update(self, keys: Iterable[int]) -> list[int]:
        """Add keys; returns the ones dropped to stay within the cap."""
        for k in keys:
            self._keys[k] = None
            self._keys.move_to_end(k)
        dropped = []
        while len(self._keys) > self.cap:
            dropped.append(self._keys.popitem(last=False)[0])
        return dropped

    def difference_update(self, keys: Iterable[int]) -> None:
        """Remove `keys` (those not present are ignored)."""
        for k in keys:
            self._keys.pop(k, None)

    def clear(self) -> None:
        """Remove every key."""
        self._keys.clear()


class HostKeys:
    """Keys held (bounded) and keys queued for storing. Threads: the store thread reports stores,
    the prefetch thread learns remote keys and forgets evicted ones, the engine loop does the
    rest; every change is made under one lock, and membership tests read without it (one dict
    lookup each, atomic under the GIL)."""

    def __init__(self, cap: int) -> None:
        self._held = BoundedKeys(cap)
        self._storing: set[int] = set()
        self._lock = threading.Lock()

    @property
    def cap(self) -> int:
        """The most keys held before the oldest are forgotten."""
        return self._held.cap

    def __contains__(self, key: object) -> bool:
        return key in self._held or key in self._storing

    def __len__(self) -> int:
        """Keys held (those queued for storing not counted)."""
        return len(self._held)

    def storing(self, keys: Iterable[int]) -> None:
        """Keys queued for the store thread: they count as held until their store lands or is dropped."""
        with self._lock:
            self._storing.update(keys)

    def stored(self, keys: Iterable[int], ok: bool) -> list[int]:
        """A store batch landed (`ok`) or was dropped; returns the keys whose state changed."""
        keys = list(keys)
        with self._lock:
            changed = keys + (self._held.update(keys) if ok else [])  # the ones the bound dropped changed too
            self._storing.difference_update(keys)
        return changed

    def learned(self, keys: Iterable[int]) -> None:
        """Keys found held elsewhere (a shared remote store)."""
        with self._lock:
            self._held.update(keys)

    def forget(self, keys: Iterable[int]) -> list[int]:
        """Keys LMCache turned out not to hold; returns those that were believed held."""
        with self._lock:
            gone = [k for k in keys if k in self._held]
            self._held.difference_update(gone)
        return gone

    def clear(self) -> list[int]:
        """Forget every held key (queued ones stay); returns those forgotten."""
        with self._lock:
            gone = list(self._held)
            self._held.clear()
        return gone
