"""`python -m benchmarks longest`: the longest prompt each engine serves within one memory budget, and its time.

A budget covers everything a prompt needs: weights, activations and KV. Per budget:
- ours (hybrid mode, one layer's K,V alive, the attention kernel `attention.kernel` or, with
  `auto`, the model's default on its device; with `--set forward.spill_dir=DIR` the residual stream
  of forwards of `forward.spill_min_tokens` or more lives in a file there, on disk, not in the
  budget): the longest prompt whose forward peak (weights +
  activations, each length measured in a fresh process by `benchmarks.probe`, with the block cache
  as a server under a budget has it) fits, to
  --resolution tokens. Each probe after the first two (with a spill directory, two lengths that
  spill) goes where the line through the last two meets the budget (the peak grows about linearly
  with tokens); the answer is a measured bracket:
  a length that fits and one --resolution above it that does not. With a spill directory the
  forward of `forward.spill_min_tokens` - 1 tokens, in memory, is probed first: the server's
  start-up profile runs it too, so a budget it does not fit stops the bench.
  Then `tiered serve` starts with engine.memory_budget_bytes = the budget and model.max_model_len
  = that length (its start-up profile run checks the same fit; no host tier, so no KV leaves the
  budget) and answers one prompt of that length, and one of the peer's length (--repeats times,
  each under its own cache salt, the median kept), timed over HTTP.
  With --no-time-at-peer-length ours answers no prompt of the peer's length (the lengths alone).
  With --answer-max-tokens N (for budgets whose longest forwards take hours here): our longest is
  not probed length by length but read off the line through the two lengths a server's start-up
  profile measures for a long max_model_len (engine.profile_max_tokens), as the server extends
  it, then checked by starting the server there; a prompt of ours longer than N is not answered.
- vLLM at its defaults (compiled): KV memory = budget - weights (its activations are not charged
  to it), --max-model-len = as many tokens as that memory holds, lowered a block at a time
  until it starts; then one prompt of that length (--repeats times, as ours), timed over HTTP. A
  length past the model's max_position_embeddings stops the bench (vLLM refuses it): give
  `--set model.path=embedded:bench-m-1m` (bench-m's weights with 1,048,576 positions).

With --memory-limit every server runs in a memory cgroup (`benchmarks.memory_group`): the budget
above is what each engine is configured for, the cgroup is what its processes may use in all
(runtime, weights, KV, and the page cache of our spill file). `--memory-limit SIZE` gives both
engines SIZE; `--memory-limit peer` runs vLLM in a group without a limit first and gives ours a
limit of vLLM's measured peak (start-up included), rounded up to 64 MiB: ours answers under the
memory vLLM used. A server the kernel killed at the limit has not served its length: the bench
stops there and says so. Only answered lengths count as served (the table, the plot).
"""

from __future__ import annotations

import logging
import random
import statistics
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import psutil

from benchmarks.load import Call, HttpOptions, run_http
from benchmarks.memory_group import MemoryGroup, MemoryUse
from benchmarks.mil import ForwardSetup, probe
from benchmarks.plots import plot_longest
from benchmarks.report import new_json_path, write_report
from benchmarks.servers import serve_tiered, serve_vllm
from benchmarks.traces import BenchError, ordinary_token_ids
from benchmarks.vllm import VLLM_CPU_BLOCK_TOKENS, PeerOptions, VLLMServer, peer_launch
from tiered.config import Config, with_overrides
from tiered.config.options import resolve_device
from tiered.embedded import resolve_model_path
from tiered.hybrid.attention import default_kernel
from tiered.hybrid.loader import DTYPES, read_args
from tiered.hybrid.memory import extended_reach, growth_floor, profile_lengths
from tiered.hybrid.precision import config_precision
from tiered.hybrid.spill import check_spill, spill_of

log = logging.getLogger(__name__)


