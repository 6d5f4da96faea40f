"""`python -m benchmarks mixed`: short calls with a tight latency objective among long uncached prompts.

The traffic (`mixed_trace.py`) goes over loopback HTTP to each system in turn, the same seeded
calls at the same times for every system, --repeats runs per offered load (--short-qps). The
first system is the reference: it stays up, and each other system runs beside it in turn, run for
run (reference, other, reference, ...), each run started once neither server computes. Every run
has its own `cache_salt` (and vLLM's prefix cache is reset): nothing is cached across runs or
systems; within a run popular users' profiles are, long prompts never. Headline rows, the
reference against each other system, run by run: with two loads or more, each one's capacity at
the objectives (`sustained_qps`: the highest load up to which 99% of the short calls, refused ones
counted as missed, and every long prompt were in time); per load, short and all calls in time per
second and the short calls' mean and P99 latency.

Per system, first: a prompt of --long-tokens alone on the idle server (fresh prompts, best of
--alone-repeats), the reference for each long call's completion time. Then per load: goodput at
the objectives per class and in all, the short calls' P50 / P99, each long call's slowdown
(`goodput.py`), and, ours, pieces per long call (`usage.tiered.num_pieces`) and the /metrics
samples on pieces, yields, parked KV and how soon shed calls were refused (`goodput.RUN_METRICS`,
after minus before the run; absent: not shown). Then `python -m benchmarks load`'s per-load table
of the short calls and their sustainable QPS at P99 / mean latency <= the short objective.

Systems (`systems.mixed_system`): `tiered` (`scheduler.pieces=deadline`: SLOWeave; calls predicted to
miss their objective refused at once, `scheduler.late: shed`), `tiered-serve-late` (the same, such calls
served late: `scheduler.late=serve`), `tiered-in-order` (served late and not deferred:
`scheduler.defer_late=false`), `tiered-base` (`tiered` served from the checkout at `--base-tree`),
`tiered-fixedN`
(pieces of N tokens whatever the deadlines), `tiered-never` (one pass); `vllm-chunkN` (chunked
prefill, --max-num-batched-tokens N), `vllm-priority-chunkN` (the same with --scheduling-policy
priority, each call's `priority` its deadline in ms: earliest deadline first), and either with `-capM`
(--long-prefill-token-threshold M: a long prefill takes at most M tokens of a step while other
requests wait; without it vLLM schedules its running prefill first, and a step's budget can go to
it whole), and then `-adaptive` (--long-prefill-token-threshold-adaptive: the cap floored at a
fair share of the step budget). Every
vLLM system runs compiled (its default) with the KV memory of our device + host tiers. Ours get
each call's objective as `slo_ms`; vLLM has no such field and gets none.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from benchmarks.goodput import RUN_METRICS, RunScore, print_goodput, score_run
from benchmarks.launch import prometheus_totals
from benchmarks.load import Call, HttpOptions, print_tables, run_http, sustainable_table
from benchmarks.mixed_trace import LONG, SHORT, MixedParams, MixedTrace, build_trace, calls_for
from benchmarks.report import headline_row, print_headline, result_paths, write_records, write_report
from benchmarks.servers import Served, serve_tiered, serve_vllm, wait_quiet
from benchmarks.stats import Record, Summary, abba, summarize
from benchmarks.systems import BASE_SYSTEM, MIXED_SYSTEM_FORMS, MixedSystem, check_vllm_sizing, mixed_system
from benchmarks.traces import BenchError, ordinary_token_ids
from benchmarks.vllm import PeerOptions, VLLMServer, peer_launch
from tiered.config import Config, with_overrides
from tiered.config.options import resolve_device
from tiered.embedded import resolve_model_path

log = logging.getLogger(__name__)


def check_options(
    cfg: Config, names: list[str], short_qps: list[float], vllm_python: str | None, base_tree: Path | None = None
) -> list[MixedSystem]:
    """The systems `names` stand for; a BenchError naming what is wrong, before anything starts."""
    systems = {name: mixed_system(name) for name in names}
    unknown = [name for name, s in systems.items() if s is None]
    if unknown or not names:
        raise BenchError(
            f"unknown system(s) {', '.join(unknown) or '(none given)'}; known: "
            f"{', '.join(MIXED_SYSTEM_FORMS)} (N, M: tokens)"
        )
    if len(systems) < len(names):
        raise BenchError(f"a system is named twice in {','.join(names)}")
    if not short_qps or min(short_qps) <= 0:
        raise BenchError(f"--short-qps needs values > 0, got {','.join(f'{q:g}' for q in short_qps) or '(none)'}")
    if any(s.is_vllm for s in systems.values() if s is not None):
        check_vllm_sizing(cfg, vllm_python)
    if BASE_SYSTEM in names and (base_tree is None or not (base_tree / "tiered").is_dir()):
        raise BenchError(f"{BASE_SYSTEM} serves the checkout at --base-tree: give a folder with tiered/ in it")
    return [s for s in systems.values() if s is not None]


@contextmanager
def _serve(system: MixedSystem, cfg: Config, opts: MixedOptions, max_len: int, out_dir: Path) -> Iterator[Served]:
    """The system's server, warmed up; a vLLM system compiled, with the KV memory of our device + host tiers."""
    vllm_python = opts.vllm_python
    if not system.is_vllm:
        tree = opts.base_tree if system.name == BASE_SYSTEM else None
        with serve_tiered(with_overrides(cfg, list(system.overrides)), system.name, out_dir, tree=tree) as served:
            yield served
        return
    assert vllm_python is not None
    peer = PeerOptions(step_tokens=system.vllm_step_tokens, extra_args=system.vllm_args)
    launch = peer_launch(cfg, vllm_python, max_len, peer=peer)
    with serve_vllm(VLLMServer(launch), system.name, out_dir) as served:
        yield served


