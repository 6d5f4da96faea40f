"""What one engine step is: the scheduler's answer (`Step`: the requests it names, each with its
blocks allocated and pinned), what running it produced (`StepOutput`), and the counters of
prefills that yield. The executor runs a `Step`; the scheduler applies its output."""

from __future__ import annotations

from dataclasses import dataclass, field

from tiered.request.plan import Prepared
from tiered.request.score import DEFAULT_PARAMS, Result, ScoreParams
from tiered.request.tokens import HitSplit, TierRequest


@dataclass(slots=True)
class Waiting:
    """A request from its arrival until it is picked: the one entry the engine keeps for it."""

    request: TierRequest
    seq: int  # arrival order: fcfs's score and every policy's tie-break
    arrival: float
    split: HitSplit  # estimated against the tiers, re-estimated when its blocks move
    jct: float
    version: int = 0  # heap entries of an older version are stale
    priority: int = 0
    params: ScoreParams = DEFAULT_PARAMS  # what to return (logprobs, the chosen token)
    deadline: float | None = None  # arrival + its latency objective (monotonic seconds)
    # The last moment (monotonic) the deadline's prediction had it in time (admission, the shed
    # checks): a shed request's refusal is timed from it. None: never checked.
    in_time_at: float | None = None
    # Between the pieces of a request that yields (scheduler/pieces.py): pieces done, its hits
    # before the first, device blocks held for it, and until when it may yield again.
    num_pieces: int = 0
    first_split: HitSplit | None = None
    parked: list[int] = field(default_factory=list)
    yield_until: float | None = None
    # A warm-up (`Scheduler._warm`): an unmeetable call's prompt, computed at the lowest priority
    # for the calls that follow; no one waits for its answer.
    warm: bool = False

    @property
    def request_id(self) -> str:
        """The request's id."""
        return self.request.request_id


@dataclass(slots=True)
class Decision:
    """What `pick` chose and what it expected."""

    waiting: Waiting
    predicted_jct: float
    decision_seconds: float
    num_rescored: int = 0
    queue_depth: int = 0


@dataclass(slots=True, frozen=True)
class StepLimits:
    """What bounds a step (config `scheduler.*`, `model.max_model_len`, `lora.max_loras`)."""

    max_batch_tokens: int = 0  # computed tokens per forward; 0: one request per forward
    max_model_len: int = 1 << 30  # computed tokens plus the longest cached prefix
    max_adapters: int = 0  # distinct LoRA adapters per batch; 0: no bound
    prefetch: bool = True  # start loading the next pick's host-resident prefix
    drop_expired: bool = False  # fail waiting requests whose deadline passed
    defer_late: bool = True  # requests that can no longer meet their deadline wait behind those that can
    shed_late: bool = False  # ... or are refused at once (`scheduler.late: shed`)
    max_predicted_wait: float = 0.0  # admission control: seconds of predicted wait; 0: no cap
    warm_unmeetable: int = 0  # warm-ups of unmeetable calls' prefixes queued at once; 0: none
    # Index a batch's retained blocks when it is scheduled, not when it ends: a runner with several
    # batches in flight computes them in order, so a later batch reads them after they are written.
    index_at_launch: bool = False


class Refused(Exception):
    """A call refused when it arrives, and why (`reason`): `deadline` (429: its objective cannot be
    met behind the work queued, `scheduler.late: shed`), `unmeetable` (its own predicted time
    exceeds its objective, however idle the machine: 429 while caching its prefix can help, 400 when
    nothing can) or `wait_cap` (503: the predicted wait is over `scheduler.max_predicted_wait_s`).
    `retry_after`: seconds until a retry is predicted to find room (the work queued ahead of it
    done, or its prefix warmed); None where no retry is predicted to help."""

    def __init__(self, status: int, message: str, retry_after: float | None, reason: str = "deadline") -> None:
        super().__init__(message)
        self.status, self.retry_after, self.reason = status, retry_after, reason