@dataclass(slots=True)
class LongestOptions:
    """What `run_longest_bench` runs (the CLI's options, one to one)."""

    budgets: list[int]  # bytes: weights + activations + KV
    vllm_python: str | None
    resolution: int = 1024  # our search stops at this many tokens
    guess_tokens: tuple[int, int] = (4096, 8192)  # the two short probes that pick where to look
    seed: int = 0
    json_path: str | None = None
    out_dir: Path = Path("benchmarks/out/longest")
    plot_path: Path | None = None  # a PNG of the longest prompt against the budget
    repeats: int = 1  # answers of the peer's length by each engine (fresh cache salts); the median is kept
    # Past this many tokens our forwards are too slow to run here (0: no limit): our longest is found
    # from the line through the two lengths the server's start-up profile measures, checked by
    # starting the server, and its prompt is not answered.
    answer_max_tokens: int = 0
    # Off: ours answers no prompt of the peer's length (for budgets where one takes an hour here, the
    # lengths alone); the peer still answers its own, which is how it shows it serves that length.
    time_at_peer_length: bool = True
    # Each server in a memory cgroup: this limit for both engines (bytes), or with `limit_of_peer`
    # ours under vLLM's measured peak; None and False: no cgroup.
    memory_limit_bytes: int | None = None
    limit_of_peer: bool = False
    # Ours serves and answers at most this many tokens (0: its longest), or with a float this
    # multiple of the peer's length: for budgets whose longest forward takes hours here, a served
    # length of a known multiple of the peer's.
    ours_max_tokens: int | float = 0


# `--memory-limit peer`: vLLM's group has no limit but the machine's; ours gets its peak rounded up to this
LIMIT_STEP = 64 << 20


@dataclass(slots=True)
class Served:
    """One prompt answered over HTTP: its seconds, the median of `runs` when it was answered more than once."""

    tokens: int
    seconds: float
    runs: list[float] = field(default_factory=list)  # each answer's seconds, in order

    @property
    def ms_per_token(self) -> float:
        """Milliseconds per prompt token."""
        return 1e3 * self.seconds / self.tokens


@dataclass(slots=True)
class BudgetResult:
    """One budget's measurements: our probes and served prompt, vLLM's starts and served prompt."""

    budget_bytes: int
    weights_bytes: int
    ours_tokens: int = 0  # the longest that fits
    ours_over_tokens: int = 0  # measured not to fit (ours_tokens + resolution); 0 when found from the line
    ours_from_line: bool = False  # found from the profile's line (--answer-max-tokens), not by probing each length
    peaks_by_len: dict[int, int] = field(default_factory=dict)  # every probe: tokens -> peak bytes
    ours_served_tokens: int = 0  # the max_model_len our server started with (ours_tokens unless it refused)
    ours_refused: list[int] = field(default_factory=list)  # larger ones its start-up profile run refused
    ours: Served | None = None  # our server at ours_served_tokens (None: longer than --answer-max-tokens, not answered)
    ours_at_peer_length: Served | None = None
    peer_kv_bytes: int = 0
    peer_tokens: int = 0  # the largest --max-model-len it started with
    peer_refused: list[int] = field(default_factory=list)  # larger ones it refused at start
    peer: Served | None = None
    # With --memory-limit: each engine's cgroup over its serving (peak from its start)
    ours_memory: MemoryUse | None = None
    peer_memory: MemoryUse | None = None

    @property
    def ours_answered_tokens(self) -> int:
        """The max_model_len of ours that answered a prompt of it (0: none answered)."""
        return self.ours_served_tokens if self.ours is not None else 0


def _prompt(vocab: list[int], num_tokens: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.choice(vocab) for _ in range(num_tokens)]


def _answer(url: str, system: str, prompt: list[int], salt: str, repeats: int = 1) -> Served:
    """`prompt` answered `repeats` times, each under its own cache salt (nothing cached between them)."""
    runs = []
    for i in range(repeats):
        key = salt if repeats == 1 else f"{salt}-{i}"
        # No client timeout: neither server has one here, and a budget's longest prompt can take hours.
        http = HttpOptions(system, cache_salt=key, timeout_s=None)
        (record,), _ = run_http(url, "model", [Call(key, [prompt])], [0.0], http)
        if record.error is not None:
            raise BenchError(f"{system}: the {len(prompt)}-token prompt failed: {record.error}")
        log.info("%s: %d tokens in %.1f s", system, len(prompt), record.latency_seconds)
        runs.append(record.latency_seconds)
    return Served(len(prompt), statistics.median(runs), runs)


