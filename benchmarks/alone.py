"""`python -m benchmarks alone`: one fresh long prompt on an idle server (credit verification), ours against vLLM.

Both servers run at once, started and warmed up alike (a short call and one prompt of the same
length under its own cache salt). Then, --repeats times, each system (in ABBA order) gets the same fresh
seeded prompt of --tokens under a salt of its own (vLLM's prefix cache is reset first), one at a
time, each run started only once neither server computes. Reported per system: the latency of
each run over HTTP and its tokens/s; the headline rows compare the first system with each other
one, run by run."""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.load import Call, HttpOptions, run_http
from benchmarks.report import headline_row, new_json_path, print_headline, write_report
from benchmarks.servers import Served, serve_tiered, serve_vllm, wait_quiet
from benchmarks.stats import abba
from benchmarks.systems import VISIT_TIERED_SYSTEMS, VISIT_VLLM_SYSTEMS, check_vllm_sizing
from benchmarks.traces import BenchError, ordinary_token_ids
from benchmarks.vllm import PeerOptions, VLLMServer, kv_memory_bytes, peer_launch
from tiered.config import Config, with_overrides
from tiered.config.options import resolve_device
from tiered.embedded import resolve_model_path
from tiered.hybrid.precision import config_precision

log = logging.getLogger(__name__)


@dataclass(slots=True)
class AloneOptions:
    """What `run_alone_bench` runs (the CLI's options, one to one)."""

    systems: list[str]
    tokens: int = 8192
    repeats: int = 3
    seed: int = 0
    vllm_python: str | None = None
    json_path: str | None = None
    out_dir: Path = Path("benchmarks/out/alone")


@dataclass(slots=True)
class AloneRun:
    system: str
    repeat: int
    tokens: int
    latency_seconds: float
    tokens_per_s: float


def _check(cfg: Config, opts: AloneOptions) -> None:
    # A lone prompt has no working set to size a peer by: vllm-full means nothing here.
    known = [*VISIT_TIERED_SYSTEMS, *(s for s, setup in VISIT_VLLM_SYSTEMS.items() if setup.kv != "working-set")]
    unknown = [s for s in opts.systems if s not in known]
    if unknown or not opts.systems:
        raise BenchError(f"unknown system(s) {', '.join(unknown) or '(none given)'}; known: {', '.join(known)}")
    if len(set(opts.systems)) < len(opts.systems):
        raise BenchError(f"a system is named twice in {','.join(opts.systems)}")
    if opts.tokens < 2 or opts.repeats < 1:
        raise BenchError(f"--tokens must be >= 2 and --repeats >= 1, got {opts.tokens} and {opts.repeats}")
    if any(s.startswith("vllm") for s in opts.systems):
        check_vllm_sizing(cfg, opts.vllm_python)


@contextmanager
def _serve(system: str, cfg: Config, opts: AloneOptions, warm_up: list[Call]) -> Iterator[Served]:
    if system in VISIT_TIERED_SYSTEMS:
        with serve_tiered(with_overrides(cfg, VISIT_TIERED_SYSTEMS[system]), system, opts.out_dir, warm_up) as s:
            yield s
        return
    assert opts.vllm_python is not None
    setup = VISIT_VLLM_SYSTEMS[system]
    kv = cfg.cache.device_tier_bytes if setup.kv == "device" else kv_memory_bytes(cfg)
    launch = peer_launch(cfg, opts.vllm_python, opts.tokens + 16, kv, PeerOptions(eager=setup.eager))
    with serve_vllm(VLLMServer(launch), system, opts.out_dir, warm_up) as s:
        yield s


def run_alone_bench(cfg: Config, opts: AloneOptions) -> dict[str, Any]:
    """Run the lone prompts (see the module docstring); returns the JSON document."""
    logging.getLogger("httpx").setLevel(logging.WARNING)
    _check(cfg, opts)
    model_dir = resolve_model_path(cfg.model.path, cfg.model.models_dir)
    max_len = max(cfg.model.max_model_len, opts.tokens + 16)
    cfg = replace(cfg, model=replace(cfg.model, path=str(model_dir), max_model_len=max_len))
    vocab = ordinary_token_ids(model_dir)
    rng = random.Random(opts.seed)
    prompts = [[rng.choice(vocab) for _ in range(opts.tokens)] for _ in range(opts.repeats + 1)]
    warm_up = [Call("warm-up-long", [prompts[-1]])]
    print(
        f"a lone {opts.tokens}-token prompt, {opts.repeats} runs per system; precision: "
        f"{config_precision(cfg).describe()}"
    )
    runs: list[AloneRun] = []
    launch: dict[str, dict[str, Any]] = {}
    with ExitStack() as stack:
        served = {}
        for system in opts.systems:
            served[system] = stack.enter_context(_serve(system, cfg, opts, warm_up))
            launch[system] = served[system].launch
        pids = [s.pid for s in served.values()]
        for rep in range(opts.repeats):
            for system in abba(list(served), rep):
                server = served[system]
                wait_quiet(pids)
                if server.vllm is not None:
                    server.vllm.reset()
                call = Call(f"alone-{rep}", [prompts[rep]])
                how = HttpOptions(f"{system} #{rep + 1}", cache_salt=f"alone-{system}-{rep}")
                (record,), _ = run_http(server.url, "model", [call], [0.0], how)
                if record.error is not None:
                    raise BenchError(f"{system}: the {opts.tokens}-token prompt failed: {record.error}")
                run = AloneRun(system, rep, opts.tokens, record.latency_seconds, opts.tokens / record.latency_seconds)
                runs.append(run)
                log.info("%-12s #%d: %.2f s (%.0f tokens/s)", system, rep + 1, run.latency_seconds, run.tokens_per_s)
    reference = opts.systems[0]
    mine = [r.latency_seconds for r in runs if r.system == reference]
    headline = [
        headline_row(
            f"a lone uncached {opts.tokens}-token prompt: latency",
            "s",
            (reference, mine),
            (other, [r.latency_seconds for r in runs if r.system == other]),
            higher_is_better=False,
        )
        for other in opts.systems[1:]
    ]
    print_headline(headline)
    return write_report(
        new_json_path(opts.json_path) if opts.json_path else None,
        "alone",
        resolve_device(cfg.device),
        {
            "config": asdict(cfg),
            "tokens": opts.tokens,
            "repeats": opts.repeats,
            "seed": opts.seed,
            "systems": opts.systems,
            "launch": launch,
            "kv_bytes": {"ours": kv_memory_bytes(cfg)},
            "runs": [asdict(r) for r in runs],
            "headline": headline,
        },
    )
