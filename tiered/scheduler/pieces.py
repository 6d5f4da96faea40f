"""How much of a long request to compute now (SLOWeave's chunk choice, for prefill-only work).

Design notes: docs/internals.md, section `tiered/scheduler/pieces.py`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tiered.config import SchedulerConfig
from tiered.request.tokens import HitSplit
from tiered.scheduler.jct import JCTModel
from tiered.scheduler.step import Decision, PieceStats, Waiting

HORIZON_S = 60.0  # objectives seen this recently stand for the arrivals a piece must leave room for
# A piece cut for arrivals that have not happened costs at least this many times its fixed part
# (JCTModel.piece_seconds with no tokens: a step, and reading its prefix).
PIECE_OVERHEAD_SHARE = 5
LOST_CAUSE_SHARE = 0.25  # of a lost cause's objective: the time a like request with a cached prefix needs
# A piece is planned as if it took this share longer than predicted: a piece cut to end just in time
# for an urgent request otherwise makes it miss by whatever the piece overruns, and the request is
# shed after waiting out the piece.
PIECE_MARGIN = 0.15
# An anticipated arrival is planned to use at most this share of its slack waiting for a piece: the
# rest is for the calls that arrive with it (Poisson arrivals come in bursts) and for overruns.
ARRIVAL_SLACK_SHARE = 0.5


@dataclass(slots=True, frozen=True)
class Urgent:
    """A waiting request to run before the head's next piece (`urgent_behind`), or one anticipated."""

    request_id: str
    deadline: float
    jct: float


def largest_feasible(step: int, hi: int, feasible: Callable[[int], bool]) -> int:
    """The largest multiple of `step` in [step, hi] for which `feasible` holds, or 0 if none does.

    `feasible` must be monotone: true up to some size, false beyond. O(log(hi / step)) calls."""
    lo, top = 0, hi // step  # invariant: lo blocks are feasible (0 trivially), top + 1 are not known
    while lo < top:
        mid = (lo + top + 1) // 2
        if feasible(mid * step):
            lo = mid
        else:
            top = mid - 1
    return lo * step


def fits(now: float, piece_seconds: float, urgent: Sequence[Urgent]) -> bool:
    """Whether each urgent request, run after the piece and the ones before it, meets its deadline."""
    t = now + piece_seconds
    for u in urgent:
        t += u.jct
        if t > u.deadline:
            return False
    return True


def planned_deadline(arrival: float, deadline: float, jct: float) -> float:
    """When a waiting request of predicted time `jct` is planned to end behind a long head: as an
    anticipated arrival is, after waiting at most ARRIVAL_SLACK_SHARE of its slack since `arrival`
    (the rest is for overruns and the calls that arrive with it); its deadline if it has no slack."""
    return deadline - (1.0 - ARRIVAL_SLACK_SHARE) * max(0.0, deadline - arrival - jct)


def meetable(now: float, rest: float, deadline: float | None) -> float | None:
    """`deadline` if a request with `rest` predicted seconds left meets it when run at `now`, else None."""
    return deadline if deadline is not None and now + rest <= deadline else None


def urgent_behind(now: float, whole: float, w: Waiting, head_deadline: float | None) -> bool:
    """Whether `w` (with a deadline) meets it when run at `now` but would end past its planned end
    after `whole` more seconds (a long head's rest): it goes before the head's next piece. It would
    miss its deadline there: it goes first. Else, due before `head_deadline` (the head's, where it
    can still meet it: `meetable`) and leaving the head time to meet it after `w`, it is planned to
    end by `planned_deadline`: judged by its deadline alone, a call would wait out the head's rest
    whenever it just fits, answered at the edge of its objective, and any overrun would make it
    miss. Due after the head, by its deadline alone (earliest deadline first)."""
    assert w.deadline is not None
    if now + w.jct > w.deadline:
        return False  # late already: not urgent (`decide`'s late rule)
    behind = now + whole + w.jct
    if behind > w.deadline:
        return True
    if head_deadline is not None and (w.deadline >= head_deadline or now + w.jct + whole > head_deadline):
        return False
    return behind > planned_deadline(w.arrival, w.deadline, w.jct)


def choose_piece(
    now: float, split: HitSplit, urgent: Sequence[Urgent], jct: JCTModel, block_tokens: int, margin: float = 0.0
) -> int:
    """Tokens of the head to compute now: all of its misses (no yield), a block-aligned piece, or 0
    (yield before starting). `split`: the head's hits and misses now; `urgent`: in deadline order,
    only requests that can still meet their deadline when run at once; `margin`: a piece is planned
    as taking (1 + margin) x its predicted time."""
    miss = split.num_miss_tokens
    if not urgent or miss <= block_tokens:
        return miss

    def seconds(p: int) -> float:
        return (1.0 + margin) * jct.piece_seconds(split, p)

    if fits(now, seconds(miss), urgent):
        return miss
    return largest_feasible(block_tokens, _longest_piece(split, block_tokens), lambda p: fits(now, seconds(p), urgent))


