"""Seeded traces of the paper's workloads, as token ids of the model's own tokenizer.

Every generator is deterministic for its parameters (the seed included), makes lengths exact, and
draws token ids uniformly from the tokenizer's ordinary (non-special) tokens; a user's profile
starts with its own random tokens, so users share no prefix unless the trace says so. A trace is
written and read as one JSON file (`Trace.write` / `Trace.read`) holding its kind, its parameters
and its requests in arrival order.

- `post_recommendation`: U users x P candidate posts. A request is the user's profile, one post
  and the question; profile lengths ~ Normal(mean, sd) clipped to [min, max] (the paper: 14,000
  ± 3,000, 11K-17K tokens), posts ~`post_tokens` (the paper: ~150). Requests of all users are
  interleaved in a seeded random order. `scale` multiplies the profile lengths (and their sd,
  min, max) so the trace runs on a small machine.
- `credit_verification`: one long request per user (the paper: 40K-60K tokens, uniform), nothing
  shared across users. `scale` as above.
- `revisit`: post recommendation in `rounds`: every user comes once per round (all their posts,
  interleaved with other users' within the round), with new posts each round. Between a user's
  visits, all other users come: with a device tier that holds only a fraction of the profiles,
  a returning user's profile has left the device, and only a host tier still has it.
- `visits`: what a recommendation service receives, one HTTP call per user visit. Each visit is
  one user (drawn from a Zipf law over `users`: popular users return, most others come once or
  never) and `posts` prompts, each the user's profile + a fresh post + the question; profiles as
  in post recommendation but without a default `scale` (~1,800 tokens). A request carries its
  visit's index (`visit`); the requests of one visit are consecutive. Arrival times are not part
  of the trace: the benchmark draws them (Poisson) per visit.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


class BenchError(ValueError):
    """A benchmark's input is wrong (the message names it)."""


QUESTION_TOKENS = 12  # "Would this user click on this post? Answer Yes or No:" in the paper's prompt


@dataclass(slots=True)
class TraceRequest:
    request_id: str
    user: int
    token_ids: list[int]
    prefix_tokens: int = 0  # the part shared with the user's other requests (its profile)
    visit: int = -1  # `visits` traces: which visit (one HTTP call) the request belongs to; -1 elsewhere


