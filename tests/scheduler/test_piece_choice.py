"""The chunk choice (scheduler/pieces.py): binary search, deadline feasibility, monotone piece times."""

from __future__ import annotations

import random

import pytest

from tiered.request.tokens import HitSplit
from tiered.scheduler.jct import JCTModel
from tiered.scheduler.pieces import Urgent, choose_piece, fits, fixed_piece, largest_feasible

BT = 16


@pytest.mark.parametrize("seed", range(20))
def test_largest_feasible_is_the_largest_block_multiple_a_monotone_predicate_allows(seed: int) -> None:
    rng = random.Random(seed)
    hi = rng.randrange(0, 5000)
    limit = rng.randrange(-100, 5100)
    calls: list[int] = []

    def feasible(p: int) -> bool:
        calls.append(p)
        return p <= limit

    got = largest_feasible(BT, hi, feasible)
    want = max([p for p in range(BT, hi + 1, BT) if p <= limit], default=0)
    assert got == want
    assert all(p % BT == 0 and BT <= p <= hi for p in calls) and len(calls) <= (hi // BT).bit_length() + 1


@pytest.mark.parametrize("seed", range(30))
def test_piece_seconds_is_monotone_in_tokens_whatever_the_fit(seed: int) -> None:
    """The binary search needs it: fits with negative per-token or attention terms included."""
    rng = random.Random(seed)
    jct = JCTModel(
        [
            rng.uniform(-0.1, 0.1),
            rng.uniform(-1e-3, 1e-3),
            rng.uniform(-1e-7, 1e-7),
            rng.uniform(-1e-4, 1e-4),
            rng.uniform(-1e-4, 1e-4),
            0.0,
        ]
    )
    split = HitSplit(rng.randrange(0, 4) * 256, rng.randrange(0, 4) * 256, 8192)
    times = [jct.piece_seconds(split, p) for p in range(0, 8193, 64)]
    assert all(a <= b for a, b in zip(times, times[1:], strict=False))


def test_the_chosen_piece_is_the_largest_that_lets_every_urgent_request_meet_its_deadline() -> None:
    jct = JCTModel([0.0, 1e-3])  # 1 ms per computed token
    split = HitSplit(0, 0, 10_000)  # 10 s alone
    urgent = [Urgent("a", deadline=3.0, jct=0.5), Urgent("b", deadline=4.0, jct=1.0)]
    # a after a piece of p tokens: p/1000 + 0.5 <= 3 -> p <= 2500; b: p/1000 + 1.5 <= 4 -> p <= 2500
    p = choose_piece(0.0, split, urgent, jct, BT)
    assert p == 2496 and fits(0.0, jct.piece_seconds(split, p), urgent)
    assert not fits(0.0, jct.piece_seconds(split, p + BT), urgent)
    assert choose_piece(0.0, split, [], jct, BT) == 10_000  # nothing urgent: one piece
    assert choose_piece(0.0, split, [Urgent("c", 20.0, 1.0)], jct, BT) == 10_000  # it fits behind the whole
    assert choose_piece(0.0, split, [Urgent("d", 0.505, 0.5)], jct, BT) == 0  # not one block fits: yield first
    cached = HitSplit(4096, 0, 1000)  # a piece never takes the last token: it ends on a block boundary
    assert choose_piece(0.0, cached, [Urgent("e", 0.9, 0.0)], jct, BT) == 896
    # planned 10% longer than predicted: a piece that overruns by that much still lets them meet theirs
    p = choose_piece(0.0, split, urgent, jct, BT, margin=0.1)
    assert p == 2272 and fits(0.0, 1.1 * jct.piece_seconds(split, p), urgent)
    assert not fits(0.0, 1.1 * jct.piece_seconds(split, p + BT), urgent)


def test_fixed_pieces_are_block_multiples_and_leave_the_last_token() -> None:
    assert fixed_piece(HitSplit(0, 0, 300), 64, BT) == 64
    assert fixed_piece(HitSplit(0, 0, 300), 70, BT) == 64
    assert fixed_piece(HitSplit(0, 0, 50), 64, BT) == 50
    assert fixed_piece(HitSplit(256, 0, 64), 64, BT) == 64  # no more than one piece's worth: all of it
    assert fixed_piece(HitSplit(256, 0, 65), 64, BT) == 64  # 256 + 64 = 320 leaves the last token
