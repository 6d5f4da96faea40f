"""The native library in this process: built (`tiered.native.build`) and loaded on first use, or
None with the reason logged once. Its ops: `torch.ops.tiered_native` (attend_, rms_norm,
silu_mul_, the block cache's, isas)."""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

log = logging.getLogger(__name__)

_WHY_NOT: list[str] = []  # why the library is unavailable, once _ops() has tried


@functools.cache
def _ops() -> Any | None:
    """The library's op namespace, built and loaded on first call; None (reason logged) if impossible."""
    from tiered.native.build import BuildError, build  # here: `python -m tiered.native.build` imports this package

    try:
        path = build()
        torch.ops.load_library(str(path))
        ops = torch.ops.tiered_native
        log.debug("native library loaded (paths this CPU runs: %s)", ops.isas())
        return ops
    except BuildError as e:
        _WHY_NOT.append(str(e))
    except (OSError, RuntimeError) as e:
        _WHY_NOT.append(f"its library did not load: {e}")
    log.warning("native library unavailable: %s", _WHY_NOT[-1])
    return None


def library() -> Any | None:
    """The library's op namespace, or None where it cannot be built or loaded here (the reason logged once)."""
    return _ops()


def available() -> bool:
    """Whether the native library builds and loads here (tried once, on first call)."""
    return _ops() is not None


def unavailable() -> str | None:
    """Why the library cannot run in this process (None: it can)."""
    return None if _ops() is not None else _WHY_NOT[-1]


def build_id() -> str:
    """The identity of the library this source tree builds (a hash of its sources, torch, compiler and
    flags): a timing of a kernel measured with one build says nothing about another."""
    from tiered.native.build import library_path

    return library_path().parent.name


def cpu_isas() -> list[str]:
    """The ISA paths this CPU runs, best first ([] when the library is unavailable)."""
    ops = _ops()
    return str(ops.isas()).split(",") if ops is not None else []