def alone_seconds(url: str, vllm: VLLMServer | None, prompts: list[list[int]], label: str) -> float:
    """The best latency of `prompts` sent one at a time to the idle server, each with its own salt."""
    best = math.inf
    for i, prompt in enumerate(prompts):
        if vllm is not None:
            vllm.reset()
        how = HttpOptions(label, cache_salt=f"alone-{i}")
        (record,), _ = run_http(url, "model", [Call(f"alone-{i}", [prompt])], [0.0], how)
        if record.error is not None:
            raise BenchError(f"{label}: a {len(prompt)}-token prompt alone failed: {record.error}")
        best = min(best, record.latency_seconds)
    return best


def _measure(
    url: str, vllm: VLLMServer | None, calls: list[Call], trace: MixedTrace, salt: str, label: str
) -> tuple[list[Record], dict[str, float]]:
    """One run of the trace: its records, and the change of ours' piece metrics over it."""
    if vllm is not None:
        vllm.reset()
    keep = RUN_METRICS.match
    before = {} if vllm is not None else prometheus_totals(url, lambda name: bool(keep(name)))
    records, _ = run_http(
        url, "model", calls, [c.arrival_seconds for c in trace.calls], HttpOptions(label, cache_salt=salt)
    )
    after = {} if vllm is not None else prometheus_totals(url, lambda name: bool(keep(name)))
    return records, {name: value - before.get(name, 0.0) for name, value in after.items()}


def short_summary(score: RunScore, trace: MixedTrace, records: list[Record]) -> Summary:
    """The short calls as `python -m benchmarks load` sums a run up (`multiple`: the short QPS itself)."""
    short = {c.call.call_id for c in trace.of(SHORT)}
    return summarize(
        score.system,
        score.short_qps,
        score.short_qps,
        [r for r in records if r.request_id in short],
        trace.window_seconds,
    )


@dataclass(frozen=True, slots=True)
class MixedOptions:
    """What `run_mixed_bench` runs beyond the config and the traffic (the CLI's options, one to one)."""

    systems: list[str]  # the first is the reference
    short_qps: list[float]  # the offered loads: short calls/s
    vllm_python: str | None
    json_path: str | None
    out_dir: Path  # records.json, server configs and logs
    repeats: int = 1  # runs per (system, load), each system's turn by turn with the reference's
    base_tree: Path | None = None  # the checkout `tiered-base` serves


@dataclass(frozen=True, slots=True)
class _Runs:
    """Every measured run of a `bench mixed` invocation, in the order they ran."""

    scores: list[RunScore] = field(default_factory=list)
    summaries: list[Summary] = field(default_factory=list)  # each run's short calls
    documents: list[dict[str, Any]] = field(default_factory=list)  # each run's records (records.json)
    # per (other system, short QPS): (its score, the reference's beside it), per repeat
    paired: dict[tuple[str, float], list[tuple[RunScore, RunScore]]] = field(default_factory=dict)
    launch: dict[str, dict[str, Any]] = field(default_factory=dict)
    alone: dict[str, float] = field(default_factory=dict)  # seconds of a long prompt alone, per system


