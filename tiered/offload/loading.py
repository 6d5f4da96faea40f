"""Finding a request's cached prefix across the tiers (the scheduler side): runs of device-tier
blocks taken as they are, runs of host-tier chunks looked up and given new device blocks, in block
order, all of them pinned. The chunks' bytes are copied by the worker side (`KVWorker.load`,
tiered/offload/worker.py) before the forward that reads them, as LMCache's vLLM connector splits
lookup (scheduler) from load (worker); the same find and load run ahead of time on a thread of
their own for the request likely to run next (`prefetch`).

A load copies each LMCache chunk into one device block (the same layout, one contiguous copy).
With a shared remote store, a run is looked up to the prompt's end (other engines fill it) until
LMCache has once found fewer chunks than asked for. Chunks that find no free device block are
recomputed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

from tiered.offload.device_tier import DeviceTier
from tiered.offload.host_base import Host
from tiered.offload.host_keys import HostKeys
from tiered.request.plan import HostLoad
from tiered.request.tokens import TierRequest

PREFETCH_GATE_S = 30.0  # a prefetch waits at most this long for the step's own loads to run


class Loaded(NamedTuple):
    """Device blocks given host-tier chunks, those of them from its disk or a remote store, and
    the loads still to run into them (`find_prefix(defer=True)`; empty: loaded already)."""

    blocks: list[int]
    from_disk: set[int]
    from_remote: set[int]
    pending: list[HostLoad]


def nothing_loaded() -> Loaded:
    """A `Loaded` with no blocks."""
    return Loaded([], set(), set(), [])


def copy_chunks(host: Host, device_tier: DeviceTier, load: HostLoad) -> None:
    """Run a planned load, once: its chunks copied into its blocks, the host tier's references
    released; `load.filled` says how many leading blocks hold their chunk."""
    if load.filled is None:
        try:
            load.filled = host.load(load.objs, load.block_ids, device_tier.blocks, load.num_remote, load.num_disk)
        finally:
            load.done.set()


def max_prefix_blocks(req: TierRequest, block_tokens: int) -> int:
    """Blocks a hit may cover: full blocks, and never the last token (its logits must be computed)."""
    return min(len(req.keys), (req.token_ids.numel() - 1) // block_tokens)


class PrefixLoader:
    """Finds and pins a request's prefix across the tiers. Threads: the engine loop (`find_prefix`
    during `prepare`) and the one prefetch thread; the device tier and `host_keys` lock for themselves."""

    def __init__(
        self,
        device_tier: DeviceTier,
        host_tier: Host | None,
        host_keys: HostKeys,
        on_change: Callable[[Iterable[int]], None],
    ) -> None:
        self.device_tier, self.host_tier, self.host_keys = device_tier, host_tier, host_keys
        self.block_tokens = device_tier.block_tokens
        self.on_change = on_change  # keys whose tier changed (the scheduler re-scores their requests)
        # No torch.set_num_threads(1) here: it is the process's setting, not the thread's (torch
        # 2.13): the engine's forwards would then run on one core (tests/offload/test_threads.py).
        self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="tiered-prefetch")
        self._prefetches: dict[str, Future[Loaded]] = {}

    def _host_run_end(self, req: TierRequest, first_block: int, use_remote: bool) -> tuple[int, int]:
        """Where the run of host chunks from `first_block` ends by our key index, and where it may
        end: with a shared remote store (which other engines fill), the prompt's end, for LMCache to
        look up. Either way the run stops before the next block the device holds (loading it
        again would only duplicate it)."""
        max_blocks = max_prefix_blocks(req, self.block_tokens)

        def on_device(j: int) -> bool:
            return j > first_block and self.device_tier.count_cached(req.keys, j + 1, j) > 0

        known = first_block
        while known < max_blocks and req.keys[known] in self.host_keys and not on_device(known):
            known += 1
        if not (use_remote and self.host_tier is not None and self.host_tier.remote_url):
            return known, known
        end = known
        while end < max_blocks and not on_device(end):
            end += 1
        return known, end

    def _load_from_host(
        self, req: TierRequest, first_block: int, known: int, end: int, defer: bool
    ) -> tuple[Loaded, bool]:
        """Look up the run of host chunks first_block..end (`_host_run_end`) and give them new
        device blocks (pinned and cached); returns them (with those from disk and from the remote
        store) and whether LMCache had fewer chunks than asked for (no use asking the remote store
        again). `defer`: the chunks' copy into the blocks is left to the worker (`Loaded.pending`);
        otherwise, or where the host tier's load only queues the copy for its own workers
        (`queues_loads`), it runs now, and a chunk that cannot be read ends the run there.

        Chunks that find no free device block are not loaded: they are recomputed."""
        none = nothing_loaded()
        if self.host_tier is None or end == first_block:
            return none, False
        keys = req.keys[first_block:end]
        objs, num_remote, num_disk = self.host_tier.get(keys)
        short = len(objs) < len(keys)
        if len(objs) < known - first_block:  # keys we believed held, some LMCache lacks (evicted)
            self._forget(self.host_tier.missing(keys[len(objs) : known - first_block]))
        if not objs:
            return none, short
        blocks = self.device_tier.allocate(len(objs))
        if len(blocks) < len(objs):
            self.host_tier.release(objs[len(blocks) :])
        if not blocks:
            return none, short
        # objs: memory's chunks, then the disk's, then the remote store's; the loaded ones are the first len(blocks)
        disk_end = len(objs) - num_remote
        remote = blocks[disk_end:]
        disk = blocks[disk_end - num_disk : disk_end]
        load = HostLoad(list(keys[: len(blocks)]), list(objs[: len(blocks)]), list(blocks), len(remote), len(disk))
        if not defer or self.host_tier.queues_loads:
            copy_chunks(self.host_tier, self.device_tier, load)
            if load.failed:  # a chunk LMCache listed could not be read: recomputed from there
                filled = load.filled or 0
                self.undo(load)  # the keys it lacks forgotten; its blocks are not indexed yet
                self.device_tier.unpin(blocks[filled:])
                del blocks[filled:]
                disk = [b for b in disk if b in blocks]
                remote = [b for b in remote if b in blocks]
                short = True
                if not blocks:
                    return none, short
        bt = self.block_tokens
        try:
            for i, b in enumerate(blocks):
                j = first_block + i
                self.device_tier.cache(b, req.keys[j], req.token_ids[j * bt : (j + 1) * bt].tolist())
        except BaseException:  # nothing of this run is the caller's yet: give it all back
            if load.filled is None:
                self.host_tier.release(load.objs)
            self.device_tier.uncache(blocks)
            self.device_tier.unpin(blocks)
            raise
        if remote:  # in the host tier's reach now: the scheduler's estimate counts them as host hits
            self.host_keys.learned(keys[disk_end : len(blocks)])
        return Loaded(blocks, set(disk), set(remote), [load] if load.filled is None else []), short

    def undo(self, load: HostLoad) -> None:
        """A planned load whose blocks did not all get their chunk (never run, or a chunk could not
        be read): those blocks leave the device tier's index (freed on their last unpin), the host
        tier's references of a load never run are released, and the keys whose chunk it lacks are
        forgotten (computed and stored again). The load keeps what it filled: undone once."""
        assert self.host_tier is not None
        if load.filled is None:
            self.host_tier.release(load.objs)
            load.filled = 0
        else:
            self._forget(self.host_tier.missing(load.keys[load.filled :]))
        self.device_tier.uncache(load.block_ids[load.filled :])
        del load.keys[load.filled :], load.objs[load.filled :], load.block_ids[load.filled :]
        load.done.set()

    def find_prefix(self, req: TierRequest, defer: bool = False) -> tuple[list[int], Loaded, float]:
        """Pin the request's prefix: alternate runs of device hits and host loads, in block order.
        `defer`: the host loads are left to the worker (`Loaded.pending`), as `_load_from_host` says.

        Returns (prefix blocks, those given host-tier chunks with their origins, seconds spent finding
        and loading them)."""
        tokens = req.token_ids.tolist()
        prefix: list[int] = []
        loaded = nothing_loaded()
        seconds = 0.0
        use_remote = True  # until the remote store has had fewer chunks than asked for
        try:
            while True:
                prefix += self.device_tier.match(req.keys, tokens, count=False, start=len(prefix), pin=True)
                known, end = self._host_run_end(req, len(prefix), use_remote)
                start = time.perf_counter()
                run, short = self._load_from_host(req, len(prefix), known, end, defer)
                use_remote = use_remote and not short
                if end > len(prefix):
                    seconds += time.perf_counter() - start
                if not run.blocks:
                    return prefix, loaded, seconds
                prefix += run.blocks
                loaded.blocks.extend(run.blocks)
                loaded.from_disk.update(run.from_disk)
                loaded.from_remote.update(run.from_remote)
                loaded.pending.extend(run.pending)
        except BaseException:
            for load in loaded.pending:
                self.undo(load)
            self.device_tier.unpin(prefix)
            raise

    def _forget(self, keys: Sequence[int]) -> None:
        gone = self.host_keys.forget(keys)
        if gone:
            self.on_change(gone)

    def prefetch(self, req: TierRequest, after: Sequence[HostLoad] = ()) -> None:
        """Start loading `req`'s host-resident prefix into the device tier in the background, once
        the loads `after` (the step's own, which its forward waits for) have run: the two would
        otherwise share the cores and the disk while the forward waits.

        The loaded blocks are cached and left unpinned: if another request runs first they
        simply stay in the device tier (evictable) like any other cached block."""
        if self.host_tier is None or req.request_id in self._prefetches:
            return

        def run() -> Loaded:
            for load in after:  # set on every path (run, or given up); the bound only guards a slip
                load.done.wait(PREFETCH_GATE_S)
            prefix, loaded, _ = self.find_prefix(req)
            self.device_tier.unpin(prefix)
            return loaded

        self._prefetches[req.request_id] = self._prefetcher.submit(run)

    def drop_prefetch(self, request_id: str) -> None:
        """Forget a prefetch for a request that will not run (what it loaded stays cached)."""
        self._prefetches.pop(request_id, None)

    def take_prefetch(self, request_id: str) -> tuple[Loaded, float]:
        """Wait for the request's prefetch, if one was started: the blocks it loaded (with their
        origins), and the seconds waited."""
        future = self._prefetches.pop(request_id, None)
        if future is None:
            return nothing_loaded(), 0.0
        start = time.perf_counter()
        loaded = future.result()
        return loaded, time.perf_counter() - start

    def close(self) -> None:
        """Stop the prefetch thread, waiting for the loads already submitted."""
        self._prefetcher.shutdown(wait=True)
