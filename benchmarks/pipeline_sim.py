"""A simulation of pipeline-parallel prefill under prefix reuse (WavePP), fed with the JCT model's
costs measured on this machine, to project S = 1..8 stages: throughput per device and bubbles.

The model (benchmarks/RESULTS.md, "Pipeline-parallel prefill, simulated", says it in words):
- Visits as in the visit workload: user u with probability ~ 1 / (u + 1)^zipf, `posts` prompts
  sharing the user's profile of P_u tokens, then a post. With prefix reuse, profiles are cached
  (an LRU of `cached_users` profiles, every stage holding its layers' part): a returning user's
  prompts compute only their post and read the profile; a new user's first prompt computes the
  profile and its post, the others read it (if they run after it: a prompt put in an earlier
  micro-batch than its visit's first computes the profile too). Without reuse, every prompt
  computes everything.
- A batch is `visits_per_batch` visits, cut into `microbatches` micro-batches: by count, in
  arrival order (GPipe's cut), or by cost (`tiered.engine.pipeline.waves.form_waves`).
- A stage holds 1/S of the layers. A micro-batch costs a stage (c0 + sum over its prompts of
  c1·M + c2·pairs(M, T) + c4·C) / S seconds (M computed, C cached, T = M + C tokens; the JCT
  model's terms, fitted at the engine's start on this machine), times `scale` (a device's speed
  against this CPU's), plus its activations' hop to the next stage (M x hidden x 2 bytes over
  `link_bytes_per_s`). A stage runs one micro-batch at a time, in order.
- Fill-and-drain (GPipe): a batch enters the first stage once the previous one has left the last.
  Waves: micro-batches enter the first stage as soon as it is free (batches flow back to back).
- Throughput per device is visits / span / S against one device's visits / (sum of work at
  S = 1); a stage's bubble fraction is the share of the span it sat idle.
"""

from __future__ import annotations

import argparse
import random
from collections import OrderedDict
from dataclasses import dataclass

from benchmarks.traces import BenchError
from tiered.config.options import parse_float_list, parse_int_list
from tiered.engine.pipeline.waves import Job, form_by_count, form_waves


@dataclass(frozen=True)
class StageCosts:
    """Seconds of the whole model for a forward (c0) and per token term (JCT model's c1, c2, c4)."""

    c0: float
    c1: float
    c2: float
    c4: float
    hidden_size: int
    scale: float = 1.0  # a device's time for what took this CPU one second
    link_bytes_per_s: float | None = None  # between stages; None: free

    def job_seconds(self, job: Job) -> float:
        m, c = job.num_computed_tokens, job.num_cached_tokens
        return self.c1 * m + self.c2 * m * (c + m / 2) + self.c4 * c

    def stage_seconds(self, microbatch: list[Job], stages: int) -> float:
        compute = self.scale * (self.c0 + sum(self.job_seconds(j) for j in microbatch)) / stages
        if self.link_bytes_per_s is None or stages == 1:
            return compute
        return compute + sum(j.num_computed_tokens for j in microbatch) * self.hidden_size * 2 / self.link_bytes_per_s


@dataclass(frozen=True)
class Workload:
    visits: int = 256
    users: int = 64
    zipf: float = 1.1
    posts: int = 8
    profile_tokens: int = 1800
    post_tokens: int = 170
    cached_users: int = 16  # profiles the tiers hold (LRU); 0: no prefix reuse at all
    visits_per_batch: int = 4
    seed: int = 0


@dataclass(frozen=True)
class Outcome:
    stages: int
    cut: str
    schedule: str
    reuse: bool
    span_seconds: float
    throughput_per_device: float  # against one device without a pipeline (1.0: no loss)
    bubble_fraction: float  # mean over stages
    max_bubble_fraction: float
    microbatch_imbalance: float  # mean over batches of (largest micro-batch cost / mean) - 1


def visits(w: Workload) -> list[list[Job]]:
    """Each visit's prompts as jobs (computed and cached tokens after the tiers' hits)."""
    rng = random.Random(w.seed)
    weights = [1 / (u + 1) ** w.zipf for u in range(w.users)]
    profile = [max(64, int(rng.gauss(w.profile_tokens, w.profile_tokens / 6))) for _ in range(w.users)]
    cache: OrderedDict[int, None] = OrderedDict()
    out = []
    for v in range(w.visits):
        u = rng.choices(range(w.users), weights)[0]
        hit = w.cached_users > 0 and u in cache
        jobs = []
        for i in range(w.posts):
            post = max(8, int(rng.gauss(w.post_tokens, w.post_tokens / 10)))
            if w.cached_users == 0 or (not hit and i == 0):  # computes its profile
                jobs.append(Job(f"{v}.{i}", profile[u] + post, 0))
            else:  # reads it: from the tiers, or from its visit's first prompt
                jobs.append(Job(f"{v}.{i}", post, profile[u], after=None if hit else f"{v}.0"))
        if w.cached_users > 0:
            cache[u] = None
            cache.move_to_end(u)
            while len(cache) > w.cached_users:
                cache.popitem(last=False)
        out.append(jobs)
    return out