def run_mixed_bench(cfg: Config, params: MixedParams, opts: MixedOptions) -> dict[str, Any]:
    """Run the mixed traffic at each short QPS on each system (see the module docstring); returns the JSON document."""
    logging.getLogger("httpx").setLevel(logging.WARNING)
    short_qps, vllm_python, out_dir, repeats = opts.short_qps, opts.vllm_python, opts.out_dir, opts.repeats
    systems = check_options(cfg, opts.systems, short_qps, vllm_python, opts.base_tree)
    model_dir = resolve_model_path(cfg.model.path, cfg.model.models_dir)
    vocab = ordinary_token_ids(model_dir)
    traces = [build_trace(vocab, params, q) for q in short_qps]
    max_len = max(t.max_tokens for t in traces) + 16
    cfg = replace(
        cfg, model=replace(cfg.model, path=str(model_dir), max_model_len=max(cfg.model.max_model_len, max_len))
    )
    for s in systems:  # every system's config is built before anything runs: a bad key fails now
        with_overrides(cfg, list(s.overrides))
    for t in traces:
        print(t.describe())
    runs = _Runs()
    reference = systems[0]
    pairs = [[reference, other] for other in systems[1:]] or [[reference]]

    def started(stack: ExitStack, system: MixedSystem) -> Served:
        served = stack.enter_context(_serve(system, cfg, opts, max_len, out_dir))
        runs.launch[system.name] = served.launch
        seconds = alone_seconds(served.url, served.vllm, traces[0].alone_prompts, f"{system.name} alone")
        runs.alone[system.name] = seconds
        print(f"{system.name}: a {params.long_tokens}-token prompt alone on the idle server: {seconds:.2f} s")
        return served

    # The reference stays up; each other system runs beside it, run for run in ABBA order.
    with ExitStack() as stack:
        ref = started(stack, reference)
        for i, pair in enumerate(pairs):
            with ExitStack() as pair_stack:
                served = {reference.name: ref} | {other.name: started(pair_stack, other) for other in pair[1:]}
                pids = [sv.pid for sv in served.values()]
                for k, trace in enumerate(traces):
                    for rep in range(repeats):
                        here: dict[str, RunScore] = {}
                        for system in abba(pair, rep):
                            wait_quiet(pids)
                            server = served[system.name]
                            label = f"{system.name} {trace.short_qps:g}/s #{rep + 1}"
                            records, metrics = _measure(
                                server.url, server.vllm, calls_for(trace, system), trace, f"run-{i}-{k}-{rep}", label
                            )
                            score = score_run(system.name, trace, records, runs.alone[system.name], metrics)
                            here[system.name] = score
                            runs.scores.append(score)
                            runs.summaries.append(short_summary(score, trace, records))
                            runs.documents.append(
                                {
                                    "system": system.name,
                                    "short_qps": trace.short_qps,
                                    "repeat": rep,
                                    "records": [
                                        {
                                            **asdict(r),
                                            "kind": c.kind,
                                            "slo_ms": c.slo_ms,
                                            "user": c.user,
                                            "returning": c.returning,
                                        }
                                        for c, r in zip(trace.calls, records, strict=True)
                                    ],
                                }
                            )
                            log.info(
                                "%s: short goodput %.3f/s of %.3f, long %.4f/s of %.4f",
                                label,
                                score.short.goodput_per_s,
                                score.short.offered_per_s,
                                score.long.goodput_per_s,
                                score.long.offered_per_s,
                            )
                        for other in pair[1:]:
                            runs.paired.setdefault((other.name, trace.short_qps), []).append(
                                (here[other.name], here[reference.name])
                            )
    json_path, records_path = result_paths(opts.json_path, out_dir)
    write_records(records_path, runs.documents)
    doc = _report(cfg, params, opts, systems, traces, runs, json_path, records_path)
    return {**doc, "runs": runs.documents}


def sustained_qps(scores: list[RunScore]) -> float:
    """The capacity at the objectives of one system's runs at several loads (one run a load): the
    largest offered short calls/s up to which every load kept them, 99% of its short calls answered
    within their objective (a call refused or failed counts as missed) and every long prompt within
    its own; 0 when the lowest load did not."""
    best = 0.0
    for score in sorted(scores, key=lambda s: s.short_qps):
        if score.short.num_good < 0.99 * score.short.num_calls or score.long.num_good < score.long.num_calls:
            break
        best = score.short_qps
    return best


