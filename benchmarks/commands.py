"""What each `python -m benchmarks ...` subcommand runs (its parser is in `benchmarks/cli.py`). Each command
imports what it runs, so importing this module imports no torch."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tiered.config import Config
from tiered.config.options import config_from_args, resolve_device

if TYPE_CHECKING:
    from benchmarks.traces import Trace


def _add_model_args(parser: argparse.ArgumentParser, default_model: str) -> None:
    """--model, --models-dir, --dtype, --device: what a benchmark that loads one model takes."""
    parser.add_argument("--model", default=default_model, help="HF checkpoint folder or embedded:NAME")
    parser.add_argument("--models-dir", default=".models", help="where embedded:NAME models are made")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="compute precision (auto: the checkpoint's dtype where this machine computes it natively, else float32)",
    )
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")


def _compute_dtype(args: argparse.Namespace, folder: Path) -> str:
    """--dtype resolved as the engine resolves model.dtype (tiered/hybrid/precision.py)."""
    from tiered.hybrid.precision import precision_for

    precision = precision_for(args.dtype, "auto", folder, resolve_device(args.device))
    print(f"precision: {precision.describe()}")
    return precision.compute


def cmd_bench_mil(args: argparse.Namespace) -> int:
    from benchmarks.mil import ForwardSetup, MilOptions, run_mil_bench
    from tiered.embedded import resolve_model_path

    folder = resolve_model_path(args.model, args.models_dir)
    setup = ForwardSetup(str(folder), _compute_dtype(args, folder), resolve_device(args.device), args.chunk_tokens)
    opts = MilOptions(
        budget_bytes=args.budget,
        json_path=args.json,
        modes=args.modes,
        lengths=args.lengths,
        resolution=args.resolution,
        start_tokens=args.start_tokens,
        max_tokens=args.max_tokens,
        repeats=args.repeats,
        skip_mil=args.skip_mil,
        skip_throughput=args.skip_throughput,
    )
    run_mil_bench(setup, opts)
    return 0


def cmd_bench_batch(args: argparse.Namespace) -> int:
    from benchmarks.batch import BatchOptions, run_batch_bench
    from tiered.embedded import resolve_model_path

    folder = resolve_model_path(args.model, args.models_dir)
    dtype = _compute_dtype(args, folder)
    opts = BatchOptions(
        model_dir=str(folder),
        dtype=dtype,
        device=resolve_device(args.device),
        json_path=args.json,
        num_requests=args.requests,
        new_tokens=args.new_tokens,
        prefix_tokens=args.prefix_tokens,
        hit_new_tokens=args.hit_new_tokens,
        chunk_tokens=args.chunk_tokens,
        repeats=args.repeats,
        attention=args.attention,
    )
    run_batch_bench(opts)
    return 0


def cmd_bench_tiers(args: argparse.Namespace) -> int:
    from benchmarks.tiers import TiersOptions, bench_config, run_tiers_bench
    from tiered.embedded import resolve_model_path

    folder = resolve_model_path(args.model, args.models_dir)
    longest = max(*args.lengths, args.profile_tokens + args.post_tokens) + 1
    cfg = bench_config(
        str(folder), _compute_dtype(args, folder), resolve_device(args.device), args.block_tokens, longest, args.disk
    )
    opts = TiersOptions(
        lengths=args.lengths,
        users=args.users,
        profile_tokens=args.profile_tokens,
        post_tokens=args.post_tokens,
        rounds=args.rounds,
        device_fraction=args.device_fraction,
        repeats=args.repeats,
        json_path=args.json,
        sequence_repeats=args.sequence_repeats,
    )
    run_tiers_bench(cfg, opts)
    return 0


def cmd_bench_policies(args: argparse.Namespace) -> int:
    from benchmarks.policies import PoliciesOptions, run_policies_bench

    cfg = config_from_args(args)
    opts = PoliciesOptions(
        policies=args.policies,
        users=args.users,
        posts=args.posts,
        profile_mean=args.profile_mean,
        profile_sd=args.profile_sd,
        post_tokens=args.post_tokens,
        device_fraction=args.device_fraction,
        depths=args.depths,
        repeats=args.repeats,
        load=args.load,
        json_path=args.json,
    )
    run_policies_bench(cfg, opts)
    return 0


def _trace_from_args(args: argparse.Namespace, cfg: Config) -> Trace:
    from benchmarks import traces
    from tiered.embedded import resolve_model_path

    if getattr(args, "trace", None):
        return traces.Trace.read(args.trace)
    vocab = traces.ordinary_token_ids(resolve_model_path(cfg.model.path, cfg.model.models_dir))
    common = {"scale": args.scale, "seed": args.seed}
    profile = {
        "profile_mean": args.profile_mean,
        "profile_sd": args.profile_sd,
        "profile_min": args.profile_min,
        "profile_max": args.profile_max,
        "post_tokens": args.post_tokens,
    }
    if args.kind == "post_recommendation":
        post = traces.PostRecommendationOptions(args.users, args.posts, **profile, **common)
        return traces.post_recommendation(vocab, post)
    if args.kind == "revisit":
        revisit = traces.RevisitOptions(args.users, args.posts, args.rounds, **profile, **common)
        return traces.revisit(vocab, revisit)
    if args.kind == "visits":
        visits = traces.VisitsTraceOptions(args.users, args.visits, args.posts, **profile, zipf=args.zipf, **common)
        return traces.visits(vocab, visits)
    return traces.credit_verification(vocab, args.users, args.min_tokens, args.max_tokens, **common)


def cmd_bench_trace(args: argparse.Namespace) -> int:
    trace = _trace_from_args(args, config_from_args(args))
    trace.write(args.out)
    print(f"{trace.describe()} -> {args.out}")
    return 0


def cmd_bench_load(args: argparse.Namespace) -> int:
    from benchmarks.load import LoadOptions, run_load_bench
    from benchmarks.plots import plot_load

    cfg = config_from_args(args)
    trace = _trace_from_args(args, cfg)
    out_dir = Path(args.plots or "benchmarks/out/load")
    opts = LoadOptions(
        systems=args.systems,
        multiples=args.multiples,
        device_fraction=args.device_fraction,
        vllm_python=args.vllm_python,
        slo_p99=args.slo_p99,
        slo_mean=args.slo_mean,
        seed=args.seed,
        json_path=args.json,
        out_dir=out_dir,
        repeats=args.repeats,
    )
    doc = run_load_bench(cfg, trace, opts)
    for path in plot_load(doc, out_dir):
        print(f"wrote {path}")
    return 0


def cmd_plot_working_set(args: argparse.Namespace) -> int:
    """`python -m benchmarks plot-working-set`: visits/s against the working set, one point per JSON."""
    import json

    from benchmarks.plots import plot_working_set
    from benchmarks.traces import BenchError

    docs = []
    for name in args.json_files:
        doc = json.loads(Path(name).read_text())
        if "profiles_bytes" not in doc:
            raise BenchError(
                f"{name} is not a `python -m benchmarks visits` JSON with its profiles' KV (profiles_bytes)"
            )
        docs.append(doc)
    print(f"wrote {plot_working_set(docs, args.out)}")
    return 0


def cmd_plot_visit_loads(args: argparse.Namespace) -> int:
    """`python -m benchmarks plot-visit-loads`: visit latency against load, from the load runs of one or
    more visits JSONs of one trace (each run's summary read from the records kept beside its JSON)."""
    import gzip
    import json

    from benchmarks.plots import plot_visit_loads
    from benchmarks.report import machine_name, records_path_of
    from benchmarks.traces import BenchError

    runs: list[tuple[dict[str, Any], list[dict[str, Any]]]] = []
    for name in args.json_files:
        doc = json.loads(Path(name).read_text())
        if doc.get("bench") != "visits":
            raise BenchError(f"{name} is not a `python -m benchmarks visits` JSON")
        if runs and (doc["trace"], doc["load_of"]) != (runs[0][0]["trace"], runs[0][0]["load_of"]):
            raise BenchError(
                f"{name} ran another trace or scaled its loads by another system than {args.json_files[0]}: "
                "plot runs of one trace and one --load-of together"
            )
        if runs and machine_name(doc["provenance"]) != machine_name(runs[0][0]["provenance"]):
            raise BenchError(f"{name} ran on another machine than {args.json_files[0]}: plot one machine's runs")
        records = records_path_of(name)
        if not records.is_file():
            raise BenchError(f"{name}: its per-request records ({records}) are not beside it")
        with gzip.open(records, "rt") as f:
            loads = json.load(f)["runs"]
        if not loads:
            raise BenchError(f"{name} has no load runs (it ran at saturation only)")
        runs.append((doc, loads))
    print(f"wrote {plot_visit_loads(runs, args.out)}")
    return 0


def cmd_plot_mixed(args: argparse.Namespace) -> int:
    """`python -m benchmarks plot-mixed`: the calls in time and latencies of one mixed JSON against load."""
    import json

    from benchmarks.plots import plot_goodput
    from benchmarks.traces import BenchError

    (name,) = args.json_files
    doc = json.loads(Path(name).read_text())
    if doc.get("bench") != "mixed":
        raise BenchError(f"{name} is not a `python -m benchmarks mixed` JSON")
    print(f"wrote {plot_goodput(doc, args.out)}")
    return 0


def cmd_plot_longest(args: argparse.Namespace) -> int:
    """`python -m benchmarks plot-longest`: every budget of the JSONs on one figure."""
    import json

    from benchmarks.plots import plot_longest
    from benchmarks.traces import BenchError

    docs = [json.loads(Path(name).read_text()) for name in args.json_files]
    for name, doc in zip(args.json_files, docs, strict=True):
        if doc.get("bench") != "longest":
            raise BenchError(f"{name} is not a `python -m benchmarks longest` JSON")
    by_budget = {b["budget_bytes"]: b for doc in docs for b in doc["budgets"]}
    merged = {**docs[-1], "budgets": list(by_budget.values())}
    print(f"wrote {plot_longest(merged, args.out)}")
    return 0


def cmd_bench_plot(args: argparse.Namespace) -> int:
    from benchmarks.plots import plot_load

    for path in plot_load(args.json_file, args.out):
        print(f"wrote {path}")
    return 0


def cmd_bench_soak(args: argparse.Namespace) -> int:
    from benchmarks.soak import SoakOptions, run_soak
    from tiered.config import with_overrides

    pressure = [
        f"cache.device_tier_bytes={args.device_tier_bytes}",
        f"cache.block_tokens={args.block_tokens}",
        f"cache.host.lmcache={{max_local_cpu_size: {args.host_tier_gb}}}",
    ]
    cfg = with_overrides(config_from_args(args), pressure)
    opts = SoakOptions(
        minutes=args.minutes,
        concurrency=args.concurrency,
        invalid_fraction=args.invalid_fraction,
        users=args.users,
        profile_tokens=args.profile_tokens,
        out_dir=Path(args.out_dir),
        json_path=args.json,
    )
    report = run_soak(cfg, opts)
    ok = report["exactly_once"] and report["server_errors_5xx"] == 0 and report["idle_pinned_blocks"] == 0
    ok = ok and report["rss_ok"] and not report["valid_failures"]
    return 0 if ok else 1


def cmd_bench_visits(args: argparse.Namespace) -> int:
    from benchmarks.plots import plot_load, plot_saturation
    from benchmarks.visits import VisitsOptions, run_visits_bench

    cfg = config_from_args(args)
    trace = _trace_from_args(args, cfg)
    out_dir = Path(args.plots or "benchmarks/out/visits")
    opts = VisitsOptions(
        systems=args.systems,
        multiples=args.multiples,
        concurrency=args.concurrency,
        repeats=args.repeats,
        peer_first=args.peer_first,
        warm_up_visits=args.warm_up_visits,
        load_of=args.load_of,
        vllm_python=args.vllm_python,
        slo_p99=args.slo_p99,
        slo_mean=args.slo_mean,
        seed=args.seed,
        json_path=args.json,
        out_dir=out_dir,
        profile_dir=args.profile_dir,
        memory_limit_bytes=args.memory_limit,
        base_tree=args.base_tree,
    )
    doc = run_visits_bench(cfg, trace, opts)
    print(f"wrote {plot_saturation(doc, out_dir / 'saturation.png')}")
    if not doc["summaries"]:  # saturation runs only: no latency against load to plot
        return 0
    for path in plot_load(doc, out_dir):
        print(f"wrote {path}")
    return 0


def cmd_bench_mixed(args: argparse.Namespace) -> int:
    from benchmarks.mixed import MixedOptions, run_mixed_bench
    from benchmarks.mixed_trace import MixedParams
    from benchmarks.plots import plot_goodput

    params = MixedParams(
        args.short_slo_ms,
        args.long_tokens,
        args.long_per_minute,
        args.long_slo_ms,
        None if args.calls is not None else args.minutes,
        args.calls,
        args.users,
        args.posts,
        args.profile_tokens,
        args.post_tokens,
        args.zipf,
        args.alone_repeats,
        args.seed,
    )
    out_dir = Path(args.plots or "benchmarks/out/mixed")
    opts = MixedOptions(
        systems=args.systems,
        short_qps=args.short_qps,
        vllm_python=args.vllm_python,
        json_path=args.json,
        out_dir=out_dir,
        repeats=args.repeats,
        base_tree=args.base_tree,
    )
    doc = run_mixed_bench(config_from_args(args), params, opts)
    print(f"wrote {plot_goodput(doc, out_dir / 'goodput.png')}")
    return 0


def _add_trace_args(p: argparse.ArgumentParser, kind_positional: bool) -> None:
    from benchmarks.traces import KINDS

    kinds = list(KINDS)
    if kind_positional:
        p.add_argument("kind", choices=kinds, help="which workload")
    else:
        p.add_argument(
            "--trace",
            default=None,
            help="a trace file written by `python -m benchmarks trace` (else one is "
            "generated from --kind and the options below)",
        )
        p.add_argument("--kind", choices=kinds, default="post_recommendation", help="workload to generate")
    g = p.add_argument_group("trace parameters (lengths in tokens, before --scale)")
    g.add_argument("--users", type=int, default=16, help="distinct users (profiles / credit histories)")
    g.add_argument("--posts", type=int, default=8, help="candidate posts per user per visit")
    g.add_argument("--rounds", type=int, default=2, help="revisit: visits per user")
    g.add_argument("--visits", type=int, default=256, help="visits: visits in all (users drawn by --zipf)")
    g.add_argument("--zipf", type=float, default=1.1, help="visits: user u comes with probability ~ 1/(u+1)^zipf")
    g.add_argument("--profile-mean", type=int, default=14000, help="profile length mean (paper: 14000)")
    g.add_argument("--profile-sd", type=int, default=3000, help="profile length sd (paper: 3000)")
    g.add_argument("--profile-min", type=int, default=11000, help="profile length lower clip (paper: 11000)")
    g.add_argument("--profile-max", type=int, default=17000, help="profile length upper clip (paper: 17000)")
    g.add_argument("--post-tokens", type=int, default=150, help="mean post length (sd 10%%; not scaled)")
    g.add_argument("--min-tokens", type=int, default=40000, help="credit verification: shortest request")
    g.add_argument("--max-tokens", type=int, default=60000, help="credit verification: longest request")
    g.add_argument("--scale", type=float, default=0.125, help="multiplies profile / credit lengths (1 = the paper's)")
    g.add_argument("--seed", type=int, default=0, help="seeds the trace and the Poisson arrivals")


def cmd_bench_server(args: argparse.Namespace) -> int:
    from benchmarks.server import run_server_bench

    run_server_bench(config_from_args(args), args.config, args.overrides, args.requests, args.tokens, args.json)
    return 0


def cmd_bench_startup(args: argparse.Namespace) -> int:
    from benchmarks.server import run_startup_bench
    from benchmarks.traces import BenchError

    if args.starts < 1:
        raise BenchError(f"--starts must be >= 1, not {args.starts}")
    run_startup_bench(args.config, args.overrides, args.starts, args.base_tree, args.json)
    return 0


def cmd_bench_precision(args: argparse.Namespace) -> int:
    from benchmarks.kernels import run_precision_bench

    run_precision_bench(resolve_device(args.device), args.json)
    return 0


def cmd_bench_attention(args: argparse.Namespace) -> int:
    from benchmarks.kernels import AttentionOptions, run_attention_bench
    from tiered.embedded import resolve_model_path

    folder = resolve_model_path(args.model, args.models_dir)
    kernels = args.kernels.split(",") if args.kernels else None
    opts = AttentionOptions(
        model_dir=str(folder),
        dtype_name=_compute_dtype(args, folder),
        device=resolve_device(args.device),
        kernels=kernels,
        max_tokens=args.max_tokens,
        json_path=args.json,
        vllm_library=args.vllm_library,
        window=args.window,
        prefix_layouts=tuple(args.prefix.split(",")),
        block_tokens=args.block_tokens,
    )
    run_attention_bench(opts)
    return 0


def cmd_bench_report(args: argparse.Namespace) -> int:
    from benchmarks.report import write_tables

    # RESULTS.md holds every machine's rows; the README a summary of the newest machine's.
    targets = [(Path(args.results_md), "", False), (Path(args.readme), "benchmarks/", True)]
    for target, _, _ in targets:
        if not target.exists():
            raise SystemExit(f"python -m benchmarks report: {target} does not exist")
    results = Path(args.results)
    prefixes = [(path, f"{prefix}{results.name}/", summary) for path, prefix, summary in targets]
    stale = write_tables(prefixes, results, check=args.check)
    for path in stale:
        print(f"{path}: {'differs from the generated table' if args.check else 'table rewritten'}")
    if not stale:
        print("the results tables are up to date")
    return 1 if args.check and stale else 0


def cmd_bench_alone(args: argparse.Namespace) -> int:
    from benchmarks.alone import AloneOptions, run_alone_bench

    opts = AloneOptions(
        systems=args.systems,
        tokens=args.tokens,
        repeats=args.repeats,
        seed=args.seed,
        vllm_python=args.vllm_python,
        json_path=args.json,
        out_dir=Path(args.out_dir),
    )
    run_alone_bench(config_from_args(args), opts)
    return 0


def cmd_bench_rerank(args: argparse.Namespace) -> int:
    from benchmarks.rerank import RerankOptions, run_rerank_bench
    from benchmarks.traces import BenchError

    if len(args.doc_tokens) != 2 or args.doc_tokens[0] > args.doc_tokens[1]:
        raise BenchError(f"--doc-tokens takes LO,HI with LO <= HI; got {args.doc_tokens}")
    lo, hi = args.doc_tokens
    labels = tuple(args.labels.split(","))
    if len(labels) != 2 or not all(labels):
        raise BenchError(f"--labels takes two words, NEGATIVE,POSITIVE; got {args.labels!r}")
    opts = RerankOptions(
        vllm_python=args.vllm_python or None,
        systems=tuple(s for s in args.systems.split(",") if s),
        calls=args.calls,
        documents=args.documents,
        doc_tokens=(lo, hi),
        query_tokens=args.query_tokens,
        instruction_tokens=args.instruction_tokens,
        labels=(labels[0], labels[1]),
        multiples=tuple(args.multiples),
        load_of=args.load_of,
        repeats=args.repeats,
        seed=args.seed,
        json_path=args.json,
        out_dir=Path(args.out_dir),
    )
    doc = run_rerank_bench(config_from_args(args), opts)
    for row in doc["headline"]:
        r = row["ratio"]
        print(f"{row['measure']}: {r['median']:.2f}x ({r['min']:.2f}-{r['max']:.2f}, {row['ratio_is']})")
    return 0


def cmd_bench_longest(args: argparse.Namespace) -> int:
    from benchmarks.longest import LongestOptions, run_longest_bench

    opts = LongestOptions(
        budgets=args.budgets,
        vllm_python=args.vllm_python or None,
        resolution=args.resolution,
        seed=args.seed,
        json_path=args.json,
        out_dir=Path(args.out_dir),
        plot_path=Path(args.plot) if args.plot else None,
        repeats=args.repeats,
        answer_max_tokens=args.answer_max_tokens,
        time_at_peer_length=args.time_at_peer_length,
        memory_limit_bytes=args.memory_limit if args.memory_limit != "peer" else None,
        limit_of_peer=args.memory_limit == "peer",
        ours_max_tokens=args.ours_max_tokens,
    )
    run_longest_bench(config_from_args(args), opts)
    return 0
