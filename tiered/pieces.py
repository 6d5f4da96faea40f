"""Prefills that yield: the engine's side of `scheduler/pieces.py`.

A piece is the head request cut at a block boundary, run alone with `park` (its computed blocks
stay on the device, or go to the host tier where the device lacks room); the request then waits
again with its arrival, its order and its deadline, holding pins on its parked device blocks so
they are not evicted before it resumes. Its next piece finds them as its own cached prefix
(device hits, or host loads for what went to the host tier); its last piece computes the logits
and its result reports the hits it had before its first piece.

A piece is chosen when it starts, and a forward is not preempted: a request that arrives during a
whole long prefill would wait for all of it. So `deadline` also plans for the requests likely to
arrive: the tightest slack (objective minus predicted time) among the objectives seen in the last
minute stands for one more urgent request arriving now, and a long prefill runs in pieces no
longer than that slack even when nobody waits; but never one whose fixed cost (a forward's own,
reading its prefix) is over 1 / PIECE_OVERHEAD_SHARE of it, and never under one block; nor a
request whose own objective is no looser than the anticipated one's (a short call itself: cut for a
call that may come, it paid each piece's overhead and missed its own objective).
A request already late (predicted past its deadline) does not wait for the long one's end when it
is the shorter: it runs before the next piece (earliest deadline first; not under `fcfs`), within the
long one's delay bound, so the late ones' latency (the short calls' P99) stays that of a short call.
A lost cause (predicted past its objective: a new user's call whose profile is not cached) still
announces the traffic: a like request whose prefix is cached is expected to need LOST_CAUSE_SHARE
of its objective, the rest being its slack. (Without it, with only new users' calls and the long
prompts' own loose objectives seen lately, a 16 K prompt ran in pieces of a minute.)
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Protocol

from tiered.config import Config
from tiered.offload.request import HitSplit, TierRequest
from tiered.offload.tiers import KVTiers
from tiered.scheduler.jct import JCTModel
from tiered.scheduler.pieces import Urgent, choose_piece, fixed_piece, largest_feasible
from tiered.scheduler.scheduler import Decision, Scheduler
from tiered.score import Result

log = logging.getLogger(__name__)

HORIZON_S = 60.0  # objectives seen this recently stand for the arrivals a piece must leave room for
# A piece cut for arrivals that have not happened costs at least this many times its fixed part
# (JCTModel.piece_seconds with no tokens: a step, and reading its prefix): a guess may slow the long
# request by 1 / PIECE_OVERHEAD_SHARE at most, as the JCT model prices it.
PIECE_OVERHEAD_SHARE = 5
LOST_CAUSE_SHARE = 0.25  # of a lost cause's objective: the time a like request with a cached prefix needs
# Requests between pieces hold at most this share of the device tier (their leading parked blocks)
# when a host tier has the rest: a 16 K prompt's KV filled bench-m's whole device tier, and the
# short calls meanwhile could load only the blocks left free of their cached profiles (2 of 7) and
# computed the rest: late. The rest stay cached, unheld; the next piece loads what was evicted.
PARK_DEVICE_SHARE = 0.5


class Engine(Protocol):
    """What pieces need of `tiered.Engine` (a protocol: this module does not import the engine)."""

    config: Config
    tiers: KVTiers
    jct: JCTModel
    scheduler: Scheduler

    def run_alone(self, decision: Decision, started: float, park: bool = False) -> list[Result]: ...


@dataclass(slots=True, frozen=True)
class PieceChoice:
    """Compute `num_tokens` of the head now and let it wait again; or, with `take`, run that
    urgent request first and let the head wait before it starts."""

    num_tokens: int | None = None
    take: str | None = None


class Pieces:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.num_pieces = 0  # pieces that ended in a yield
        self.num_deferrals = 0  # heads that waited before starting, an urgent request ahead
        self.parked_device_bytes = 0  # KV of finished pieces held on the device for their request
        self.parked_host_bytes = 0  # ... and left to the host tier (no room on the device, or over the cap)
        self._objectives: deque[tuple[float, float, float]] = deque()  # (arrival, objective s, predicted s)

    def saw(self, arrival: float, slo_seconds: float, jct: float) -> None:
        """A request with an objective arrived (requests like it may arrive during a long prefill)."""
        self._objectives.append((arrival, slo_seconds, jct))
        while self._objectives and self._objectives[0][0] < arrival - HORIZON_S:
            self._objectives.popleft()

    def _anticipated(self, now: float) -> tuple[Urgent, float] | None:
        """One request arriving now with the tightest slack seen lately (a lost cause's: see the
        module's docstring; but not one whose objective no request could meet, a quarter of it
        below a one-block request's predicted time), with the tightest objective among those seen; None
        when no objective was seen in HORIZON_S."""
        cheapest = self.engine.jct.predict(HitSplit(0, 0, self.engine.tiers.block_tokens))
        slack = [
            (slo - jct, jct, slo) if jct < slo else (slo * (1 - LOST_CAUSE_SHARE), slo * LOST_CAUSE_SHARE, slo)
            for t, slo, jct in self._objectives
            if t >= now - HORIZON_S and (jct < slo or slo * LOST_CAUSE_SHARE >= cheapest)
        ]
        if not slack:
            return None
        least, jct, _ = min(slack)
        return Urgent("(an arrival)", now + least + jct, jct), min(s[2] for s in slack)

    def decide(self, d: Decision) -> PieceChoice | None:
        """Whether the head of a one-request batch yields (`scheduler.pieces`); None: it runs whole."""
        e = self.engine
        sc, bt, w = e.config.scheduler, e.tiers.block_tokens, d.waiting
        split = w.split
        now = time.monotonic()
        if sc.pieces == "never" or split.num_miss_tokens <= bt:
            return None
        if sc.pieces == "fixed":  # a baseline: always in pieces (as chunked prefill), no bound needed
            n = fixed_piece(split, sc.piece_tokens, bt)
            choice = PieceChoice(n) if n < split.num_miss_tokens else None
        elif w.yield_until is not None and now >= w.yield_until:  # yielded long enough: it runs now
            return None
        else:
            whole = e.jct.piece_seconds(split, split.num_miss_tokens)
            waiting = [
                Urgent(u.request_id, u.deadline, u.jct) for u in e.scheduler.by_deadline() if u.deadline is not None
            ]
            urgent = [u for u in waiting if now + u.jct <= u.deadline < now + whole + u.jct]
            late = [u for u in waiting if now + u.jct > u.deadline and u.jct < whole] if sc.policy != "fcfs" else []
            arrival, tightest = self._anticipated(now) or (None, math.inf)
            if w.deadline is not None and w.deadline - w.arrival <= tightest + 1e-6:
                arrival = None  # a call as tight as those anticipated: a real one is not cut for a guess
            if not urgent and late:  # missed already and shorter than the long one's rest: it goes first
                n, urgent = 0, late[:1]
            elif not urgent and arrival is None:
                return None
            else:
                planned = sorted(urgent + ([arrival] if arrival is not None else []), key=lambda u: u.deadline)
                n = choose_piece(now, split, planned, e.jct, bt)
                if not urgent:  # only an anticipated arrival: never a wait, never a piece mostly overhead
                    n = max(n, self._least_piece(split))
            choice = PieceChoice(take=urgent[0].request_id) if n == 0 else PieceChoice(n)
            if n >= split.num_miss_tokens:
                return None
        if choice is not None and w.yield_until is None:  # its delay is bounded from its first yield on (deadline)
            w.yield_until = now + (1 + sc.max_yield_delay) * w.jct
        if choice is not None and choice.take is not None:
            self.num_deferrals += 1
        return choice

    def _least_piece(self, split: HitSplit) -> int:
        """The smallest block-aligned piece that costs PIECE_OVERHEAD_SHARE times its fixed part."""
        jct, bt = self.engine.jct, self.engine.tiers.block_tokens
        floor = PIECE_OVERHEAD_SHARE * jct.piece_seconds(split, 0)
        below = largest_feasible(bt, split.num_miss_tokens, lambda p: jct.piece_seconds(split, p) < floor)
        return below + bt

    def run(self, d: Decision, num_tokens: int, started: float) -> list[Result]:
        """Compute the head's next `num_tokens` (block-aligned), park them, queue the head again.
        Returns [] (the request goes on), or its failure."""
        e = self.engine
        w, bt = d.waiting, e.tiers.block_tokens
        req = w.request
        end = w.split.num_hit_tokens + num_tokens
        cut = TierRequest(req.request_id, req.token_ids[:end], req.keys[: end // bt], req.salt, req.adapter)
        failed = e.run_alone(replace(d, waiting=replace(w, request=cut, parked=[])), started, park=True)
        if failed and failed[0].error is not None:
            e.tiers.device_tier.unpin(w.parked)
            return [replace(failed[0], num_tokens=req.token_ids.numel())]
        if w.first_split is None:
            w.first_split = w.split
        w.num_pieces += 1
        dt = e.tiers.device_tier
        held = dt.match(req.keys, req.token_ids.tolist(), count=False, pin=True)
        if e.tiers.host_tier is not None:
            # Not held: cached but evictable, in the host tier (write-through) or sent there when
            # evicted (on-evict); a chunk the host tier lacks (a dropped store) is computed again.
            cap = max(0, int(dt.num_blocks * PARK_DEVICE_SHARE) - e.scheduler.num_parked_blocks())
            dt.unpin(held[cap:])
            held = held[:cap]
        dt.unpin(w.parked)
        first = w.split.num_hit_tokens // bt  # of this piece's blocks, those held on the device
        on_device = max(0, min(len(held), end // bt) - first)
        block_bytes = dt.bytes_per_block
        self.parked_device_bytes += on_device * block_bytes
        if e.tiers.host_tier is not None:
            self.parked_host_bytes += max(0, num_tokens // bt - on_device) * block_bytes
        w.parked = held
        e.scheduler.requeue(w)
        self.num_pieces += 1
        log.debug(
            "request %s yielded after piece %d (%d of %d tokens; %d blocks held on the device)",
            req.request_id,
            w.num_pieces,
            end,
            req.token_ids.numel(),
            len(held),
        )
        return []