def fixed_piece(split: HitSplit, piece_tokens: int, block_tokens: int) -> int:
    """`fixed`: `piece_tokens` rounded down to blocks (at least one), or all misses if fewer."""
    miss = split.num_miss_tokens
    piece = max(block_tokens, piece_tokens // block_tokens * block_tokens)
    longest = _longest_piece(split, block_tokens)
    return miss if piece >= miss or longest < block_tokens else min(piece, longest)


def _longest_piece(split: HitSplit, block_tokens: int) -> int:
    """The longest piece that is not the last: the last holds the final token (its logits), so a
    piece before it ends on the last block boundary before that token."""
    return (split.num_tokens - 1) // block_tokens * block_tokens - split.num_hit_tokens


@dataclass(slots=True, frozen=True)
class PieceChoice:
    """Compute `num_tokens` of the head now and let it wait again; or, with `take`, run that
    urgent request first and let the head wait before it starts."""

    num_tokens: int | None = None
    take: str | None = None


class PiecePolicy:
    """Whether the head of a one-request batch runs whole, in a piece, or waits for an urgent one
    (`scheduler.pieces`), from the objectives seen lately and the JCT model's piece times."""

    def __init__(self, config: SchedulerConfig, block_tokens: int, jct: JCTModel, stats: PieceStats) -> None:
        self.config = config
        self.block_tokens = block_tokens
        self.jct = jct
        self.stats = stats
        self._objectives: deque[tuple[float, float, float]] = deque()  # (arrival, objective s, predicted s)

    def saw(self, arrival: float, slo_seconds: float, jct: float) -> None:
        """A request with an objective arrived (requests like it may arrive during a long prefill)."""
        self._objectives.append((arrival, slo_seconds, jct))
        while self._objectives and self._objectives[0][0] < arrival - HORIZON_S:
            self._objectives.popleft()

    def _anticipated(self, now: float) -> tuple[Urgent, float] | None:
        """One request arriving now with the tightest slack seen lately, planned to wait at most
        ARRIVAL_SLACK_SHARE of it (a lost cause's: see the module's docstring; but not one whose
        objective no request could meet, a quarter of it below a one-block request's predicted
        time), with the tightest objective among those seen; None when no objective was seen in
        HORIZON_S."""
        cheapest = self.jct.predict(HitSplit(0, 0, self.block_tokens))
        slack = [
            (slo - jct, jct, slo) if jct < slo else (slo * (1 - LOST_CAUSE_SHARE), slo * LOST_CAUSE_SHARE, slo)
            for t, slo, jct in self._objectives
            if t >= now - HORIZON_S and (jct < slo or slo * LOST_CAUSE_SHARE >= cheapest)
        ]
        if not slack:
            return None
        least, jct, _ = min(slack)
        return Urgent("(an arrival)", now + ARRIVAL_SLACK_SHARE * least + jct, jct), min(s[2] for s in slack)

    def decide(
        self,
        d: Decision,
        by_deadline: Callable[[], list[Waiting]],
        now: float,
        others: Callable[[], Sequence[Waiting]] = tuple,
    ) -> PieceChoice | None:
        """Whether the head of a one-request batch yields (`scheduler.pieces`); None: it runs whole.
        `by_deadline`: the waiting requests with a deadline, earliest first; `now`: the scheduler's
        clock; `others`: the other waiting requests that run alone (long work whose deadlines the
        head's yields must leave room for, `_room`), asked only where needed."""
        sc, bt, w, jct = self.config, self.block_tokens, d.waiting, self.jct
        split = w.split
        if sc.pieces == "never" or split.num_miss_tokens <= bt:
            return None
        if sc.pieces == "fixed":  # a baseline: always in pieces (as chunked prefill), no bound needed
            n = fixed_piece(split, sc.piece_tokens, bt)
            choice = PieceChoice(n) if n < split.num_miss_tokens else None
        elif not self._may_yield(w, now, others):
            return None  # yielding on would make it or another long request miss, or it yielded long enough
        else:
            whole = self.rest(w)
            waiting = [(u, Urgent(u.request_id, u.deadline, u.jct)) for u in by_deadline() if u.deadline is not None]
            own = meetable(now, whole, w.deadline)
            urgent = [v for u, v in waiting if urgent_behind(now, whole, u, own)]
            # Already late and shorter than the head's rest: it goes first, unless hopeless ones wait (defer_late).
            late_first = sc.policy != "fcfs" and not sc.defer_late
            late = [v for _, v in waiting if now + v.jct > v.deadline and v.jct < whole] if late_first else []
            arrival, tightest = self._anticipated(now) or (None, math.inf)
            if w.deadline is not None and w.deadline - w.arrival <= tightest + 1e-6:
                arrival = None  # a call as tight as those anticipated: a real one is not cut for a guess
            if not urgent and late:  # missed already and shorter than the long one's rest: it goes first
                n, urgent = 0, late[:1]
            elif urgent:  # they go first: a piece cut to their deadlines would spend their slack on it
                n = 0
            elif arrival is None:
                return None
            else:  # only an anticipated arrival: never a wait, never a piece mostly overhead
                n = max(choose_piece(now, split, [arrival], jct, bt, PIECE_MARGIN), self._least_piece(split))
            choice = PieceChoice(take=urgent[0].request_id) if n == 0 else PieceChoice(n)
            if n >= split.num_miss_tokens:
                return None
        if choice is not None and w.yield_until is None:  # its delay is bounded from its first yield on (deadline)
            w.yield_until = now + (1 + sc.max_yield_delay) * w.jct
        if choice is not None and choice.take is not None:
            self.stats.num_deferrals += 1
        return choice

    def yields(self, w: Waiting, now: float, others: Callable[[], Sequence[Waiting]] = tuple) -> bool:
        """Whether `w`, at the head of a one-request batch at `now`, would yield to a waiting request
        that would end past its planned end behind it (`decide`, `urgent_behind`): cut by
        deadlines, with more than a block to compute, and allowed to (`_may_yield`, beside
        `others()`; `Scheduler._lets_go_first` adds what the waiting request must be)."""
        if self.config.pieces != "deadline" or w.split.num_miss_tokens <= self.block_tokens:
            return False
        return self._may_yield(w, now, others)

    def _may_yield(self, w: Waiting, now: float, others: Callable[[], Sequence[Waiting]]) -> bool:
        """Whether the head `w` may yield at `now`: within its bounded delay ((1 + max_yield_delay) x
        its predicted time from its first yield), or past it with a deadline of its own it can still
        meet; and either way only while the deadlines leave room (`_room`). A head that misses its
        own deadline even if it runs at once is bounded by its delay alone: yielding costs it nothing."""
        rest = self.rest(w)
        own = meetable(now, rest, w.deadline)
        within = w.warm or w.yield_until is None or now < w.yield_until  # no one waits for a warm-up
        return (within or own is not None) and self._room(now, rest, own, others)

    def _room(self, now: float, whole: float, own: float | None, others: Callable[[], Sequence[Waiting]]) -> bool:
        """Whether the deadlines leave a head of predicted rest `whole` room to yield: its rest, then
        those of the other long requests waiting with a deadline (`others()`: those that can still
        meet theirs and would not go before the head's next piece themselves) in deadline order,
        each taking (1 + max_yield_delay) x its predicted rest from `now`, all end by their deadlines
        (`own`: the head's, if it can meet one). The head runs first once it stops yielding, so the
        others wait behind it: a head that yields until its own deadline comes close, or for its
        whole bounded delay, would otherwise leave a long request due soon after it too little time.
        Those that go before the head's next piece (`urgent_behind`) delay the head and the rest:
        their stretched rests count first."""
        stretch = 1 + self.config.max_yield_delay
        t = now + stretch * whole
        rests = []
        for x in others():
            if x.deadline is None or now + (rest := self.rest(x)) > x.deadline:
                continue  # no deadline, or none it can meet
            if urgent_behind(now, whole, x, own):
                t += stretch * rest
            else:
                rests.append((x.deadline, x.seq, rest))
        if own is not None and t > own:
            return False
        for deadline, _, rest in sorted(rests):
            t += stretch * rest
            if t > deadline:
                return False
        return True

    def rest(self, w: Waiting) -> float:
        """The predicted seconds of what `w` has left to compute, in one pass."""
        return self.jct.piece_seconds(w.split, w.split.num_miss_tokens)

    def _least_piece(self, split: HitSplit) -> int:
        """The smallest block-aligned piece that costs PIECE_OVERHEAD_SHARE times its fixed part."""
        jct, bt = self.jct, self.block_tokens
        floor = PIECE_OVERHEAD_SHARE * jct.piece_seconds(split, 0)
        below = largest_feasible(bt, split.num_miss_tokens, lambda p: jct.piece_seconds(split, p) < floor)
        return below + bt
