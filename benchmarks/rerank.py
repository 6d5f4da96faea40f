"""`python -m benchmarks rerank`: a reranking service, ours against vLLM serving the same checkpoint
as a generative reranker (Qwen3-Reranker's way), over HTTP on `/v1/rerank`.

The workload: calls of one query against `documents` texts of `doc_tokens` tokens each, behind an
instruction prefix every call of a run shares (the reranker's task description). A document's
prompt is the instruction and query (with the tokenizer's BOS) followed by the document, as both
servers build it; its score is P(yes) / (P(no) + P(yes)) of the last position for the label pair
`labels` (ours: `server.score_tokens`; vLLM: `--hf-overrides` with `classifier_from_token` and
`is_original_qwen3_reranker`, its pooling runner, the model as `Qwen3ForSequenceClassification`,
compiled, prefix caching on, its defaults otherwise). The texts are words drawn from the bundled
corpus, seeded per run, so no run finds another run's KV in either server.

Per pair of runs (ABBA order, `repeats` pairs): calls/s with every call sent at once; then, at
each multiple of `load_of`'s median saturation, the same seeded Poisson arrivals for both, and
each call's latency (sent to the whole answer). Both systems answer the same texts in each pair;
the largest difference between their scores of a document is recorded (bf16 on each side).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import statistics
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.launch import prometheus_totals
from benchmarks.report import headline_row, result_paths, write_records, write_report
from benchmarks.servers import Served, serve_tiered, serve_vllm, wait_quiet
from benchmarks.stats import abba, percentile, poisson_arrivals, tail_name
from benchmarks.traces import BenchError
from benchmarks.vllm import PeerOptions, VLLMServer, peer_launch
from tiered.config import Config, with_overrides
from tiered.config.options import resolve_device
from tiered.embedded import corpus_text, resolve_model_path

log = logging.getLogger(__name__)

SYSTEMS = ("tiered", "vllm")
TOKEN_COUNTERS = (
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "tiered:batch_shared_tokens_total",
)


@dataclass(slots=True)
class RerankOptions:
    """What `run_rerank_bench` runs (the CLI's options, one to one)."""

    vllm_python: str | None
    systems: tuple[str, ...] = SYSTEMS
    calls: int = 12  # per run
    documents: int = 50  # per call
    doc_tokens: tuple[int, int] = (200, 500)  # each document's length, uniform in this range
    query_tokens: int = 24
    instruction_tokens: int = 200  # shared by every call of a run
    labels: tuple[str, str] = ("No", "Yes")  # (negative, positive): each one token of the tokenizer
    multiples: tuple[float, ...] = (0.5, 0.8)
    load_of: str = "vllm"  # whose median saturation the multiples scale
    repeats: int = 3
    seed: int = 0
    json_path: str | None = None
    out_dir: Path = Path("benchmarks/out/rerank")


@dataclass(slots=True)
class CallRecord:
    """One rerank call as the client saw it."""

    call_id: str
    num_documents: int
    arrival_seconds: float  # offset from the run's start
    latency_seconds: float  # sent to the whole answer
    error: str | None = None
    scores: list[float] = field(default_factory=list)  # by document index


@dataclass(slots=True)
class Run:
    """One run of one system: every call's record, and its figures."""

    system: str
    multiple: float  # 0: saturation (every call at once)
    offered_calls_per_s: float
    calls_per_s: float
    mean_seconds: float
    p50_seconds: float
    p99_seconds: float  # the maximum below 100 calls (`tail_name`)
    num_errors: int
    # Prompt tokens over the run from the server's /metrics (vLLM's names, which ours serves too):
    # looked up, found cached, and (ours) computed once for several documents of a batch
    prompt_tokens: int
    cached_tokens: int
    shared_tokens: int
    records: list[CallRecord]


@dataclass(frozen=True, slots=True)
class RerankCall:
    """One call's texts."""

    call_id: str
    query: str
    documents: list[str]


class _Words:
    """Text of about `n` tokens: words drawn from the corpus, counted with the model's tokenizer."""

    def __init__(self, model_dir: Path, seed: int) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(model_dir))
        self.words = corpus_text().split()
        self.rng = random.Random(seed)

    def text(self, n: int) -> str:
        words = [self.rng.choice(self.words) for _ in range(max(1, int(n / 1.3)))]
        while len(self.tok.encode(" ".join(words), add_special_tokens=False)) < n:
            words.append(self.rng.choice(self.words))
        return " ".join(words)


