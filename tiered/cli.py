"""`tiered` command line: run the main job, make embedded models, run benchmarks."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from pathlib import Path
from typing import Any

from tiered import __version__
from tiered.api.serve_options import add_serve_args
from tiered.config import Config, ConfigError, load_config
from tiered.config.options import DEFAULT_CONFIG, add_config_args, add_pipeline_args, config_from_args, resolve_device

log = logging.getLogger("tiered")


def cmd_run(args: argparse.Namespace) -> int:
    """The main job: score one user profile against candidate posts (P(label) per post).

    Every post is a request whose prompt starts with the profile, submitted to `tiered.Engine`
    together, as a scoring call's items are: the engine batches them into one forward in which
    the first computes the profile once for all (its other requests "share" it) and hands the
    profile's blocks to the tiers, where a second call of the same posts finds them."""
    import torch
    from transformers import AutoTokenizer

    from tiered.embedded import resolve_model_path
    from tiered.engine import Engine
    from tiered.request.score import ScoreParams

    cfg = config_from_args(args)
    folder = resolve_model_path(cfg.model.path, cfg.model.models_dir)
    example = json.loads(
        (Path(args.prompts) if args.prompts else Path(__file__).parent / "data" / "examples.json").read_text()
    )
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    labels = example["labels"]
    label_ids = tuple(tokenizer.encode(label, add_special_tokens=False)[0] for label in labels)
    prompts = [tokenizer.encode(example["profile"] + "\n" + post + example["question"]) for post in example["posts"]]
    for i, ids in enumerate(prompts):
        if len(ids) > cfg.model.max_model_len:
            raise ConfigError(f"post {i}: {len(ids)} tokens > model.max_model_len {cfg.model.max_model_len}")
    header = "  ".join(f"P({label.strip()})" for label in labels)
    print(
        f"{'call':>4}  {'#':>2}  {'tokens':>6}  {'device hit':>10}  {'host hit':>8}  {'shared':>6}  {'computed':>8}  "
        f"{'batch':>5}  {'ms':>7}  {header}  post"
    )
    with Engine(cfg) as engine:
        # Two calls with the same posts: the first computes the profile, the second finds it cached.
        for call in (1, 2):
            order = {engine.submit(ids, ScoreParams(logprob_token_ids=label_ids)): i for i, ids in enumerate(prompts)}
            for r in sorted(engine.run(), key=lambda r: order[r.request_id]):
                i = order[r.request_id]
                probs = torch.tensor([r.logprobs[t] for t in label_ids]).softmax(0)  # over the labels
                cols = "  ".join(
                    f"{p:>{len(lab.strip()) + 3}.3f}" for p, lab in zip(probs.tolist(), labels, strict=True)
                )
                split = r.split
                computed = split.num_miss_tokens - r.num_shared_tokens
                print(
                    f"{call:>4}  {i:>2}  {split.num_tokens:>6}  {split.num_device_hit_tokens:>10}  "
                    f"{split.num_host_hit_tokens:>8}  {r.num_shared_tokens:>6}  {computed:>8}  {r.batch_size:>5}  "
                    f"{1e3 * r.latency_seconds:>7.1f}  {cols}  {example['posts'][i][:50]}"
                )
    return 0


def cmd_make_model(args: argparse.Namespace) -> int:
    """`tiered make-model`: write a seeded embedded checkpoint to `--out`."""
    from tiered.embedded import make_model

    out = make_model(args.name, args.out)
    print(f"wrote {args.name} to {out}")
    return 0


def cmd_make_adapter(args: argparse.Namespace) -> int:
    """`tiered make-adapter`: write a seeded LoRA adapter for `--model` to `--out`."""
    from tiered.embedded import make_adapter, resolve_model_path

    model_dir = resolve_model_path(args.model, args.models_dir)
    targets = tuple(t for t in args.targets.split(",") if t)
    try:
        out = make_adapter(
            model_dir,
            args.out,
            rank=args.rank,
            alpha=args.alpha,
            targets=targets,
            use_rslora=args.rslora,
            seed=args.seed,
        )
    except ValueError as exc:
        raise ConfigError(f"--targets: {exc}") from None
    print(f"wrote a rank-{args.rank} LoRA adapter of {model_dir} ({', '.join(targets)}) to {out}")
    return 0