def _machine_bytes() -> int:
    return int(psutil.virtual_memory().total)


def _group(system: str, limit: int | None, disk_folders: list[Path]) -> MemoryGroup | None:
    """A memory cgroup for one server start (None without --memory-limit)."""
    return MemoryGroup(system, limit, disk_folders) if limit is not None else None


def _memory(group: MemoryGroup | None, pids: list[int]) -> MemoryUse | None:
    """The group's use since it was made: the peak covers the server's start-up as well as its answers."""
    if group is None:
        return None
    use = group.end_run(pids)
    log.info(
        "%s: peak %.0f MiB of a %.0f MiB limit, page cache %.0f MiB, %d killed at the limit",
        group.name,
        use.peak_bytes / 2**20,
        (use.limit_bytes or 0) / 2**20,
        use.page_cache_bytes / 2**20,
        use.oom_kills,
    )
    return use


def _check_not_killed(group: MemoryGroup | None, system: str) -> None:
    """A server the kernel killed at its group's limit did not fail for want of budget: stop there."""
    if group is not None and group.killed_at_limit():
        raise BenchError(
            f"{system}: the kernel killed a process at the memory cgroup's limit of {group.limit_bytes} bytes "
            f"(its log in the --out-dir says when): that length is not served under the limit"
        )


def _answer_in(url: str, system: str, prompt: list[int], salt: str, repeats: int, group: MemoryGroup | None) -> Served:
    """`_answer`, where a failure caused by the memory cgroup's limit says so."""
    try:
        return _answer(url, system, prompt, salt, repeats)
    except BenchError:
        _check_not_killed(group, system)
        raise


def _fits(setup: ForwardSetup, result: BudgetResult, n: int) -> bool:
    """Whether our forward of `n` tokens, probed in a fresh process, fits the budget (its peak recorded)."""
    peak = probe(setup, "hybrid", n)
    result.peaks_by_len[n] = peak.peak_bytes
    result.weights_bytes = peak.weights_bytes or result.weights_bytes
    ok = peak.peak_bytes <= result.budget_bytes
    log.info(
        "hybrid %7d tokens: peak %.1f MiB (%s, %.1f s)",
        n,
        peak.peak_bytes / 2**20,
        "fits" if ok else "over",
        peak.seconds,
    )
    return ok


def _stream_in_memory_over(setup: ForwardSetup, budget: int) -> BenchError:
    # The server's start-up profile also runs the longest forward that keeps its stream in memory:
    # a budget it does not fit refuses every length.
    assert setup.spill is not None
    return BenchError(
        f"a forward of forward.spill_min_tokens - 1 = {setup.spill.min_tokens - 1} tokens keeps its stream in "
        f"memory and peaks over the budget of {budget} bytes: lower forward.spill_min_tokens"
    )