def make_calls(model_dir: Path, opts: RerankOptions, run_seed: int) -> list[RerankCall]:
    """One run's calls: an instruction shared by all, then each call's query and documents."""
    w = _Words(model_dir, run_seed)
    instruction = f"Judge whether the document meets the query ({run_seed}). " + w.text(opts.instruction_tokens)
    lo, hi = opts.doc_tokens
    return [
        RerankCall(
            f"r{run_seed}-c{i}",
            instruction + " Query: " + w.text(opts.query_tokens),
            [w.text(w.rng.randint(lo, hi)) for _ in range(opts.documents)],
        )
        for i in range(opts.calls)
    ]


async def _send(url: str, calls: list[RerankCall], arrivals: list[float]) -> list[CallRecord]:
    limits = httpx.Limits(max_connections=len(calls), max_keepalive_connections=len(calls), keepalive_expiry=2.0)
    async with httpx.AsyncClient(timeout=3600.0, limits=limits) as client:
        loop = asyncio.get_running_loop()
        start = loop.time()

        async def one(call: RerankCall, at: float) -> CallRecord:
            await asyncio.sleep(max(0.0, start + at - loop.time()))
            sent = loop.time()
            record = CallRecord(call.call_id, len(call.documents), sent - start, 0.0)
            body = {"model": "model", "query": call.query, "documents": call.documents, "return_documents": False}
            try:
                r = await client.post(f"{url}/v1/rerank", json=body)
                data = r.json()
                if r.status_code != 200:
                    record.error = f"{r.status_code}: {data.get('error', data)}"
                else:
                    scores = {int(x["index"]): float(x["relevance_score"]) for x in data["results"]}
                    record.scores = [scores[i] for i in range(len(call.documents))]
            except (httpx.HTTPError, KeyError, ValueError) as exc:
                record.error = f"{type(exc).__name__}: {exc}"
            record.latency_seconds = loop.time() - sent
            return record

        return list(await asyncio.gather(*(one(c, a) for c, a in zip(calls, arrivals, strict=True))))


def measure(served: Served, calls: list[RerankCall], arrivals: list[float], multiple: float, offered: float) -> Run:
    """One run: the calls sent at `arrivals` (all at 0: saturation), and its figures."""
    wait_quiet(served.pids)
    before = _token_counters(served.url)
    records = asyncio.run(_send(served.url, calls, arrivals))
    tokens = {k: int(v - before.get(k, 0.0)) for k, v in _token_counters(served.url).items()}
    ok = [r for r in records if r.error is None]
    makespan = max(r.arrival_seconds + r.latency_seconds for r in records) - min(arrivals)
    lat = [r.latency_seconds for r in ok]
    run = Run(
        served.system,
        multiple,
        offered,
        len(ok) / makespan if makespan > 0 else 0.0,
        statistics.fmean(lat) if lat else float("nan"),
        percentile(lat, 0.5),
        percentile(lat, 0.99),
        len(records) - len(ok),
        tokens.get(TOKEN_COUNTERS[0], 0),
        tokens.get(TOKEN_COUNTERS[1], 0),
        tokens.get(TOKEN_COUNTERS[2], 0),
        records,
    )
    log.info(
        "%s at %s: %.3f calls/s, mean %.2f s, P50 %.2f s, %s %.2f s, %d errors; %d prompt tokens, %d cached, %d shared",
        served.system,
        "saturation" if multiple == 0 else f"{multiple:g}x ({offered:.3f} calls/s)",
        run.calls_per_s,
        run.mean_seconds,
        run.p50_seconds,
        tail_name(len(lat)),
        run.p99_seconds,
        run.num_errors,
        run.prompt_tokens,
        run.cached_tokens,
        run.shared_tokens,
    )
    if run.num_errors:
        first = next(r.error for r in records if r.error)
        log.warning("%s: %d of %d calls failed, e.g. %s", served.system, run.num_errors, len(records), first)
    return run