def serve_replicas(cfg: Config, args: argparse.Namespace, app_kwargs: dict[str, Any]) -> int:
    """`tiered serve --replicas N`: the app on Ray Serve (tiered.cluster.deploy)."""
    from tiered.logs import setup as setup_logging

    try:
        from tiered.cluster.deploy import serve_until_stopped
    except ImportError as exc:
        raise ConfigError(f"--replicas needs Ray Serve: pip install 'tiered[ray]' ({exc})") from None
    setup_logging()
    serve_until_stopped(cfg, args.host, args.port, app_kwargs)
    return 0


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def cmd_serve(args: argparse.Namespace) -> int:
    """An OpenAI-compatible HTTP server: the API process here, the engine in a child process."""
    import uvicorn

    from tiered.api.engine_client import EngineClient, served_config
    from tiered.api.serve_options import (
        api_key,
        chat_template,
        check_adapters,
        check_local_disk,
        check_model,
        serve_overrides,
        served_model_names,
    )
    from tiered.logs import uvicorn_config

    path = args.config or (DEFAULT_CONFIG if DEFAULT_CONFIG.exists() else None)
    cfg = load_config(path, list(args.overrides) + serve_overrides(args))  # flags win over the YAML and --set
    engine = None
    previous = signal.getsignal(signal.SIGTERM)
    if cfg.cluster.replicas <= 1 and not cfg.cluster.address:
        # The engine process starts now and imports its modules while this process checks the
        # options; it loads nothing until the checks pass, so a bad option is still one line here
        # and never a traceback from the engine. It then loads the model while this process builds
        # the HTTP app. Until uvicorn takes the signals over, SIGTERM stops both (as Ctrl-C does).
        engine = EngineClient(served_config(cfg))
        engine.spawn(hold=True)
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        from tiered.hybrid.spill import check_spill

        resolve_device(cfg.device)
        check_model(cfg)
        check_adapters(cfg)
        check_local_disk(cfg)
        check_spill(cfg.forward)
        app_kwargs: dict[str, Any] = {
            "api_key": api_key(args),
            "served_model_names": served_model_names(args, cfg),
            "chat_template": chat_template(args.chat_template),
            "return_tokens_as_token_ids": args.return_tokens_as_token_ids,
        }
        if engine is None:
            return serve_replicas(cfg, args, app_kwargs)
        engine.release()
        from tiered.api.app import build_app

        app = build_app(cfg, client=engine, **app_kwargs)
    except BaseException:
        if engine is not None:
            engine.stop()
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        log_config=uvicorn_config(args.uvicorn_log_level),
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The `tiered` argument parser: the run, serve, make-model and make-adapter subcommands."""
    from tiered.embedded import SHAPES

    p = argparse.ArgumentParser(prog="tiered", description="A prefill-only LLM inference engine with tiered KV.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.add_argument("--version", action="version", version=f"tiered {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser(
        "run",
        help="main job: score the bundled example (profile x posts) on the configured model",
        description="Score one user profile against candidate posts through the engine (tiered.Engine), in two "
        "calls of the same posts, and print per post: its hit split (device, host), the tokens another post of its "
        "batch computed for it (shared), what it computed, its batch size, its latency and P(label) per label.",
    )
    add_config_args(run)
    add_pipeline_args(run)
    run.add_argument("--prompts", help="JSON file shaped like tiered/data/examples.json (default: the bundled one)")
    run.set_defaults(func=cmd_run)

    serve = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (completions, chat, vLLM and SGLang scoring)",
        description="Start the API process (FastAPI + uvicorn: tokenizes and validates) and the engine process "
        "(ZMQ + msgpack). Routes: POST /v1/completions, /v1/chat/completions, /generative_scoring "
        "(= /v1/generative-scores, vLLM's shape), /v1/score (SGLang's shape), /tokenize, /detokenize; GET "
        "/v1/models, /version, /health (200 once the engine serves, 503 while it starts or restarts), /metrics "
        "(Prometheus, tiered: prefix; open without the API key unless server.metrics_require_key); the API key "
        "guards /v1/... and /generative_scoring only. max_tokens must be 1 (prefill-only); stream=true is refused "
        "with a 400 (one token, one response). vLLM's extras are honoured: logprob_token_ids, "
        "return_tokens_as_token_ids, allowed_token_ids, logit_bias, priority (lower runs first), cache_salt (KV "
        "shared only within a salt), add_special_tokens; an X-Request-Id header is echoed and names the response. "
        "An unknown model is a 404. Errors use OpenAI's envelope. "
        "Limits: server.request_timeout_s (504), server.max_body_bytes (413), scheduler.max_waiting (429); a dead "
        "engine process is restarted (server.restart_engine). SIGINT/SIGTERM stop both processes.",
    )
    serve.add_argument(
        "model",
        nargs="?",
        help="HF checkpoint folder or embedded:NAME (default: the config's); "
        "served under this name as given unless --served-model-name",
    )
    add_config_args(serve)
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
        "make-adapter",
        help="write a seeded LoRA adapter (PEFT format) for a checkpoint",
        description="Write adapter_config.json + adapter_model.safetensors, as PEFT saves them, with seeded random "
        "A and B (PEFT starts B at zero, a no-op): for trying --enable-lora without a trained adapter.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ma.add_argument("--model", default="embedded:tiny", help="HF checkpoint folder or embedded:NAME")
    ma.add_argument("--models-dir", default=".models", help="where embedded:NAME models are made")
    ma.add_argument("--out", required=True, help="output folder (created)")
    ma.add_argument("--rank", type=int, default=8, help="LoRA rank r")
    ma.add_argument("--alpha", type=float, default=16.0, help="lora_alpha (scale alpha / r)")
    ma.add_argument(
        "--targets",
        default="q_proj,v_proj",
        help="comma-separated, from q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj",
    )
    ma.add_argument("--rslora", action="store_true", help="use_rslora: scale alpha / sqrt(r)")
    ma.add_argument("--seed", type=int, default=0)
    ma.set_defaults(func=cmd_make_adapter)

    return p


def main(argv: list[str] | None = None) -> int:
    """Parse `argv`, set up logging and run the chosen subcommand; a user error prints and returns 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    from tiered.logs import setup as setup_logging

    setup_logging(logging.DEBUG if args.verbose else logging.INFO)
    try:
        return int(args.func(args))
    except Exception as exc:
        if not isinstance(exc, _user_errors()):
            raise
        print(f"tiered: error: {exc}", file=sys.stderr)
        return 2


def _user_errors() -> tuple[type[Exception], ...]:
    """The errors a command reports in one line. The model's and the forward's are taken from
    their modules only where those are loaded (they are, if one was raised): importing them here
    would load torch before `serve` starts its engine process."""
    errors: list[type[Exception]] = [ConfigError, FileNotFoundError]
    for module, name in (("tiered.hybrid.loader", "ModelLoadError"), ("tiered.hybrid.forward", "ForwardInputError")):
        if module in sys.modules:
            errors.append(getattr(sys.modules[module], name))
    return tuple(errors)


if __name__ == "__main__":
    sys.exit(main())