def _leaders_first(microbatches: list[list[Job]]) -> list[list[Job]]:
    """A prompt that reads its visit's profile in a micro-batch before the one that computes it
    must compute the profile itself (the KV is not there yet)."""
    computed_at: dict[str, int] = {}
    profile_of: dict[str, int] = {}
    for m, mb in enumerate(microbatches):
        for j in mb:
            visit = j.request_id.split(".")[0]
            if j.num_cached_tokens == 0 and j.request_id.endswith(".0"):
                computed_at[visit] = m
                profile_of[visit] = j.num_computed_tokens
    out = []
    for m, mb in enumerate(microbatches):
        fixed = []
        for j in mb:
            visit = j.request_id.split(".")[0]
            if visit in computed_at and j.num_cached_tokens > 0 and m < computed_at[visit]:
                fixed.append(Job(j.request_id, j.num_computed_tokens + j.num_cached_tokens, 0))
            else:
                fixed.append(j)
        out.append(fixed)
    return out


def simulate(costs: StageCosts, w: Workload, stages: int, microbatches: int, cut: str, schedule: str) -> Outcome:
    """Run the workload's batches through `stages` stages (see the module docstring)."""
    all_visits = visits(w)
    free = [0.0] * stages  # when each stage is free
    busy = [0.0] * stages
    drained = 0.0  # fill-and-drain: when the previous batch left the last stage
    imbalance = []
    for b in range(0, len(all_visits), w.visits_per_batch):
        jobs = [j for v in all_visits[b : b + w.visits_per_batch] for j in v]
        cut_mbs = (
            form_waves(jobs, microbatches, costs.job_seconds) if cut == "waves" else form_by_count(jobs, microbatches)
        )
        mbs = _leaders_first(cut_mbs)
        loads = [sum(costs.job_seconds(j) for j in mb) for mb in mbs]
        imbalance.append(max(loads) / (sum(loads) / len(loads)) - 1)
        start_floor = drained if schedule == "gpipe" else 0.0
        for mb in mbs:
            t = start_floor
            seconds = costs.stage_seconds(mb, stages)
            for s in range(stages):
                t = max(t, free[s])
                free[s] = t + seconds
                busy[s] += seconds
                t += seconds
            drained = max(drained, t)
    span = max(free)
    batches = [
        [j for v in all_visits[b : b + w.visits_per_batch] for j in v]
        for b in range(0, len(all_visits), w.visits_per_batch)
    ]
    alone = sum(costs.stage_seconds(jobs, 1) for jobs in batches)  # one device: each batch one forward
    bubbles = [1 - bz / span for bz in busy]
    return Outcome(
        stages,
        cut,
        schedule,
        w.cached_users > 0,
        span,
        alone / span / stages,
        sum(bubbles) / stages,
        max(bubbles),
        sum(imbalance) / len(imbalance),
    )


# bench-m's JCT model as its engine fitted it at start on the AVX2 EPYC (fp32): c0, c1, c2, c4
MEASURED_COSTS = (0.0427, 0.00292, 2.6e-07, 4.16e-05)
CUTS = (("count", "gpipe"), ("waves", "gpipe"), ("count", "waves"), ("waves", "waves"))


def run_pipeline_sim(
    costs: StageCosts,
    w: Workload,
    stage_counts: list[int],
    per_stage: int,
    json_path: str | None,
    plots: str | None,
) -> dict[str, object]:
    """Every (reuse, S, cut, schedule) of the module docstring; a table, JSON and a plot."""
    from dataclasses import asdict, replace

    from benchmarks.report import write_report

    outcomes = [
        simulate(costs, replace(w, cached_users=cached), s, per_stage * s, cut, schedule)
        for cached in (w.cached_users, 0)
        for s in stage_counts
        for cut, schedule in CUTS
    ]
    print(
        f"{'reuse':<6}{'S':>3}  {'micro-batches':<14}{'schedule':<15}{'thru/device':>12}{'bubbles':>9}"
        f"{'worst stage':>12}{'imbalance':>10}"
    )
    for o in outcomes:
        print(
            f"{'yes' if o.reuse else 'no':<6}{o.stages:>3}  {'by cost' if o.cut == 'waves' else 'by count':<14}"
            f"{'continuous' if o.schedule == 'waves' else 'fill-and-drain':<15}{o.throughput_per_device:>12.3f}"
            f"{o.bubble_fraction:>9.1%}{o.max_bubble_fraction:>12.1%}{o.microbatch_imbalance:>10.2f}"
        )
    doc = write_report(
        json_path,
        "pipeline-sim",
        "simulated",
        {
            "costs": asdict(costs),
            "workload": asdict(w),
            "microbatches_per_stage": per_stage,
            "outcomes": [asdict(o) for o in outcomes],
        },
    )
    if plots:
        print(f"plot: {plot_pipeline(outcomes, plots)}")
    return doc


