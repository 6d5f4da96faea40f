"""Builds the native library (csrc/attend.cpp, csrc/isa.h: the `native` attention kernel;
csrc/pointwise.cpp: the fused row-wise ops; csrc/blocks.cpp: the block cache, a CPU allocator
for a process under a memory budget) into one shared library, once, cached.

Design notes: docs/internals.md, section `tiered/native/build.py`.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = (CSRC / "attend.cpp", CSRC / "pointwise.cpp", CSRC / "blocks.cpp")
HEADERS = (CSRC / "isa.h",)
FLAGS = ("-O3", "-std=c++20", "-shared", "-fPIC", "-fopenmp", "-w")
BUILD_TIMEOUT_S = 600


class BuildError(RuntimeError):
    """The library could not be built here; the message says why (it is logged, never raised to the engine)."""


def compiler() -> list[str]:
    """The C++ compiler command: `CXX` as torch's extension builder reads it, else `c++`."""
    return shlex.split(os.environ.get("CXX", "") or "c++")


def default_cache_dir() -> Path:
    """Where the built library is cached: the checkout's `.cache/native` if writable, else `~/.cache/tiered/native`."""
    package_root = Path(__file__).resolve().parents[2]
    if (package_root / "pyproject.toml").exists() and os.access(package_root, os.W_OK):
        return package_root / ".cache" / "native"
    return Path.home() / ".cache" / "tiered" / "native"


def _command(output: Path) -> list[str]:
    from torch.utils.cpp_extension import include_paths, library_paths

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        *compiler(),
        *FLAGS,
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(f"-I{p}" for p in include_paths()),
        *(str(s) for s in SOURCES),
        "-o",
        str(output),
        *(f"-L{p}" for p in library_paths()),
        "-lc10",
        "-ltorch_cpu",
        *(f"-Wl,-rpath,{p}" for p in library_paths()),
    ]


def library_path(cache_dir: str | Path | None = None) -> Path:
    """Where the library of this source x torch x compiler x flags lives (built or not)."""
    digest = hashlib.sha256()
    for source in (*SOURCES, *HEADERS):
        digest.update(source.read_bytes())
    for part in (torch.__version__, *compiler(), *FLAGS, sys.platform):
        digest.update(b"\0" + part.encode())
    return Path(cache_dir or default_cache_dir()) / digest.hexdigest()[:16] / "attend.so"


def build(cache_dir: str | Path | None = None) -> Path:
    """The library's path, built first unless cached. Raises BuildError with the reason."""
    missing = [str(p) for p in (*SOURCES, *HEADERS) if not p.exists()]
    if missing:
        raise BuildError(f"its sources are missing from this installation: {', '.join(missing)}")
    target = library_path(cache_dir)
    if target.exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target.parent / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it: wait for it
            if not target.exists():
                _compile(target)
    except OSError as e:
        raise BuildError(f"cannot write {target.parent}: {e}") from e
    return target


def _compile(target: Path) -> None:
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    command = _command(Path(tmp))
    log.info("building the native attention kernel (once; cached in %s)", target.parent)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        os.unlink(tmp)
        raise BuildError(f"the compiler '{command[0]}' did not run: {e}") from e
    if done.returncode != 0:
        os.unlink(tmp)
        tail = (done.stderr or done.stdout).strip()[-1500:]
        raise BuildError(f"'{command[0]}' failed (exit {done.returncode}): {tail or 'no output'}")
    os.replace(tmp, target)


def main() -> int:
    """`python -m tiered.native.build` (what `make venv` runs): build, or say why not; exit 0."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        path = build()
    except BuildError as e:
        log.warning("native attention kernel not built: %s; the engine uses the PyTorch kernels", e)
        return 0
    log.info("native attention kernel: %s", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