@dataclass(slots=True)
class Trace:
    kind: str
    params: dict[str, Any]
    requests: list[TraceRequest] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.requests)

    @property
    def max_tokens(self) -> int:
        return max(len(r.token_ids) for r in self.requests)

    def describe(self) -> str:
        lengths = [len(r.token_ids) for r in self.requests]
        users = len({r.user for r in self.requests})
        visits = len({r.visit for r in self.requests if r.visit >= 0})
        return (
            f"{self.kind}: {len(self)} requests from {users} users{f' in {visits} visits' if visits else ''}, "
            f"{min(lengths)}-{max(lengths)} tokens (mean {sum(lengths) / len(lengths):.0f})"
        )

    def write(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        doc = {"kind": self.kind, "params": self.params, "requests": [asdict(r) for r in self.requests]}
        Path(path).write_text(json.dumps(doc) + "\n")

    @classmethod
    def read(cls, path: str | Path) -> Trace:
        try:
            doc = json.loads(Path(path).read_text())
            return cls(doc["kind"], doc["params"], [TraceRequest(**r) for r in doc["requests"]])
        except FileNotFoundError:
            raise BenchError(f"trace file '{path}' does not exist") from None
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise BenchError(
                f"trace file '{path}' is not a trace written by `python -m benchmarks trace`: {exc}"
            ) from None


def ordinary_token_ids(model_dir: str | Path) -> list[int]:
    """The tokenizer's token ids that are not special tokens (BOS, EOS, chat markers)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    special = set(tok.all_special_ids) | {i for t, i in tok.get_vocab().items() if t.startswith("<|")}
    return sorted(i for i in tok.get_vocab().values() if i not in special)


class _Draw:
    def __init__(self, vocab: list[int], seed: int) -> None:
        self.vocab, self.rng = vocab, random.Random(seed)

    def tokens(self, n: int) -> list[int]:
        return self.rng.choices(self.vocab, k=n)

    def normal_length(self, mean: float, sd: float, lo: float, hi: float) -> int:
        return int(round(min(hi, max(lo, self.rng.gauss(mean, sd)))))

    def profiles(self, users: int, mean: int, sd: int, lo: int, hi: int, scale: float) -> list[list[int]]:
        """One profile per user, lengths ~ Normal(mean, sd) clipped to [lo, hi], all times `scale`."""
        ok = 0 < scale and lo <= mean <= hi and sd >= 0
        _check(ok, "need scale > 0, profile_min <= mean <= profile_max, sd >= 0")
        lengths = [self.normal_length(mean * scale, sd * scale, lo * scale, hi * scale) for _ in range(users)]
        return [self.tokens(n) for n in lengths]

    def post(self, mean_tokens: int) -> list[int]:
        """A candidate post: ~Normal(mean, mean / 10) tokens, at least one."""
        return self.tokens(max(1, int(round(self.rng.gauss(mean_tokens, mean_tokens / 10)))))


@dataclass(frozen=True, slots=True)
class PostRecommendationOptions:
    """The shape of a `post_recommendation` trace (lengths in tokens; the profiles' before `scale`)."""

    users: int = 16
    posts: int = 8  # candidate posts per user
    profile_mean: int = 14000
    profile_sd: int = 3000
    profile_min: int = 11000  # the profile lengths' clip
    profile_max: int = 17000
    post_tokens: int = 150  # mean post length (sd 10%; not scaled)
    scale: float = 1.0  # multiplies the profile lengths (and their sd, min, max)
    seed: int = 0


@dataclass(frozen=True, slots=True)
class RevisitOptions:
    """The shape of a `revisit` trace (lengths in tokens; the profiles' before `scale`)."""

    users: int = 16
    posts: int = 4  # candidate posts per user per round
    rounds: int = 2  # visits per user
    profile_mean: int = 14000
    profile_sd: int = 3000
    profile_min: int = 11000  # the profile lengths' clip
    profile_max: int = 17000
    post_tokens: int = 150  # mean post length (sd 10%; not scaled)
    scale: float = 1.0  # multiplies the profile lengths (and their sd, min, max)
    seed: int = 0


@dataclass(frozen=True, slots=True)
class VisitsTraceOptions:
    """The shape of a `visits` trace (lengths in tokens; the profiles' before `scale`)."""

    users: int = 64
    visits: int = 256  # visits in all, users drawn by `zipf`
    posts: int = 8  # prompts per visit
    profile_mean: int = 1800
    profile_sd: int = 300
    profile_min: int = 1200  # the profile lengths' clip
    profile_max: int = 2400
    post_tokens: int = 150  # mean post length (sd 10%; not scaled)
    zipf: float = 1.1  # user u comes with probability proportional to 1 / (u + 1)^zipf
    scale: float = 1.0  # multiplies the profile lengths (and their sd, min, max)
    seed: int = 0


def post_recommendation(vocab: list[int], opts: PostRecommendationOptions = PostRecommendationOptions()) -> Trace:
    """One visit per user: `revisit` with a single round."""
    t = revisit(vocab, RevisitOptions(rounds=1, **asdict(opts)))
    del t.params["rounds"]
    return Trace("post_recommendation", t.params, t.requests)


def revisit(vocab: list[int], opts: RevisitOptions = RevisitOptions()) -> Trace:
    """Post recommendation in `opts.rounds`: every user once per round, with new posts each round."""
    params = asdict(opts)
    _check(opts.users >= 1 and opts.posts >= 1 and opts.rounds >= 1, "users, posts and rounds must be >= 1")
    d = _Draw(vocab, opts.seed)
    profiles = d.profiles(
        opts.users, opts.profile_mean, opts.profile_sd, opts.profile_min, opts.profile_max, opts.scale
    )
    question = d.tokens(QUESTION_TOKENS)
    requests = []
    for r in range(opts.rounds):
        batch = []
        for u in range(opts.users):
            for p in range(opts.posts):
                ids = profiles[u] + d.post(opts.post_tokens) + question
                batch.append(TraceRequest(f"r{r}-u{u}-p{p}", u, ids, len(profiles[u])))
        d.rng.shuffle(batch)
        requests += batch
    return Trace("revisit", params, requests)


def visits(vocab: list[int], opts: VisitsTraceOptions = VisitsTraceOptions()) -> Trace:
    """`opts.visits` visits; user u (0 = most popular) comes with probability proportional to 1 / (u + 1)^zipf.

    A finite Zipf law, so any exponent >= 0 works (0: uniform). With the defaults, the 5 most popular
    of 64 users make about half of the visits (54% expected), and a dozen users never come."""
    params = asdict(opts)
    _check(opts.users >= 1 and opts.visits >= 1 and opts.posts >= 1, "users, visits and posts must be >= 1")
    _check(opts.zipf >= 0, f"the Zipf exponent must be >= 0, got {opts.zipf}")
    d = _Draw(vocab, opts.seed)
    profiles = d.profiles(
        opts.users, opts.profile_mean, opts.profile_sd, opts.profile_min, opts.profile_max, opts.scale
    )
    question = d.tokens(QUESTION_TOKENS)
    who = d.rng.choices(range(opts.users), [1 / (u + 1) ** opts.zipf for u in range(opts.users)], k=opts.visits)
    requests = []
    for v, u in enumerate(who):
        for p in range(opts.posts):
            ids = profiles[u] + d.post(opts.post_tokens) + question
            requests.append(TraceRequest(f"v{v}-u{u}-p{p}", u, ids, len(profiles[u]), v))
    return Trace("visits", params, requests)


def credit_verification(
    vocab: list[int],
    users: int = 16,
    min_tokens: int = 40000,
    max_tokens: int = 60000,
    scale: float = 1.0,
    seed: int = 0,
) -> Trace:
    _check(users >= 1 and 1 <= min_tokens <= max_tokens and scale > 0, "need users >= 1, 1 <= min <= max, scale > 0")
    params = {"users": users, "min_tokens": min_tokens, "max_tokens": max_tokens, "scale": scale, "seed": seed}
    d = _Draw(vocab, seed)
    requests = []
    for u in range(users):
        n = max(1, int(round(d.rng.uniform(min_tokens, max_tokens) * scale)))
        requests.append(TraceRequest(f"u{u}", u, d.tokens(n), 0))
    return Trace("credit_verification", params, requests)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise BenchError(message)


KINDS = {
    "post_recommendation": post_recommendation,
    "credit_verification": credit_verification,
    "revisit": revisit,
    "visits": visits,
}