def plot_pipeline(outcomes: list[Outcome], out_dir: str) -> str:
    """Throughput per device and mean bubble fraction against S: naive against waves, +/- reuse."""
    from pathlib import Path

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for reuse in (True, False):
        for cut, schedule in CUTS:
            mine = [o for o in outcomes if o.reuse == reuse and o.cut == cut and o.schedule == schedule]
            label = (
                f"{'by cost' if cut == 'waves' else 'by count'}, "
                f"{'continuous' if schedule == 'waves' else 'fill-and-drain'}, {'reuse' if reuse else 'no reuse'}"
            )
            style = "-" if reuse else ":"
            axes[0].plot(
                [o.stages for o in mine], [o.throughput_per_device for o in mine], style, marker="o", label=label
            )
            axes[1].plot([o.stages for o in mine], [o.bubble_fraction for o in mine], style, marker="o", label=label)
    axes[0].set_ylabel("throughput per device (1 = one device, no pipe)")
    axes[1].set_ylabel("mean bubble fraction")
    for ax in axes:
        ax.set_xlabel("pipeline stages S")
        ax.grid(True, alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.suptitle("pipeline-parallel prefill of Zipf visits (bench-m costs measured here), simulated")
    fig.tight_layout()
    path = Path(out_dir) / "pipeline-sim.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


def add_parser(bsub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """`python -m benchmarks pipeline-sim` (this module imports no torch: it parses at CLI start)."""
    p = bsub.add_parser(
        "pipeline-sim",
        help="pipeline-parallel prefill under prefix reuse (WavePP), simulated for S stages",
        description="Zipf visits through S = --stages pipeline stages (1/S of the layers each), micro-batches cut "
        "by count (GPipe) or by the work they compute after hits (waves), fill-and-drain per batch or continuous; "
        "stage costs from the JCT model (--costs c0,c1,c2,c4: bench-m's fit on this machine by default) x "
        "--scale, plus activations over --link-gbps. Prints throughput per device (1 = one device without a "
        "pipe) and bubble fractions, with and without prefix reuse. See benchmarks/pipeline_sim.py for the model.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--stages", type=parse_int_list, default=[1, 2, 4, 8], help="stage counts to simulate")
    p.add_argument("--microbatches-per-stage", type=int, default=2, help="micro-batches per batch = this x S")
    p.add_argument("--costs", type=parse_float_list, default=list(MEASURED_COSTS), help="c0,c1,c2,c4 (seconds)")
    p.add_argument("--hidden-size", type=int, default=768, help="activation width (bench-m: 768)")
    p.add_argument("--scale", type=float, default=1.0, help="a device's seconds per second of this CPU's")
    p.add_argument("--link-gbps", type=float, default=None, help="GB/s between stages (default: free)")
    d = Workload()
    for name in (
        "visits",
        "users",
        "posts",
        "profile_tokens",
        "post_tokens",
        "cached_users",
        "visits_per_batch",
        "seed",
    ):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    p.add_argument("--zipf", type=float, default=d.zipf)
    p.add_argument("--json", default=None, help="write the outcomes as JSON here")
    p.add_argument("--plots", default=None, help="folder for pipeline-sim.png")
    p.set_defaults(func=cmd_pipeline_sim)


def cmd_pipeline_sim(args: argparse.Namespace) -> int:
    if len(args.costs) != 4 or min(args.costs) < 0:
        raise BenchError(f"--costs must be four non-negative numbers c0,c1,c2,c4, got {args.costs}")
    if args.microbatches_per_stage < 1 or args.visits_per_batch < 1 or args.visits < 1:
        raise BenchError("--microbatches-per-stage, --visits-per-batch and --visits must be >= 1")
    link = None if args.link_gbps is None else args.link_gbps * 1e9
    c0, c1, c2, c4 = args.costs
    costs = StageCosts(c0, c1, c2, c4, hidden_size=args.hidden_size, scale=args.scale, link_bytes_per_s=link)
    w = Workload(
        args.visits,
        args.users,
        args.zipf,
        args.posts,
        args.profile_tokens,
        args.post_tokens,
        args.cached_users,
        args.visits_per_batch,
        args.seed,
    )
    run_pipeline_sim(costs, w, args.stages, args.microbatches_per_stage, args.json, args.plots)
    return 0