@dataclass(slots=True)
class Step:
    """One step, as the scheduler decided it (vLLM v1's SchedulerOutput, for prefill-only work).

    `batch`: the requests of one forward, head first; `prepared[i]`: `batch[i]`'s blocks by id, as
    the scheduler allocated and pinned them (its cached prefix, loaded from the host tier where it
    was there, the blocks its computed tokens fill, the chunks it stores). `piece_tokens`: the head
    (alone) computes only this many of its tokens (its `prepared` request is cut there), parks
    their KV and waits again; None: every request runs whole.
    `prefetch`: a waiting request whose host-resident prefix starts loading now. `expired`:
    requests taken out because their deadline passed (`scheduler.drop_expired`). `shed`: requests
    taken out because they are predicted to miss their deadline (`scheduler.late: shed`), answered
    before the forward starts; `retry_after`: the predicted seconds until the work now queued is
    done (their Retry-After). `predicted_seconds`: the JCT model's time for this step's forward
    (the batch's, or the piece's), what a call arriving while it runs waits at least. `started`:
    when the step began preparing its batch (its requests' queueing ends there; loads and the
    forward are counted apart).
    `waiting_keys`: block keys of the requests still waiting (the tiers keep those).
    `num_parked_blocks`: device blocks the waiting requests hold between their pieces (counted
    only for a piece)."""

    batch: list[Decision] = field(default_factory=list)
    prepared: list[Prepared] = field(default_factory=list)
    piece_tokens: int | None = None
    prefetch: TierRequest | None = None
    expired: list[Waiting] = field(default_factory=list)
    waiting_keys: set[int] = field(default_factory=set)
    num_parked_blocks: int = 0
    shed: list[Waiting] = field(default_factory=list)
    retry_after: float = 0.0
    predicted_seconds: float = 0.0
    started: float = 0.0  # time.monotonic() before its blocks were allocated: its requests' wait ends here
    # Keys of the blocks cached once it has run (its prefixes, kept and stored blocks); filled only
    # where admission control or shedding reads them.
    kept_keys: frozenset[int] = frozenset()

    @property
    def adapters(self) -> list[str]:
        """The LoRA adapters (identities) the batch computes with."""
        return [a for d in self.batch if (a := d.waiting.request.adapter) is not None]


@dataclass(slots=True)
class StepOutput:
    """What a step produced (the executor's answer to a `Step`), for the scheduler to apply in one
    place (`Scheduler.update_from_output`): answers (and failures); prepared requests whose
    forward ended (`finished`: their retained blocks to index, pins to release, chunks to store)
    or that never ran (`aborted`); requests that left with blocks parked for them (`released`);
    each forward's hit splits and seconds, for the JCT model (`observed`); the head whose piece
    ran (`piece_head`: its KV to park, then it waits again); requests to wait again as they were
    (`requeue`: the batches a runner gave back to retry); and whether the host tier's contents
    were lost with a runner's workers (`host_lost`)."""

    results: list[Result] = field(default_factory=list)
    finished: list[Prepared] = field(default_factory=list)
    aborted: list[Prepared] = field(default_factory=list)
    released: list[Waiting] = field(default_factory=list)
    observed: list[tuple[list[HitSplit], float]] = field(default_factory=list)
    piece_head: Waiting | None = None
    requeue: list[Waiting] = field(default_factory=list)
    host_lost: bool = False


@dataclass(slots=True)
class PieceStats:
    """Counters of prefills that yield (the metrics' `pieces_*`)."""

    num_pieces: int = 0  # pieces that ended in a yield
    num_deferrals: int = 0  # heads that waited before starting, an urgent request ahead
    parked_device_bytes: int = 0  # KV of finished pieces held on the device for their request
    parked_host_bytes: int = 0  # ... and left to the host tier (no room on the device, or over the cap)
