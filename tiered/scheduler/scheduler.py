"""Which waiting request runs next.

Design notes: docs/internals.md, section `tiered/scheduler/scheduler.py`.
"""

from __future__ import annotations

import functools
import heapq
import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import replace

from torch import Tensor

from tiered.config import SchedulerPolicy
from tiered.offload.loading import max_prefix_blocks
from tiered.offload.tiers import KVTiers
from tiered.request.score import DEFAULT_PARAMS, ScoreParams
from tiered.request.tokens import HitSplit, TierRequest, common_prefix_len
from tiered.request.validation import PRIORITY_LIMIT
from tiered.scheduler.jct import JCTModel
from tiered.scheduler.pieces import PiecePolicy, meetable, urgent_behind
from tiered.scheduler.step import Decision, Refused, Step, StepLimits, StepOutput, Waiting

__all__ = ["Decision", "Refused", "Scheduler", "Waiting"]

log = logging.getLogger(__name__)

# Requests between pieces hold at most this share of the device tier (their leading parked blocks)
# when a host tier has the rest, so that short calls meanwhile find their cached prefixes there.
PARK_DEVICE_SHARE = 0.5
# A warm-up (`Scheduler._warm`) ranks below every call (their priorities are checked to lie below
# this): it runs only when nothing else waits.
WARM_PRIORITY = PRIORITY_LIMIT
WARM_SUFFIX = "#warm"  # a warm-up's id: the refused call's, with this


