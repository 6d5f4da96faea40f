"""`python -m benchmarks stages`: pipeline stages measured on this machine.

The same visits (Zipf users, each visit a profile + `posts` posts, every prompt queued at once:
saturation; or in --rounds of consecutive visits, each queued once the previous is answered)
through one engine after another, in this process: `1xN` (one process, N threads: the machine's
cores) and `Sx1-<schedule>` (S stage processes of N / S threads each: `fill-drain` or
`waves-M[-flightK]`, M micro-batches per batch, K batches in the pipe at once). Per system:
visits/s, computed tokens/s, each stage's bubble fraction (1 - its busy seconds / the seconds
the pipe held a batch) and the error of its JCT model per micro-batch, the max |logprob - the
first system's| over every prompt, and the tokens that came from the host tier. Every engine
runs with the same device tier and with `cache.suffix: discard`; a name ending in `+host` runs
with `offload` (the host tier: LMCache in this process, or in every stage), which matters when
the device tier is too small for the users' profiles (--set cache.device_tier_bytes=...).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import time
from typing import Any

from benchmarks.traces import BenchError
from tiered.config.options import add_config_args

log = logging.getLogger(__name__)

SYSTEM = re.compile(
    r"^(?:1x(?P<threads>\d+)|(?P<stages>\d+)x(?P<per>\d+)-(?:(?P<fd>fill-drain)|waves-(?P<m>\d+)"
    r"(?:-flight(?P<k>\d+))?))(?P<host>\+host)?$"
)


def system_overrides(name: str) -> list[str]:
    """The config keys a system name sets (BenchError naming it when it is not of a known form)."""
    m = SYSTEM.match(name)
    if m is None:
        raise BenchError(
            f"--systems: '{name}' is not 1xN, SxN-fill-drain or SxN-waves-M[-flightK], each optionally +host"
        )
    suffix = f"cache.suffix={'offload' if m['host'] else 'discard'}"
    if m["threads"]:
        return ["engine.pipeline_stages=1", f"engine.threads={m['threads']}", suffix]
    out = [f"engine.pipeline_stages={m['stages']}", f"engine.threads_per_stage={m['per']}", suffix]
    if m["fd"]:
        return [*out, "engine.pipeline_schedule=fill-drain"]
    out += ["engine.pipeline_schedule=waves", f"engine.pipeline_microbatches={m['m']}"]
    return [*out, f"engine.pipeline_batches_in_flight={m['k']}"] if m["k"] else out


def _config_path(args: argparse.Namespace) -> Any:
    from tiered.config.options import DEFAULT_CONFIG

    return args.config or (DEFAULT_CONFIG if DEFAULT_CONFIG.exists() else None)


def _run_system(args: argparse.Namespace, name: str, requests: list[Any]) -> dict[str, Any]:
    from tiered.config import load_config
    from tiered.engine import Engine
    from tiered.engine.pipeline.coordinator import PipelineRunner
    from tiered.request.score import ScoreParams

    cfg = load_config(_config_path(args), [*args.overrides, *system_overrides(name)])
    params = ScoreParams(logprob_token_ids=tuple(args.token_ids))
    with Engine(cfg) as engine:
        warm = engine.submit(requests[0].token_ids[: args.post_tokens], params)  # a forward of every stage
        engine.run()
        engine.tiers.clear()
        runner = engine.runner
        before = runner.stats() if isinstance(runner, PipelineRunner) else []
        forward_before = runner.forward_seconds if isinstance(runner, PipelineRunner) else 0.0
        start = time.perf_counter()
        results = []
        for batch in rounds(requests, args.rounds):  # each round queued at once, after the previous is answered
            for r in batch:
                engine.submit(r.token_ids, params, request_id=r.request_id)
            results += [res for res in engine.run() if res.request_id != warm]
        seconds = time.perf_counter() - start
        bubbles: list[float] = []
        errors: list[float | None] = []
        if isinstance(runner, PipelineRunner):
            in_forwards = runner.forward_seconds - forward_before
            bubbles = [
                1 - (a.busy_seconds - b.busy_seconds) / in_forwards for a, b in zip(runner.stats(), before, strict=True)
            ]
            errors = runner.stage_models.errors
    failed = [res.request_id for res in results if res.error]
    if failed:
        raise BenchError(f"{name}: {len(failed)} requests failed, e.g. {failed[0]}")
    computed = sum(res.split.num_miss_tokens - res.num_shared_tokens for res in results)
    visits = len({r.visit for r in requests})
    out = {
        "system": name,
        "seconds": seconds,
        "visits_per_s": visits / seconds,
        "computed_tokens": computed,
        "host_hit_tokens": sum(res.split.num_host_hit_tokens for res in results),
        "tokens_per_s": computed / seconds,
        "bubbles": bubbles,
        "stage_jct_errors": errors,
        "logprobs": {res.request_id: res.logprobs for res in results},
    }
    log.info(
        "%s: %.1f s, %.3f visits/s, %.0f computed tokens/s, bubbles %s",
        name,
        seconds,
        out["visits_per_s"],
        out["tokens_per_s"],
        ", ".join(f"{b:.0%}" for b in bubbles) or "-",
    )
    return out


def rounds(requests: list[Any], num_rounds: int) -> list[list[Any]]:
    """The requests in `num_rounds` groups of consecutive visits (as even as they divide, at most
    one round per visit), in order."""
    visits = list(dict.fromkeys(r.visit for r in requests))
    k = min(num_rounds, len(visits))
    bounds = [round(i * len(visits) / k) for i in range(k + 1)]
    round_of = {v: n for n in range(k) for v in visits[bounds[n] : bounds[n + 1]]}
    return [[r for r in requests if round_of[r.visit] == n] for n in range(k)]


def run_stages_bench(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.report import write_report
    from benchmarks.traces import VisitsTraceOptions, ordinary_token_ids, visits
    from tiered.config import load_config
    from tiered.embedded import resolve_model_path

    cfg = load_config(_config_path(args), list(args.overrides))
    vocab = ordinary_token_ids(resolve_model_path(cfg.model.path, cfg.model.models_dir))
    args.token_ids = vocab[:2]
    n = args.profile_tokens  # sd 1/6 of the mean, within 2/3 and 4/3 of it (as the visit workload)
    sd, lo, hi = (n // 6, 2 * n // 3, 4 * n // 3) if not args.exact_profiles else (0, n, n)
    trace = visits(
        vocab,
        VisitsTraceOptions(
            users=args.users,
            visits=args.visits,
            posts=args.posts,
            profile_mean=n,
            profile_sd=sd,
            profile_min=lo,
            profile_max=hi,
            post_tokens=args.post_tokens,
            zipf=args.zipf,
            seed=args.seed,
        ),
    )
    rows = [_run_system(args, name, trace.requests) for name in args.systems]
    first = rows[0]["logprobs"]
    for row in rows:
        logprobs = row.pop("logprobs")
        row["max_logprob_diff"] = max(abs(v - first[rid][t]) for rid, lp in logprobs.items() for t, v in lp.items())
        row["throughput_vs_first"] = row["visits_per_s"] / rows[0]["visits_per_s"]
    print(
        f"{os.cpu_count()} cores; {args.visits} visits x {args.posts} posts, {args.users} Zipf users, "
        f"{args.rounds} round(s)"
    )
    print(
        f"{'system':27} {'s':>7} {'visits/s':>9} {'tokens/s':>9} {'vs first':>8} {'max |dlogp|':>11} {'host hits':>9}"
        "  bubbles  stage JCT error"
    )
    for r in rows:
        print(
            f"{r['system']:27} {r['seconds']:>7.1f} {r['visits_per_s']:>9.3f} {r['tokens_per_s']:>9.0f} "
            f"{r['throughput_vs_first']:>7.2f}x {r['max_logprob_diff']:>11.1e} {r['host_hit_tokens']:>9}  "
            f"{', '.join(f'{b:.0%}' for b in r['bubbles']) or '-':8} "
            f"{', '.join('-' if e is None else f'{e:.0%}' for e in r['stage_jct_errors']) or '-'}"
        )
    return write_report(
        args.json, "stages", cfg.device, {"trace": trace.params, "rounds": args.rounds, "systems": rows}
    )


def add_parser(bsub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """`python -m benchmarks stages` (this module imports no torch at CLI start)."""
    p = bsub.add_parser(
        "stages",
        help="pipeline stages on this machine: S processes x N/S threads against one process x N",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_config_args(p)
    cores = len(os.sched_getaffinity(0))
    half = max(1, cores // 2)
    p.add_argument(
        "--systems",
        type=lambda s: s.split(","),
        default=[
            f"1x{cores}",
            f"2x{half}-fill-drain",
            f"2x{half}-waves-2-flight1",
            f"2x{half}-waves-2-flight2",
            f"2x{half}-waves-2",
        ],
        help="comma-separated: 1xN, SxN-fill-drain, SxN-waves-M[-flightK] (M micro-batches per batch, "
        "K batches in the pipe at once: default engine.pipeline_batches_in_flight), each optionally "
        "+host (cache.suffix: offload; else discard); the first is the reference",
    )
    p.add_argument("--users", type=int, default=8, help="distinct users (profiles)")
    p.add_argument("--visits", type=int, default=12, help="visits, all queued at once (see --rounds)")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="queue the visits in this many rounds of consecutive visits, each once the previous is "
        "answered (at saturation within a round): a user of a later round finds their profile "
        "evicted from a small device tier, so +host systems load it from the host tier",
    )
    p.add_argument("--posts", type=int, default=8, help="prompts per visit")
    p.add_argument("--profile-tokens", type=int, default=1800, help="mean profile length")
    p.add_argument("--post-tokens", type=int, default=150, help="mean post length")
    p.add_argument(
        "--exact-profiles",
        action="store_true",
        help="every profile exactly --profile-tokens long (a multiple of cache.block_tokens: a returning "
        "user's posts then share no uncached tail, so they are independent jobs a micro-batch cut can "
        "spread; otherwise they follow the post that computes the tail and travel as one job)",
    )
    p.add_argument("--zipf", type=float, default=1.1, help="user u comes with probability ~ 1/(u+1)^zipf")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results as JSON here")
    p.set_defaults(func=cmd_stages)


def cmd_stages(args: argparse.Namespace) -> int:
    for name in args.systems:
        system_overrides(name)
    if min(args.users, args.visits, args.posts, args.profile_tokens, args.post_tokens, args.rounds) < 1:
        raise BenchError("--users, --visits, --rounds, --posts, --profile-tokens and --post-tokens must be >= 1")
    run_stages_bench(args)
    return 0