def _token_counters(url: str) -> dict[str, float]:
    return prometheus_totals(url, lambda name: name in TOKEN_COUNTERS)


def vllm_reranker_args(labels: tuple[str, str]) -> list[str]:
    """vLLM serving a causal LM as a generative reranker: its pooling runner, the checkpoint read as
    Qwen3ForSequenceClassification scoring the label pair from the LM head's two rows."""
    overrides = {
        "architectures": ["Qwen3ForSequenceClassification"],
        "classifier_from_token": list(labels),
        "is_original_qwen3_reranker": True,
    }
    return ["--runner", "pooling", "--hf-overrides", json.dumps(overrides)]


@contextmanager
def _serve(system: str, cfg: Config, opts: RerankOptions, max_len: int) -> Iterator[Served]:
    warm = make_calls(Path(cfg.model.path), RerankOptions(None, calls=1, documents=4, doc_tokens=(64, 64)), -1)
    if system == "tiered":
        with serve_tiered(cfg, system, opts.out_dir) as served:
            asyncio.run(_send(served.url, warm, [0.0]))
            yield served
        return
    if opts.vllm_python is None:
        raise BenchError("the vllm system needs --vllm-python (a Python with vLLM: `make bench-env`)")
    peer = PeerOptions(extra_args=vllm_reranker_args(opts.labels))
    with serve_vllm(VLLMServer(peer_launch(cfg, opts.vllm_python, max_len, None, peer)), system, opts.out_dir) as s:
        asyncio.run(_send(s.url, warm, [0.0]))
        yield s


def _max_score_gap(runs: dict[str, list[Run]]) -> float | None:
    """The largest difference between two systems' scores of one document, over the runs both answered."""
    if len(runs) < 2:
        return None
    a, b = (runs[s] for s in list(runs)[:2])
    gaps = [
        abs(x - y)
        for ra, rb in zip(a, b, strict=False)
        for ca, cb in zip(ra.records, rb.records, strict=True)
        for x, y in zip(ca.scores, cb.scores, strict=False)
    ]
    return max(gaps) if gaps else None