class Scheduler:
    """The waiting requests, ordered by `policy`; `schedule` decides each engine step.

    `limits` bound a step; `pieces` decides whether a long head yields (None: it never does)."""

    def __init__(
        self,
        policy: SchedulerPolicy,
        fairness: float,
        tiers: KVTiers,
        jct: JCTModel,
        *,
        clock: Callable[[], float] = time.monotonic,
        limits: StepLimits | None = None,
        pieces: PiecePolicy | None = None,
    ) -> None:
        self.policy = policy
        self.fairness = fairness
        self.tiers = tiers
        self.jct = jct
        self.clock = clock
        self.limits = limits or StepLimits()
        self.pieces = pieces
        self._waiting: dict[str, Waiting] = {}  # request id -> entry
        self._heap: list[tuple[int, float, int, str, int]] = []  # (priority, score, seq, request id, version)
        self._late: list[
            tuple[int, float, int, str, int]
        ] = []  # entries moved out of _heap: past hope of their deadline
        self._by_key: dict[int, set[str]] = defaultdict(set)  # block key -> ids of the requests that hold it
        self._deadlines: list[tuple[float, int, str]] = []  # (deadline, seq, request id), stale entries skipped
        self._seq = 0
        self.warming: set[str] = set()  # ids of the warm-ups queued or running (`_warm`)
        # When the forward running now is predicted to end (the clock's time; 0.0: none runs), and the
        # keys of the blocks it holds once it ends: a call admitted meanwhile waits for it first, and
        # finds those blocks cached when it runs (`running`).
        self.running_until = 0.0
        self.running_blocks: frozenset[int] = frozenset()
        self._num_kept = tiers.num_kept_blocks()  # of a request's computed blocks, at most this many stay cached
        tiers.track_changes()  # the tiers collect the keys that move; `_rescore_changed` takes them

    def __len__(self) -> int:
        return len(self._waiting)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._waiting

    # ---- queue -----------------------------------------------------------------------------

    def add(
        self,
        request: TierRequest,
        arrival: float | None = None,
        priority: int = 0,
        params: ScoreParams = DEFAULT_PARAMS,
        slo_seconds: float | None = None,
    ) -> Waiting:
        """Queue a request (its id must not be waiting already: ValueError); with `slo_seconds`,
        its deadline is its arrival plus that. Admission control raises Refused: 503 when its
        predicted wait is over `limits.max_predicted_wait`, 429 when (`limits.shed_late`) its
        predicted wait and time end past its deadline."""
        if request.request_id in self._waiting:
            raise ValueError(f"request id {request.request_id!r} is already waiting")
        split = self.tiers.estimate(request)
        now = self.clock() if arrival is None else arrival
        deadline = None if slo_seconds is None else now + slo_seconds
        w = Waiting(
            request, self._seq, now, split, self.jct.predict(split), priority=priority, params=params, deadline=deadline
        )
        self._admit(w)
        self._seq += 1
        self._enqueue(w)
        if slo_seconds is not None and self.pieces is not None:
            self.pieces.saw(w.arrival, slo_seconds, w.jct)
        return w

    def _admit(self, w: Waiting) -> None:
        """Refuse `w` (Refused) where admission control says so; computes its predicted wait only
        where a rule needs it (a cap is set, or it has an objective and late calls are shed). The
        cap counts every request ranked ahead; the deadline, not those that let `w` go first."""
        lim = self.limits
        shed = lim.shed_late and w.deadline is not None
        if not (shed or lim.max_predicted_wait > 0):
            return
        wait, own = self._wait_and_own(w)
        if lim.max_predicted_wait > 0:
            # counted again only where a request ahead can let `w` go first
            full = wait if self.pieces is None or w.deadline is None else self._wait_and_own(w, cut_in=False)[0]
            if lim.max_predicted_wait < full:
                raise Refused(
                    503,
                    f"the server is over capacity: a predicted wait of {full:.1f} s exceeds "
                    f"scheduler.max_predicted_wait_s ({lim.max_predicted_wait:g} s); retry later",
                    full,
                    "wait_cap",
                )
        now = self.clock()
        if shed and w.deadline is not None:
            if own > w.deadline - w.arrival:
                raise self._unmeetable(w, own)
            if now + wait + own > w.deadline:
                raise Refused(
                    429,
                    f"deadline unreachable: a predicted wait of {wait:.2f} s and {own:.2f} s of its own end "
                    f"{1e3 * (now + wait + own - w.deadline):.0f} ms past its latency objective (scheduler.late: shed)",
                    wait,
                )
            w.in_time_at = now

    def _unmeetable(self, w: Waiting, own: float) -> Refused:
        """The refusal of a call whose own predicted time `own` exceeds its objective, however idle
        the machine: 400 where its prefix cached as far as the tiers keep one (more than it finds
        cached now) would not bring it within, so no retry helps; else 429, with a warm-up of its
        prefix queued (`_warm`) and the Retry-After of its end, or none where no warm-up is free."""
        assert w.deadline is not None
        objective, split, bt = w.deadline - w.arrival, w.split, self.tiers.block_tokens
        what = (
            f"objective unmeetable: alone this call is predicted to take {own:.2f} s ({split.num_miss_tokens} of "
            f"its {split.num_tokens} tokens to compute), over its latency objective of {objective:.2f} s"
        )
        cacheable = min(max_prefix_blocks(w.request, bt), self._hit_blocks(w) + self._num_kept) * bt
        floor = (
            own
            if cacheable <= split.num_hit_tokens
            else self.jct.predict(HitSplit(cacheable, 0, split.num_tokens - cacheable))
        )
        if floor > objective:
            return Refused(
                400,
                f"{what}, and {floor:.2f} s with its prefix cached: no wait or retry can meet it; "
                "raise slo_ms or send the call without one",
                None,
                "unmeetable",
            )
        if self.pieces is not None:  # a warm-up runs in pieces planned for calls like it
            self.pieces.saw(w.arrival, objective, own)
        after = self._warm(w, objective)
        if after is None:
            return Refused(
                429,
                f"{what}; its prefix is not cached and no warm-up is free "
                f"(scheduler.warm_unmeetable: {self.limits.warm_unmeetable}); a call that caches it lets it through",
                None,
                "unmeetable",
            )
        return Refused(
            429,
            f"{what}; its prefix is being computed in the background (scheduler.warm_unmeetable): "
            f"retry in {after:.1f} s",
            after,
            "unmeetable",
        )

    def _warm(self, w: Waiting, objective: float) -> float | None:
        """Queue a warm-up for the unmeetable call `w`: its prompt under its id + WARM_SUFFIX, at
        WARM_PRIORITY (it runs only when no call waits, in pieces planned for calls that may arrive,
        and yields to those that do, never bounded by `max_yield_delay`), with no objective and no
        one to answer (`finish_warm`), so that a later call over the same prefix finds it cached.
        A warm-up queued or running that brings `w` within its objective serves it too. Where
        `limits.warm_unmeetable` are taken, the oldest queued one gives its slot up; None where all
        are running. The predicted seconds until the work queued, that warm-up last, is done."""
        computed = set(self.running_blocks)
        queued = [x for rid in self.warming if (x := self._waiting.get(rid)) is not None]
        for x in queued:  # what each leaves cached: its hits, then as many computed blocks as the tiers keep
            computed.update(x.request.keys[: self._hit_blocks(x) + self._num_kept])
        if self._jct_after(w, computed) > objective:
            rid = w.request_id + WARM_SUFFIX
            if rid in self.warming or rid in self._waiting:
                return None
            if len(self.warming) >= self.limits.warm_unmeetable:
                if not queued:
                    return None
                oldest = min(queued, key=lambda x: x.seq)
                self.remove(oldest.request_id)
                self.warming.discard(oldest.request_id)
                log.info("warm-up %s dropped unrun: its slot goes to %s", oldest.request_id, rid)
            request = replace(w.request, request_id=rid)
            x = Waiting(request, self._seq, w.arrival, w.split, w.jct, priority=WARM_PRIORITY, warm=True)
            self._seq += 1
            self._enqueue(x)
            self.warming.add(rid)
            log.info(
                "request %s: objective unmeetable (alone %.2f s > %.2f s); its prefix warms in the background as %s",
                w.request_id,
                w.jct,
                objective,
                rid,
            )
        return max(0.0, self.running_until - self.clock()) + self.backlog(self.running_blocks, warm_ups=True)

    def finish_warm(self, request_id: str) -> bool:
        """Whether `request_id` is a warm-up's (`_warm`); if so it is answered now, to no one."""
        if request_id not in self.warming:
            return False
        self.warming.discard(request_id)
        return True

    def predicted_wait(self, w: Waiting) -> float:
        """Seconds of predicted work before `w` (not yet queued) starts: what is left of the forward
        running now, then the waiting requests of a higher priority, or of its own and ahead in the
        policy's order; with late calls shed, those that will be shed are not counted, nor, for a
        call with an objective, a long request that lets it run before its next piece
        (`_lets_go_first`). Blocks that several of them compute (a visit's posts over one profile)
        count once. O(waiting), plus O(long work) for each long request ahead that could let it go first."""
        return self._wait_and_own(w)[0]

    def _wait_and_own(self, w: Waiting, cut_in: bool = True) -> tuple[float, float]:
        """`predicted_wait(w)` (`cut_in` False: counting the requests that let `w` go first too), and
        `w`'s own predicted time once the requests ahead of it have run (the blocks they keep
        cached for it by then)."""
        now, shed = self.clock(), self.limits.shed_late
        start = max(now, self.running_until)  # when the next step can start: where `x` is decided again
        key = self._rank(w)
        computed = set(self.running_blocks) if self.running_until > now else set()
        wanted = set(w.request.keys)
        ahead = 0.0

        @functools.cache
        def ranked() -> list[tuple[tuple[int, float, int], Waiting]]:  # the long work by rank, made once if asked
            return [(self._rank(o), o) for o in self._long_work()]

        def behind(rank: tuple[int, float, int]) -> list[Waiting]:
            return [o for r, o in ranked() if r > rank]

        for x in self._waiting.values():
            rank = self._rank(x)
            if rank >= key:
                continue
            if cut_in and self._lets_go_first(x, w, start, functools.partial(behind, rank)):
                continue  # w runs before x's next piece
            jct = self._jct_after(x, computed)
            if shed and x.deadline is not None and now + jct > x.deadline:
                continue  # shed before it runs: it computes nothing
            ahead += jct
            self._keep(x, computed, wanted)
        return max(0.0, self.running_until - now) + ahead, self._jct_after(w, computed)

    def _lets_go_first(self, x: Waiting, w: Waiting, start: float, longs: Callable[[], Sequence[Waiting]]) -> bool:
        """Whether `x`, ranked ahead of `w`, lets `w` run before its next piece when `x` is next at
        the head (from `start`), as `PiecePolicy.decide` does: `w` has an objective it meets when
        run at once but would end past its planned end behind `x`'s whole rest (`urgent_behind`),
        `x` runs alone (a request between pieces, or one whose misses fill a batch), yields
        (`PiecePolicy.yields`, beside `longs()`: the long work ranked behind it), and has no
        deadline as early as `w`'s (such an `x` may itself go first, ahead of a long head, and run
        whole; a call due after `x` that `decide` lets go first because it would miss behind `x`
        is still counted behind it here: a wait predicted long, never short)."""
        if self.pieces is None or w.deadline is None or (x.deadline is not None and x.deadline <= w.deadline):
            return False
        if not _runs_alone(x, self.limits.max_batch_tokens):
            return False
        rest = self.pieces.rest(x)
        if not urgent_behind(start, rest, w, meetable(start, rest, x.deadline)):
            return False
        return self.pieces.yields(x, start, longs)  # last: it may ask for the long work

    def _rank(self, w: Waiting) -> tuple[int, float, int]:
        """Where `w` stands in the policy's order (lower runs first)."""
        return w.priority, self._order(w), w.seq

    def _long_work(self) -> list[Waiting]:
        """The waiting requests with a deadline that run alone: the long work a yielding head must
        leave room for (`PiecePolicy._room`; with `max_batch_tokens` 0 every request runs alone, so
        short calls that can wait behind the head count too). O(waiting)."""
        mbt = self.limits.max_batch_tokens
        return [x for x in self._waiting.values() if x.deadline is not None and _runs_alone(x, mbt)]

    def backlog(self, computed: AbstractSet[int] = frozenset(), warm_ups: bool = False) -> float:
        """Seconds of predicted work waiting: each request's JCT, blocks that several of them compute
        counted once, and those in `computed` (keys a running step keeps) as cached; warm-ups
        (`_warm`) only with `warm_ups`: every call runs before them. O(waiting)."""
        made, total = set(computed), 0.0
        for w in self._waiting.values():
            if w.warm and not warm_ups:
                continue
            total += self._jct_after(w, made)
            self._keep(w, made)
        return total

    def _jct_after(self, w: Waiting, computed: AbstractSet[int], split: HitSplit | None = None) -> float:
        """`w`'s predicted time (from `split`; default its own) run after requests that keep the
        blocks `computed` (keys) cached: its first computed blocks found there cost what device hits
        cost (the executor's rule for tokens a batch member computes for another). Keys chain
        their prefix, so the shared blocks lead."""
        split = w.split if split is None else split
        bt = self.tiers.block_tokens
        keys, first = w.request.keys, (split.num_tokens - split.num_miss_tokens) // bt
        n, end = first, max_prefix_blocks(w.request, bt)
        while n < end and keys[n] in computed:
            n += 1
        if n > first:
            return self.jct.predict(split.shared_as_hits((n - first) * bt))
        return w.jct if split is w.split else self.jct.predict(split)

    def _keep(self, w: Waiting, computed: set[int], wanted: AbstractSet[int] = frozenset()) -> None:
        """Add to `computed` the keys of the blocks `w` computes and leaves cached (as many as the
        tiers keep) that a later request may share: held by another waiting request, or `wanted`."""
        keys, n = w.request.keys, self._hit_blocks(w)
        while n < len(keys) and keys[n] in computed:  # an earlier request computes these
            n += 1
        end = min(len(keys), n + self._num_kept)
        while n < end and (keys[n] in wanted or len(self._by_key.get(keys[n], ())) > 1):
            computed.add(keys[n])
            n += 1

    def requeue(self, w: Waiting) -> None:
        """Put a picked request back, as it was (arrival, order, deadline): a request that yielded
        between pieces keeps its place. Its split is re-estimated (its finished pieces are cached)."""
        w.split = self.tiers.estimate(w.request)
        w.jct = self.jct.predict(w.split)
        w.version += 1
        self._enqueue(w)

    def _enqueue(self, w: Waiting) -> None:
        self._waiting[w.request_id] = w
        for key in w.request.keys:
            self._by_key[key].add(w.request_id)
        if self.policy != "hrrn":
            self._push(w)
        if w.deadline is not None:
            heapq.heappush(self._deadlines, (w.deadline, w.seq, w.request_id))

    def take(self, request_id: str) -> Decision:
        """Take a given waiting request out to run (the most urgent, ahead of the policy's pick)."""
        w = self._waiting.pop(request_id)
        self._unindex(w)
        return Decision(w, w.jct, 0.0, 0, len(self._waiting) + 1)

    def by_deadline(self, limit: int = 64) -> list[Waiting]:
        """Up to `limit` waiting requests with a deadline, earliest first (stale entries dropped)."""
        if len(self._deadlines) > 2 * len(self._waiting) + 64:  # mostly stale: keep the live entries
            live = {(w.deadline, w.seq, w.request_id) for w in self._waiting.values() if w.deadline is not None}
            self._deadlines = list(live)
            heapq.heapify(self._deadlines)
        heap = self._deadlines
        while heap:  # the earliest entries left first (a picked request's entry goes stale)
            top = self._waiting.get(heap[0][2])
            if top is not None and top.seq == heap[0][1]:
                break
            heapq.heappop(heap)
        out: dict[str, Waiting] = {}
        for _, seq, request_id in heapq.nsmallest(2 * limit, heap):
            w = self._waiting.get(request_id)
            if w is not None and w.seq == seq and len(out) < limit:
                out.setdefault(request_id, w)
        return list(out.values())

    def _push(self, w: Waiting) -> None:
        heapq.heappush(self._heap, (w.priority, self._score(w), w.seq, w.request_id, w.version))

    def _current(self, entry: tuple[int, float, int, str, int]) -> Waiting | None:
        """The waiting request a heap entry stands for; None if the entry is stale (the request
        left or was re-scored since, or its id now names a later request: seq tells them apart)."""
        _, _, seq, request_id, version = entry
        w = self._waiting.get(request_id)
        return w if w is not None and w.seq == seq and w.version == version else None

    def remove(self, request_id: str) -> Waiting | None:
        """Take a waiting request out (cancelled, expired, shed): its heap entry goes stale, its
        hold on blocks parked between its pieces and its prefetch go."""
        w = self._waiting.pop(request_id, None)
        if w is not None:
            self._unindex(w)
            self._release(w)
            self.tiers.drop_prefetch(w.request_id)
        return w

    def _release(self, w: Waiting) -> None:
        """Drop a request's hold on the device blocks parked for it between its pieces."""
        self.tiers.device_tier.unpin(w.parked)
        w.parked = []

    def _unindex(self, w: Waiting) -> None:
        for key in w.request.keys:
            ids = self._by_key.get(key)
            if ids is not None:
                ids.discard(w.request_id)
                if not ids:
                    del self._by_key[key]

    def waiting_keys(self) -> set[int]:
        """Block keys of every waiting request (what the `prefix` retention policy keeps)."""
        return set(self._by_key)

    def num_parked_blocks(self) -> int:
        """Device blocks the waiting requests hold between pieces (O(waiting): once a piece)."""
        return sum(len(w.parked) for w in self._waiting.values())

    # ---- scoring ---------------------------------------------------------------------------

    def _score(self, w: Waiting) -> float:
        p = self.policy
        if p == "fcfs":
            return float(w.seq)
        if p in ("srjf", "calibrated"):
            return w.jct + (self.fairness * w.arrival if p == "calibrated" else 0.0)
        if p == "lpm":
            return -float(w.split.num_hit_tokens)
        if p == "spf":
            return float(w.split.num_miss_tokens)
        raise ValueError(f"policy {p} has no static score")

    def _rescore_changed(self) -> int:
        """Re-estimate the waiting requests whose blocks moved between tiers since the last pick
        (the tiers collect the keys, from the engine's thread and the host tier's store thread)."""
        changed = self.tiers.take_changed()
        if self.policy in ("fcfs", "srjf"):
            return 0  # scored once
        dirty = {rid for key in changed for rid in self._by_key.get(key, ())}
        n = 0
        for request_id in dirty:
            w = self._waiting.get(request_id)
            if w is None:
                continue
            w.split = self.tiers.estimate(w.request)
            w.jct = self.jct.predict(w.split)
            n += 1
            if self.policy != "hrrn":
                w.version += 1
                self._push(w)
        return n

    # ---- picking ---------------------------------------------------------------------------

    def _best(self) -> Waiting | None:
        defer, now = self._defers_late(), self.clock()
        if self.policy == "hrrn":
            best, best_key = None, (False, 0, 0.0)
            for w in self._waiting.values():
                service = max(w.jct, 1e-9)
                key = (not (defer and self._hopeless(w, now)), -w.priority, (now - w.arrival + service) / service)
                if best is None or key > best_key:
                    best, best_key = w, key
            return best
        while self._heap:
            top = self._current(self._heap[0])
            if top is None:
                heapq.heappop(self._heap)  # stale: removed or re-scored since
            elif defer and self._hopeless(top, now):
                heapq.heappush(self._late, heapq.heappop(self._heap))  # runs once no hopeful request waits
            else:
                return top
        while self._late:
            top = self._current(self._late[0])
            if top is not None:
                return top
            heapq.heappop(self._late)
        return None

    def _defers_late(self) -> bool:
        """Whether hopeless requests wait behind hopeful ones (`scheduler.defer_late`; fcfs keeps arrival order)."""
        return self.limits.defer_late and self.policy != "fcfs"

    @staticmethod
    def _hopeless(w: Waiting, now: float) -> bool:
        """Whether `w`, run from `now` for its predicted time, ends past its deadline."""
        return w.deadline is not None and now + w.jct > w.deadline

    def pick(self) -> Decision | None:
        """Take the request to run next out of the queue (after re-scoring what changed)."""
        start = time.perf_counter()
        depth = len(self._waiting)
        rescored = self._rescore_changed()
        w = self._best()
        if w is None:
            return None
        del self._waiting[w.request_id]
        self._unindex(w)
        return Decision(w, w.jct, time.perf_counter() - start, rescored, depth)

    def pick_batch(
        self, max_batch_tokens: int, max_total_tokens: int, max_adapters: int = 0, head: Decision | None = None
    ) -> list[Decision]:
        """The head (`pick`, or `head`: one taken out already) plus waiting requests that fit, in the
        order they were chosen.

        `max_batch_tokens`: computed (miss) tokens in the batch, tokens that requests of the same
        cached prefix have in common after it (a profile's tail short of a block, a new user's
        whole profile) counted once, as the forward computes them; 0 runs one request per forward,
        and a head over the budget runs alone. `max_total_tokens`: computed tokens plus the
        longest cached prefix, which bounds the forward's memory (the start-up profile run
        proved `max_model_len` tokens fit). `max_adapters`: most distinct LoRA adapters in the
        batch (0: no bound). A request that yielded between pieces runs alone, head or not: its
        next piece is decided for a batch of one (tiered/scheduler/pieces.py), and its remaining tokens,
        however few, read a long prefix. A request does not join when the batch, with it (each
        member's predicted time summed), would end past a member's deadline the batch meets without it.
        Nor when the batch's cached prefixes (device hits and host loads, each block once) would
        not fit in the device tier together: the forward reads them all from there, and a load that
        finds no free block is recomputed, a whole prefix's work in a batch sized for its misses."""
        head = head or self.pick()
        if head is None:
            return []
        batch = [head]
        miss = head.waiting.split.num_miss_tokens
        if _runs_alone(head.waiting, max_batch_tokens):
            return batch
        start = time.perf_counter()
        # Requests share computed tokens in a batch (`plan_batch`'s rule) when they have the same
        # estimated prefix blocks and adapter; per such group, its leads' tokens to compute.
        head_keys = self._prefix_keys(head.waiting)
        leads = {_group_of(head.waiting.request, head_keys): [self._new_tokens(head.waiting)]}
        cached = set(head_keys)
        device_blocks = self.tiers.device_tier.num_blocks
        longest_prefix = head.waiting.split.num_tokens - miss
        adapters = {head.waiting.request.adapter}
        now = self.clock()
        ends, met = now + head.waiting.jct, math.inf  # the batch's predicted end, its earliest deadline met
        if head.waiting.deadline is not None and ends <= head.waiting.deadline:
            met = head.waiting.deadline
        # Behind a hopeful head, a hopeless filler would run ahead of the hopeful ones still waiting.
        hopeful_head = self._defers_late() and not self._hopeless(head.waiting, now)
        for w in self._fill_candidates(head.waiting):
            if w.num_pieces or ends + w.jct > met or (hopeful_head and self._hopeless(w, now)):
                continue
            adapter = w.request.adapter  # the base model (None) takes no adapter slot
            full = max_adapters and len(adapters - {None}) >= max_adapters
            if full and adapter is not None and adapter not in adapters:
                continue
            keys, new = self._prefix_keys(w), self._new_tokens(w)
            group = _group_of(w.request, keys)
            num_shared = max((common_prefix_len(t, new, new.numel() - 1) for t in leads.get(group, ())), default=0)
            m = w.split.num_miss_tokens - num_shared
            prefix = w.split.num_tokens - m
            if miss + m > max_batch_tokens or miss + m + max(longest_prefix, prefix) > max_total_tokens:
                continue
            its_prefix = cached.union(keys)
            if len(its_prefix) > max(device_blocks, len(cached)):  # a head over the tier alone still takes others
                continue
            cached = its_prefix
            del self._waiting[w.request_id]
            self._unindex(w)
            # its share of the batch's time: what another member computes for it counts as cached
            alone = w.jct if not num_shared else self.jct.predict(w.split.shared_as_hits(num_shared))
            batch.append(Decision(w, alone, 0.0, 0, head.queue_depth))
            ends += w.jct
            if w.deadline is not None and ends <= w.deadline:
                met = min(met, w.deadline)
            miss += m
            longest_prefix = max(longest_prefix, prefix)
            if not num_shared:
                leads.setdefault(group, []).append(new)
            adapters.add(w.request.adapter)
            if miss >= max_batch_tokens:
                break
        head.decision_seconds += time.perf_counter() - start
        return batch

    def _hit_blocks(self, w: Waiting) -> int:
        """Blocks of this request's estimated hits (device and host tiers), from its first."""
        return (w.split.num_tokens - w.split.num_miss_tokens) // self.tiers.block_tokens

    def _prefix_keys(self, w: Waiting) -> list[int]:
        """Keys of the blocks its estimated hits read from the device tier (loaded there first)."""
        return w.request.keys[: self._hit_blocks(w)]

    def _new_tokens(self, w: Waiting) -> Tensor:
        """The tokens this request would compute (after its estimated hits)."""
        return w.request.token_ids[self._hit_blocks(w) * self.tiers.block_tokens :]

    def _fill_candidates(self, head: Waiting, limit: int = 256) -> list[Waiting]:
        """Same-priority waiting requests: those sharing the head's first block, then those of
        the head's LoRA adapter (a batch of one adapter runs one low-rank update per
        projection), then the rest, each in policy order (at most `limit` of the last two: the
        cost of a pick stays bounded). A warm-up joins only warm-ups, a call only calls."""
        keys = head.request.keys
        sharing = [self._waiting[q] for q in self._by_key.get(keys[0], ())] if keys else []
        sharing.sort(key=lambda w: (self._order(w), w.seq))
        seen = {w.request_id for w in sharing}
        rest = [w for w in self._in_policy_order(limit) if w.request_id not in seen]
        same = [w for w in rest if w.request.adapter == head.request.adapter]
        other = [w for w in rest if w.request.adapter != head.request.adapter]
        return [w for w in sharing + same + other if w.priority == head.priority and w.warm == head.warm]

    def _in_policy_order(self, limit: int) -> list[Waiting]:
        """The first `limit` waiting requests in policy order, left in the queue."""
        if self.policy == "hrrn":  # its ratio moves with time: a scan, as in `_best`
            return sorted(self._waiting.values(), key=self._rank)[:limit]
        out: list[Waiting] = []
        popped = []
        while self._heap and len(out) < limit:
            entry = heapq.heappop(self._heap)
            w = self._current(entry)
            if w is not None:  # stale entries stay out of the heap
                out.append(w)
                popped.append(entry)
        for entry in popped:
            heapq.heappush(self._heap, entry)
        return out

    def _order(self, w: Waiting) -> float:
        """The policy's sort key (hrrn: minus its current response ratio)."""
        if self.policy == "hrrn":
            service = max(w.jct, 1e-9)
            return -(self.clock() - w.arrival + service) / service
        return self._score(w)

    # ---- the step ----------------------------------------------------------------------------

    def schedule(self) -> Step:
        """The next step: the batch (`pick_batch`), whether its head runs in a piece or waits for
        an urgent request (`pieces`), the prefix to prefetch, the requests that expired, and (late
        calls shed) those that can no longer meet their deadline: before the pick, those that
        cannot even if they start now; after it, those that cannot once this step has run."""
        lim = self.limits
        shed = self.take_unreachable(0.0) if lim.shed_late else []
        expired = self.take_expired() if lim.drop_expired else []
        batch = self.pick_batch(lim.max_batch_tokens, lim.max_model_len, lim.max_adapters)
        piece = None
        if self.pieces is not None and len(batch) == 1:
            piece = self.pieces.decide(batch[0], self.by_deadline, self.clock(), self._long_work)
        if piece is not None and piece.take is not None:  # yield before starting: the most urgent first,
            self.requeue(batch[0].waiting)  # with the requests that fit beside it (as a head's batch fills)
            batch = self.pick_batch(lim.max_batch_tokens, lim.max_model_len, lim.max_adapters, self.take(piece.take))
            piece = None
        piece_tokens = None if piece is None else piece.num_tokens
        busy = 0.0
        if batch:
            head = batch[0].waiting
            if piece_tokens is None:
                busy = sum(d.predicted_jct for d in batch)
            else:
                busy = self.jct.piece_seconds(head.split, piece_tokens)
        prefetch = None
        if batch and lim.prefetch:
            nxt = self.peek()
            if nxt is not None and nxt.split.num_loaded_tokens > 0 and not self._batch_makes(batch, nxt):
                prefetch = nxt.request
        parked = self.num_parked_blocks() if piece_tokens is not None else 0
        keys = self.waiting_keys() if batch else set()
        for d in batch:  # a warm-up's blocks are kept for the calls that will follow it
            if d.waiting.warm:
                keys.update(d.waiting.request.keys)
        step = Step(batch, [], piece_tokens, prefetch, expired, keys, parked, shed, 0.0, busy, time.monotonic())
        self._allocate(step)
        if batch and (lim.shed_late or lim.max_predicted_wait > 0):
            step.kept_keys = self._kept_keys(step)
        if lim.shed_late and batch:  # nothing waiting starts before this step ends, nor misses what it keeps
            step.shed += self.take_unreachable(busy, step.kept_keys)
            if prefetch is not None and prefetch.request_id not in self:
                step.prefetch = None  # shed
        if step.shed:
            step.retry_after = busy + self.backlog(step.kept_keys)
        if step.prefetch is not None:  # after the batch pinned its prefix: the prefetch's allocations
            self.tiers.prefetch(step.prefetch, step.prepared)  # evict only unpinned blocks, never those the batch reads
        return step

    def _allocate(self, step: Step) -> None:
        """Allocate and pin each request's blocks (`KVTiers.prepare`: its cached prefix, host hits
        looked up and given device blocks for the worker to load, the blocks its computed tokens
        fill, the chunks it stores),
        into `step.prepared`. A piece prepares its head cut after its next `piece_tokens` tokens;
        its computed blocks all stay (parked) on the device. With `limits.index_at_launch`, the
        retained blocks are indexed once the whole batch is prepared (the batch's own requests
        share through the plan, not through the index: the forward writes them as it reads)."""
        if not step.batch:
            return
        requests = [d.waiting.request for d in step.batch]
        if step.piece_tokens is not None:
            w = step.batch[0].waiting
            requests = [w.request.cut(w.split.num_hit_tokens + step.piece_tokens, self.tiers.block_tokens)]
        planned: set[int] = set()  # blocks an earlier request of the batch keeps or stores
        try:
            for req in requests:
                step.prepared.append(
                    self.tiers.prepare(req, step.waiting_keys, planned, park=step.piece_tokens is not None)
                )
            if self.limits.index_at_launch:
                for p in step.prepared:
                    self.tiers.commit(p)
        except BaseException:
            for p in step.prepared:
                self.tiers.abort(p)
            raise

    def update_from_output(self, step: Step, output: StepOutput) -> None:
        """Apply a step's output in one place: the prepared requests whose forward ended are
        finished (retained blocks indexed, pins released, chunks queued for the host tier), those
        that did not run are aborted; holds of requests that left are released; the JCT model
        learns each forward's time; a piece's head parks its KV and waits again, and the requests
        given back wait again, each in its place."""
        for p in output.finished:
            self.tiers.finish(p)
        for p in output.aborted:
            self.tiers.abort(p)
        if output.host_lost:
            self.tiers.forget_host()
        for w in output.released:
            self._release(w)
        for splits, seconds in output.observed:
            self.jct.observe(splits, seconds)
        if output.piece_head is not None:
            self._park(step, output.piece_head)
            self.requeue(output.piece_head)
        for w in output.requeue:
            self.requeue(w)

    def _park(self, step: Step, w: Waiting) -> None:
        """After a piece: pin the head's cached blocks (those it parked, and its prefix) for its next
        piece, at most `PARK_DEVICE_SHARE` of the device tier for all waiting heads where a host
        tier holds the rest; release what it held before."""
        assert self.pieces is not None
        stats, bt = self.pieces.stats, self.tiers.block_tokens
        dt, req = self.tiers.device_tier, w.request
        end = step.prepared[0].request.token_ids.numel()
        num_tokens = end - w.split.num_hit_tokens
        if w.first_split is None:
            w.first_split = w.split
        w.num_pieces += 1
        held = dt.match(req.keys, req.token_ids.tolist(), count=False, pin=True)
        if self.tiers.host_tier is not None:
            # Not held: cached but evictable, in the host tier (write-through) or sent there when
            # evicted (on-evict); a chunk the host tier lacks (a dropped store) is computed again.
            cap = max(0, int(dt.num_blocks * PARK_DEVICE_SHARE) - step.num_parked_blocks)
            dt.unpin(held[cap:])
            held = held[:cap]
        dt.unpin(w.parked)
        first = w.split.num_hit_tokens // bt  # of this piece's blocks, those held on the device
        on_device = max(0, min(len(held), end // bt) - first)
        stats.parked_device_bytes += on_device * dt.bytes_per_block
        if self.tiers.host_tier is not None:
            stats.parked_host_bytes += max(0, num_tokens // bt - on_device) * dt.bytes_per_block
        w.parked = held
        stats.num_pieces += 1
        log.debug(
            "request %s yielded after piece %d (%d of %d tokens; %d blocks held on the device)",
            req.request_id,
            w.num_pieces,
            end,
            req.token_ids.numel(),
            len(held),
        )

    def take_unreachable(
        self, busy: float, computed: AbstractSet[int] = frozenset(), note_in_time: bool = True
    ) -> list[Waiting]:
        """Take out the waiting requests that cannot meet their deadline even if they start once
        `busy` more seconds (the step about to run) have passed, the blocks `computed` (keys that
        step keeps) cached for them by then (`scheduler.late: shed`). A request about to be shed is
        estimated again first: a policy that scores once keeps the split of its arrival. Each one
        kept notes the moment it was still in time (`Waiting.in_time_at`), unless `note_in_time` is
        False (`busy` is a guess: a running forward past its predicted end). O(waiting)."""
        now = self.clock()

        def late(w: Waiting) -> bool:
            if w.deadline is None:
                return False
            if now + busy + self._jct_after(w, computed) > w.deadline:
                split = self.tiers.estimate(w.request)
                if split == w.split or now + busy + self._jct_after(w, computed, split) > w.deadline:
                    return True
            if note_in_time:
                w.in_time_at = now
            return False

        out = [w for w in self._waiting.values() if late(w)]
        for w in out:
            self.remove(w.request_id)
        return out

    def _kept_keys(self, step: Step) -> frozenset[int]:
        """Keys of the blocks cached once `step` has run: each prepared request's prefix, the
        computed blocks it keeps on the device and those it stores in the host tier."""
        out: set[int] = set()
        for p in step.prepared:
            keys = p.request.keys
            out.update(keys[: len(p.prefix_blocks)])
            out.update(keys[p.first_retained_block : p.first_retained_block + len(p.retained_blocks)])
            out.update(keys[j] for j in p.stored_blocks)
        return frozenset(out)

    def running(self, step: Step | None) -> None:
        """Note that `step`'s forward starts now (None: it ended, or none runs)."""
        if step is None or not step.batch:
            self.running_until, self.running_blocks = 0.0, frozenset()
        else:
            self.running_until = self.clock() + step.predicted_seconds
            self.running_blocks = step.kept_keys

    def take_expired(self) -> list[Waiting]:
        """Take out the waiting requests whose deadline has passed (`scheduler.drop_expired`)."""
        now = self.clock()
        out = []
        while (first := self.by_deadline(limit=1)) and (first[0].deadline or now) < now:
            self.remove(first[0].request_id)
            out.append(first[0])
        return out

    def _batch_makes(self, batch: list[Decision], nxt: Waiting) -> bool:
        """The next request's first host-resident block is one this batch loads or computes: it
        will be on the device when the batch ends, so loading it now would load it twice."""
        first_host = nxt.split.num_device_hit_tokens // self.tiers.block_tokens
        key = nxt.request.keys[first_host]
        return any(key in d.waiting.request.keys for d in batch)

    def peek(self) -> Waiting | None:
        """The request `pick` would choose now, left in the queue (the prefetch target)."""
        self._rescore_changed()
        return self._best()


def _runs_alone(w: Waiting, max_batch_tokens: int) -> bool:
    """Whether `w` at the head runs in a batch of one: one request per forward (`max_batch_tokens`
    0), its misses fill the batch, or it yielded between pieces."""
    return max_batch_tokens <= 0 or w.split.num_miss_tokens >= max_batch_tokens or w.num_pieces > 0


def _group_of(request: TierRequest, prefix_keys: list[int]) -> tuple[tuple[int, ...], str | None, int]:
    """What requests computing together in a batch must share (`plan_batch`'s rule): the prefix
    blocks, the adapter and the RoPE regime."""
    return tuple(prefix_keys), request.adapter, request.rope_regime
