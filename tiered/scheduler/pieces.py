"""How much of a long request to compute now (SLOWeave's chunk choice, for prefill-only work).

A request that runs alone may compute its new tokens in block-aligned pieces over several steps:
after a piece, its KV is parked in the tiers and the request goes back to the queue (keeping its
arrival and its place), to resume as a request whose prefix is cached. Between pieces, waiting
requests with deadlines run.

`deadline`: when no waiting request would miss its deadline behind the whole request, it runs
in one piece, as without pieces. Otherwise the piece is the largest block-aligned size whose
predicted time still lets the most urgent waiting requests (in deadline order, each after the
ones before it) finish by their deadlines: a binary search over sizes, valid because the piece
time the JCT model predicts is monotone in the piece's tokens (`JCTModel.piece_seconds`). When
not even one block fits, the request yields before starting and the most urgent one runs; so
does a request already past its deadline that is shorter than the long one's rest (not under
`fcfs`: there only the urgent go ahead).
`fixed`: pieces of `piece_tokens` (rounded to blocks), deadlines or not. `never`: one piece.

A request stops yielding once it has spent (1 + max_yield_delay) x its predicted time alone since
its first piece started: its delay is bounded whatever keeps arriving.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tiered.offload.request import HitSplit
from tiered.scheduler.jct import JCTModel


@dataclass(slots=True, frozen=True)
class Urgent:
    """A waiting request that would miss its deadline behind the running one."""

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


def choose_piece(now: float, split: HitSplit, urgent: Sequence[Urgent], jct: JCTModel, block_tokens: int) -> int:
    """Tokens of the head to compute now: all of its misses (no yield), a block-aligned piece, or 0
    (yield before starting). `split`: the head's hits and misses now; `urgent`: in deadline order,
    only requests that can still meet their deadline when run at once."""
    miss = split.num_miss_tokens
    if not urgent or miss <= block_tokens:
        return miss

    def seconds(p: int) -> float:
        return jct.piece_seconds(split, p)

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