def run_rerank_bench(cfg: Config, opts: RerankOptions) -> dict[str, Any]:
    """Saturation and loads for each system (see the module docstring)."""
    logging.getLogger("httpx").setLevel(logging.WARNING)
    unknown = [s for s in opts.systems if s not in SYSTEMS]
    if unknown or not opts.systems or opts.repeats < 1 or opts.calls < 1 or opts.documents < 1:
        raise BenchError(
            f"systems must be among {', '.join(SYSTEMS)} (got {', '.join(unknown) or 'none'}); "
            "--repeats, --calls and --documents >= 1"
        )
    if opts.multiples and opts.load_of not in opts.systems:
        raise BenchError(f"--load-of {opts.load_of} is not among the systems ({', '.join(opts.systems)})")
    model_dir = resolve_model_path(cfg.model.path, cfg.model.models_dir)
    cfg = with_overrides(cfg, [f"model.path={model_dir}", f"server.score_tokens={json.dumps(list(opts.labels))}"])
    longest = opts.instruction_tokens + opts.query_tokens + opts.doc_tokens[1] + 64  # words' token counts round up
    max_len = 1 << max(11, longest.bit_length())
    cfg = with_overrides(cfg, [f"model.max_model_len={max_len}"])
    json_path, records_path = result_paths(opts.json_path, opts.out_dir)
    saturation: dict[str, list[Run]] = {s: [] for s in opts.systems}
    loads: dict[str, dict[float, list[Run]]] = {s: {m: [] for m in opts.multiples} for s in opts.systems}
    began = time.time()
    with _servers(opts.systems, cfg, opts, max_len) as servers:
        for rep in range(opts.repeats):
            calls = make_calls(model_dir, opts, opts.seed + 1000 * rep)
            for system in abba(list(opts.systems), rep):
                saturation[system].append(measure(servers[system], calls, [0.0] * len(calls), 0.0, 0.0))
        reference = statistics.median(r.calls_per_s for r in saturation[opts.load_of]) if opts.multiples else 0.0
        for m_index, multiple in enumerate(opts.multiples):
            offered = multiple * reference
            for rep in range(opts.repeats):
                seed = opts.seed + 1000 * rep + 100 * (m_index + 1)
                calls = make_calls(model_dir, opts, seed)
                arrivals = poisson_arrivals(len(calls), offered, seed)
                for system in abba(list(opts.systems), rep):
                    loads[system][multiple].append(measure(servers[system], calls, arrivals, multiple, offered))
    rows = _headline(opts, saturation, loads)
    every = {s: saturation[s] + [run for runs in loads[s].values() for run in runs] for s in saturation}
    write_records(records_path, {s: [asdict(r) for r in runs] for s, runs in every.items()})

    def brief(run: Run) -> dict[str, Any]:
        return {k: v for k, v in asdict(run).items() if k != "records"}

    return write_report(
        json_path,
        "rerank",
        resolve_device(cfg.device),
        {
            "config": asdict(cfg),
            "workload": {k: v for k, v in asdict(opts).items() if k not in ("json_path", "out_dir", "vllm_python")},
            "vllm_args": vllm_reranker_args(opts.labels) if "vllm" in opts.systems else None,
            "max_model_len": max_len,
            "seconds": time.time() - began,
            "saturation_runs": {s: [brief(r) for r in runs] for s, runs in saturation.items()},
            "load_runs": {s: {str(m): [brief(r) for r in runs] for m, runs in by.items()} for s, by in loads.items()},
            "max_score_difference": _max_score_gap(saturation),
            "records": str(records_path),
            "headline": rows,
        },
    )


@contextmanager
def _servers(systems: tuple[str, ...], cfg: Config, opts: RerankOptions, max_len: int) -> Iterator[dict[str, Served]]:
    """Every system's server, started once for all its runs (each run's texts are its own)."""
    with ExitStack() as stack:
        yield {s: stack.enter_context(_serve(s, cfg, opts, max_len)) for s in systems}


def _headline(
    opts: RerankOptions, saturation: dict[str, list[Run]], loads: dict[str, dict[float, list[Run]]]
) -> list[dict[str, Any]]:
    """Ours against the peer, run by run of each pair."""
    if "tiered" not in saturation or len(saturation) < 2:
        return []
    peer = next(s for s in saturation if s != "tiered")
    rows = [
        headline_row(
            f"rerank calls/s at saturation ({opts.documents} documents a call)",
            "calls/s",
            ("tiered", [r.calls_per_s for r in saturation["tiered"]]),
            (peer, [r.calls_per_s for r in saturation[peer]]),
            higher_is_better=True,
        )
    ]
    for multiple in opts.multiples:
        ours, theirs = loads["tiered"][multiple], loads[peer][multiple]
        tail = tail_name(opts.calls)
        for what, attr in (("P50", "p50_seconds"), (tail, "p99_seconds")):
            rows.append(
                headline_row(
                    f"{what} rerank call latency at {multiple:g}x {opts.load_of}'s saturation",
                    "s",
                    ("tiered", [getattr(r, attr) for r in ours]),
                    (peer, [getattr(r, attr) for r in theirs]),
                    higher_is_better=False,
                )
            )
    return rows