def find_ours(setup: ForwardSetup, result: BudgetResult, opts: LongestOptions) -> None:
    """Our longest prompt under the budget, to `opts.resolution` tokens (see the module docstring)."""
    res, budget = opts.resolution, result.budget_bytes

    def fits(n: int) -> bool:
        return _fits(setup, result, n)

    if setup.spill is not None and setup.spill.min_tokens > 1 and not fits(setup.spill.min_tokens - 1):
        raise _stream_in_memory_over(setup, budget)
    a, b = opts.guess_tokens
    if setup.spill is not None and b < setup.spill.min_tokens:
        # The peak grows slower per token once a forward spills: guess from two spilled lengths.
        a, b = setup.spill.min_tokens, setup.spill.min_tokens + b - a
    if not fits(a):
        raise BenchError(f"a budget of {budget} bytes does not fit even {a} tokens of ours")
    lo, hi = a, 0  # the longest that fits; the shortest over (0: none yet)
    prev, n = a, b
    while not hi or hi - lo > res:
        if fits(n):
            lo = max(lo, n)
        else:
            hi = min(hi or n, n)
        # The next length: where the line through the last two probes meets the budget, inside the bracket.
        peaks = result.peaks_by_len
        slope = (peaks[n] - peaks[prev]) / (n - prev) if n != prev else 0.0
        guess = n + (budget - peaks[n]) / slope if slope > 0 else 2 * n
        prev = n
        n = max(lo + res, int(guess) // res * res)
        if hi:
            n = min(n, hi - res)
    result.ours_tokens, result.ours_over_tokens = lo, hi


def find_ours_from_line(
    setup: ForwardSetup, result: BudgetResult, opts: LongestOptions, profile_max_tokens: int
) -> None:
    """Our longest prompt under the budget without forwarding it: the lengths a server's start-up
    profile measures for a long max_model_len, each probed in a fresh process, and the longest
    length whose peak on their line (as the server extends it) stays under the budget, floored to
    `opts.resolution`. Shorter than the profile's second length: the probes' search instead."""
    budget = result.budget_bytes
    if profile_max_tokens == 0:
        raise BenchError(
            "--answer-max-tokens needs engine.profile_max_tokens > 0 (the server would forward every length)"
        )
    lengths = profile_lengths(sys.maxsize, "hybrid", setup.spill, profile_max_tokens)
    fit = {n: _fits(setup, result, n) for n in lengths}
    if not all(fit[n] for n in lengths[2:]):  # the in-memory forward a spill directory adds
        raise _stream_in_memory_over(setup, budget)
    peaks = result.peaks_by_len
    lo, hi = lengths[:2]
    floor = growth_floor(read_args(setup.model_dir), DTYPES[setup.dtype])
    reach = extended_reach(lo, peaks[lo], hi, peaks[hi], budget, floor)
    if reach <= hi:
        find_ours(setup, result, opts)
        return
    result.ours_tokens = reach // opts.resolution * opts.resolution
    result.ours_from_line = True
    log.info("hybrid: %d tokens reach the budget on the line through %d and %d", result.ours_tokens, lo, hi)


def find_peer(cfg: Config, result: BudgetResult, opts: LongestOptions, vocab: list[int]) -> None:
    """vLLM's largest --max-model-len with KV = budget - weights, and one prompt of it."""
    assert opts.vllm_python is not None
    kv = result.budget_bytes - result.weights_bytes
    probe_launch = peer_launch(cfg, opts.vllm_python, 1, kv)
    block = VLLM_CPU_BLOCK_TOKENS
    n = kv // probe_launch.kv_bytes_per_token // block * block
    result.peer_kv_bytes = kv
    positions = read_args(cfg.model.path).max_position_embeddings
    if n > positions:
        # vLLM refuses a --max-model-len past the model's positions (VLLM_ALLOW_LONG_MAX_MODEL_LEN lets it start,
        # with RoPE positions past them computing NaN, its own warning says): lowering the length a block a time
        # from here would start it for hours.
        raise BenchError(
            f"vLLM's KV at {result.budget_bytes >> 20} MiB holds {n} tokens, past the model's "
            f"max_position_embeddings {positions}, so vLLM would be capped by positions, not memory: give --set "
            "model.path= a copy of the model folder whose config.json has more positions (the weights are the same)"
        )
    while n >= block:
        launch = replace(peer_launch(cfg, opts.vllm_python, n, kv, PeerOptions()), kv_exact=True)
        server = VLLMServer(launch)
        system = f"vllm-{result.budget_bytes >> 20}MiB-{n}"
        group = _group(system, opts.memory_limit_bytes if not opts.limit_of_peer else _machine_bytes(), [])
        try:
            with serve_vllm(server, system, opts.out_dir, group=group) as served:
                prompt = _prompt(vocab, n - 1, opts.seed)
                result.peer = _answer_in(served.url, "vllm", prompt, f"longest-vllm-{n}", opts.repeats, group)
                result.peer_tokens = n
                result.peer_memory = _memory(group, served.pids)
                return
        except RuntimeError as exc:  # refused at start: the KV memory does not hold max_model_len
            _check_not_killed(group, system)
            log.info("vllm refused --max-model-len %d with %d bytes of KV: %s", n, kv, str(exc).splitlines()[0])
            result.peer_refused.append(n)
            n -= block
        finally:
            if group is not None:
                group.close()
    raise BenchError(f"vLLM started with no --max-model-len at a budget of {result.budget_bytes} bytes")


def serve_ours(cfg: Config, result: BudgetResult, opts: LongestOptions, vocab: list[int]) -> None:
    """`tiered serve` under the budget at our longest length (lowered by --resolution while its own
    start-up profile run finds it over the budget): a prompt of it, and one of the peer's length."""
    cap = opts.ours_max_tokens
    if isinstance(cap, float):  # a multiple of the peer's length, whole blocks of --resolution
        cap = int(cap * result.peer_tokens) // opts.resolution * opts.resolution if result.peer_tokens else 0
    n = min(result.ours_tokens, cap or result.ours_tokens)
    if n < result.ours_tokens:
        log.info("tiered: serving %d tokens of the %d that fit (--ours-max-tokens)", n, result.ours_tokens)
    limit = opts.memory_limit_bytes
    if opts.limit_of_peer:
        if result.peer_memory is None:
            raise BenchError("--memory-limit peer needs the peer's run (--vllm-python)")
        limit = -(-result.peer_memory.peak_bytes // LIMIT_STEP) * LIMIT_STEP
        log.info("ours under vLLM's peak: a %d MiB memory cgroup", limit >> 20)
    while n > opts.resolution:
        overrides = [
            f"engine.memory_budget_bytes={result.budget_bytes}",
            f"model.max_model_len={n}",
            "cache.host.enabled=false",
            "cache.suffix=discard",
            # No request timeout (0): a budget's longest prompts can take longer than the default here, and
            # the bench times them as it times vLLM's, which has none.
            "server.request_timeout_s=0",
            # The kernel the probes ran: kernels differ in scratch (one that reads all KV heads at
            # once copies the keys it attends to).
            f"attention.kernel={cfg.attention.kernel}",
        ]
        system = f"tiered-{result.budget_bytes >> 20}MiB-{n}"
        group = _group(system, limit, [Path(cfg.forward.spill_dir)] if cfg.forward.spill_dir else [])
        try:
            with serve_tiered(with_overrides(cfg, overrides), system, opts.out_dir, group=group) as served:
                if not opts.answer_max_tokens or n <= opts.answer_max_tokens:
                    prompt = _prompt(vocab, n - 1, opts.seed)
                    result.ours = _answer_in(served.url, "tiered", prompt, f"longest-tiered-{n}", 1, group)
                else:
                    log.info("tiered started with max_model_len %d; not answered (--answer-max-tokens)", n)
                if opts.time_at_peer_length and 0 < result.peer_tokens <= n:
                    prompt = _prompt(vocab, result.peer_tokens - 1, opts.seed)
                    salt = f"longest-tiered-{result.peer_tokens}"
                    result.ours_at_peer_length = _answer_in(served.url, "tiered", prompt, salt, opts.repeats, group)
                result.ours_served_tokens = n
                result.ours_memory = _memory(group, served.pids)
                return
        except RuntimeError as exc:  # refused at start: its profile run's peak is over the budget
            _check_not_killed(group, system)
            log.info(
                "tiered refused max_model_len %d under %d bytes: %s", n, result.budget_bytes, str(exc).splitlines()[0]
            )
            result.ours_refused.append(n)
            n -= opts.resolution
        finally:
            if group is not None:
                group.close()
    raise BenchError(f"tiered started with no max_model_len at a budget of {result.budget_bytes} bytes")


def format_table(results: list[BudgetResult]) -> str:
    lines = [
        f"{'budget MiB':>10} {'ours answered':>13} {'vLLM answered':>13} {'ratio':>6} "
        f"{'ours s':>7} {'vLLM s':>7} {'ours ms/token':>13} {'vLLM ms/token':>13} {'ours at vLLM length':>19}"
    ]
    for r in results:
        ratio = f"{r.ours_answered_tokens / r.peer_tokens:.2f}x" if r.peer_tokens and r.peer else "-"
        ours_s = f"{r.ours.seconds:.1f}" if r.ours else "-"
        peer_s = f"{r.peer.seconds:.1f}" if r.peer else "-"
        ours_ms = f"{r.ours.ms_per_token:.2f}" if r.ours else "-"
        peer_ms = f"{r.peer.ms_per_token:.2f}" if r.peer else "-"
        same = f"{r.ours_at_peer_length.seconds:.1f} s" if r.ours_at_peer_length else "-"
        peer_n = r.peer_tokens if r.peer else 0
        lines.append(
            f"{r.budget_bytes / 2**20:>10.0f} {r.ours_answered_tokens:>13} {peer_n:>13} {ratio:>6} "
            f"{ours_s:>7} {peer_s:>7} {ours_ms:>13} {peer_ms:>13} {same:>19}"
        )
    return "\n".join(lines)


def run_longest_bench(cfg: Config, opts: LongestOptions) -> dict[str, Any]:
    """Per budget, ours and vLLM's longest prompt and its time (see the module docstring)."""
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if not opts.budgets or opts.resolution < 1 or opts.repeats < 1 or opts.answer_max_tokens < 0:
        raise BenchError(
            "give at least one --budgets value, a --resolution >= 1, --repeats >= 1 and --answer-max-tokens >= 0"
        )
    model_dir = resolve_model_path(cfg.model.path, cfg.model.models_dir)
    cfg = replace(cfg, model=replace(cfg.model, path=str(model_dir)))
    precision = config_precision(cfg)
    device = resolve_device(cfg.device)
    # One kernel for the probes and the server: the configured one, or (auto, whose start-up
    # measurement picks by speed, not by scratch) the model's default on its device.
    kernel = cfg.attention.kernel if cfg.attention.kernel != "auto" else default_kernel(device)
    cfg = with_overrides(cfg, [f"attention.kernel={kernel}"])
    check_spill(cfg.forward)  # made if missing, before the first probe writes there
    f = cfg.forward
    setup = ForwardSetup(str(model_dir), precision.compute, device, f.chunk_tokens, spill_of(f), kernel)
    vocab = ordinary_token_ids(model_dir)
    print(f"the longest prompt per budget, ours (hybrid) against vLLM; precision: {precision.describe()}")
    results: list[BudgetResult] = []
    json_path = new_json_path(opts.json_path) if opts.json_path else None  # a rerun never overwrites a kept one

    def report(complete: bool) -> dict[str, Any]:
        # Written after every step as well as at the end: a budget's answers can take hours here, and
        # a run stopped part way keeps what it measured (`complete` false, the budget's later fields empty).
        return write_report(
            json_path,
            "longest",
            device,
            {
                "config": asdict(cfg),
                "resolution": opts.resolution,
                "answer_max_tokens": opts.answer_max_tokens,
                "time_at_peer_length": opts.time_at_peer_length,
                "memory_limit": "peer" if opts.limit_of_peer else opts.memory_limit_bytes,
                "ours_max_tokens": opts.ours_max_tokens,
                "complete": complete,
                "budgets": [asdict(r) for r in results],
            },
        )

    for budget in opts.budgets:
        result = BudgetResult(budget, 0)
        results.append(result)
        log.info("budget %.0f MiB: ours", budget / 2**20)
        if opts.answer_max_tokens:
            find_ours_from_line(setup, result, opts, cfg.engine.profile_max_tokens)
        else:
            find_ours(setup, result, opts)
        report(complete=False)
        if opts.vllm_python:
            log.info("budget %.0f MiB: vLLM, %d bytes of KV", budget / 2**20, budget - result.weights_bytes)
            find_peer(cfg, result, opts, vocab)
            report(complete=False)
        serve_ours(cfg, result, opts, vocab)
        report(complete=False)
    print(format_table(results))
    doc = report(complete=True)
    if opts.plot_path is not None:
        log.info("wrote %s", plot_longest(doc, opts.plot_path))
    return doc