def _capacity_rows(reference: str, params: MixedParams, runs: _Runs) -> list[dict[str, Any]]:
    """Per other system, with runs at two loads or more: each side's capacity at the objectives
    (`sustained_qps`), repeat by repeat over the loads run beside each other."""
    rows = []
    for other in dict.fromkeys(name for name, _ in runs.paired):
        loads = sorted(qps for name, qps in runs.paired if name == other)
        repeats = min(len(runs.paired[(other, qps)]) for qps in loads)
        if len(loads) < 2:
            continue
        ours = [sustained_qps([runs.paired[(other, q)][r][1] for q in loads]) for r in range(repeats)]
        theirs = [sustained_qps([runs.paired[(other, q)][r][0] for q in loads]) for r in range(repeats)]
        rows.append(
            headline_row(
                f"short calls/s sustained within the objectives among {params.long_tokens}-token prompts "
                f"(99% of short calls within {params.short_slo_ms / 1e3:g} s, every long prompt within "
                f"{params.long_slo_ms / 1e3:g} s; loads {', '.join(f'{q:g}' for q in loads)} short/s)",
                "short/s",
                (reference, ours),
                (other, theirs),
                higher_is_better=True,
            )
        )
    return rows


def _headline(reference: str, params: MixedParams, runs: _Runs) -> list[dict[str, Any]]:
    """The rows a results table quotes, the reference against each other system: the capacity at
    the objectives over the loads run, then per load short and all calls in time per second and
    the short calls' mean and P99 latency (of the calls answered with a score: a refused call is
    counted apart, in the scores)."""
    rows = _capacity_rows(reference, params, runs)
    for (other, qps), pair_scores in runs.paired.items():
        where = f"among {params.long_tokens}-token prompts, {qps:g} short/s"
        for kind in ("short", "total"):
            rows.append(
                headline_row(
                    f"{'all' if kind == 'total' else kind} calls in time per second {where}",
                    "/s",
                    (reference, [getattr(r, kind).goodput_per_s for _, r in pair_scores]),
                    (other, [getattr(o, kind).goodput_per_s for o, _ in pair_scores]),
                    higher_is_better=True,
                )
            )
        for what, attr in (("mean", "mean_latency_seconds"), ("P99", "p99_latency_seconds")):
            rows.append(
                headline_row(
                    f"{what} latency of the short calls answered {where}",
                    "s",
                    (reference, [getattr(r.short, attr) for _, r in pair_scores]),
                    (other, [getattr(o.short, attr) for o, _ in pair_scores]),
                    higher_is_better=False,
                )
            )
    return rows


def _report(
    cfg: Config,
    params: MixedParams,
    opts: MixedOptions,
    systems: list[MixedSystem],
    traces: list[MixedTrace],
    runs: _Runs,
    json_path: Path | None,
    records_path: Path,
) -> dict[str, Any]:
    """Print the headline rows, the goodput table, the short calls' per-load and sustainable-QPS tables;
    write the JSON."""
    headline = _headline(systems[0].name, params, runs)
    print_headline(headline)
    scores, summaries = runs.scores, runs.summaries
    print_goodput(scores, params)
    slo = [params.short_slo_ms / 1e3]
    table = sustainable_table(summaries, [s.name for s in systems], slo, slo)
    if summaries:
        print("short calls per offered load (x and QPS: short calls/s offered; SLO: the short objective)")
        print_tables(summaries, table, slo, slo)
    return write_report(
        json_path,
        "mixed",
        resolve_device(cfg.device),
        {
            "config": asdict(cfg),
            "params": asdict(params),
            "systems": [asdict(s) for s in systems],
            "short_qps": opts.short_qps,
            "traces": [
                {
                    "short_qps": t.short_qps,
                    "window_seconds": t.window_seconds,
                    "short_calls": len(t.of(SHORT)),
                    "long_calls": len(t.of(LONG)),
                }
                for t in traces
            ],
            "scores": [asdict(s) for s in scores],
            "summaries": [asdict(s) for s in summaries],
            "sustainable_short_qps": table,
            "repeats": opts.repeats,
            "launch": runs.launch,
            "alone_seconds": runs.alone,
            "headline": headline,
            "records": str(records_path),
        },
    )
