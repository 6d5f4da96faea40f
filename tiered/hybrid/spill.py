"""A long forward's residual stream kept on disk instead of in memory (`forward.spill_dir`).

Hybrid prefilling keeps two things per token while a layer runs: the residual stream (hidden
size values) and that layer's K,V. On a model whose KV heads are few against its hidden size the
residual stream is most of it, so a prompt longer than memory holds keeps it in a file: per
layer the forward reads each chunk's rows into a buffer, updates them and writes them back.
Each write is flushed (`fdatasync`) and its pages, like those of each read, are dropped from the
page cache (`POSIX_FADV_DONTNEED`; readahead is off), so the stream occupies the disk, not
memory (a directory on tmpfs would keep it in memory: `check_spill` warns).
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from tiered.config import ForwardConfig
from tiered.config.tree import require_writable_dir

log = logging.getLogger(__name__)

MEMORY_FILE_SYSTEMS = ("tmpfs", "ramfs", "devtmpfs")


@dataclass(frozen=True, slots=True)
class Spill:
    """Where a forward of at least `min_tokens` packed tokens keeps its residual stream."""

    directory: str
    min_tokens: int


def spill_of(forward: ForwardConfig) -> Spill | None:
    """The spill `forward.spill_dir` asks for (None: the residual stream stays in memory)."""
    return Spill(forward.spill_dir, forward.spill_min_tokens) if forward.spill_dir else None


def file_system_of(path: str) -> str:
    """The type of the file system holding `path` (from /proc/mounts; '' where that is unknown)."""
    target = os.path.realpath(path)
    best, kind = "", ""
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return ""
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        mount = parts[1].replace("\\040", " ")
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, kind = mount, parts[2]
    return kind


def check_spill(forward: ForwardConfig) -> None:
    """`forward.spill_dir` made if missing and a file written there once: a path that cannot hold
    the residual stream (a file, read-only, not creatable) is a ConfigError naming the key. Warns
    when it is on a file system in memory."""
    directory = forward.spill_dir
    if not directory:
        return
    require_writable_dir(directory, "forward.spill_dir", "the residual stream")
    kind = file_system_of(directory)
    if kind in MEMORY_FILE_SYSTEMS:
        log.warning("forward.spill_dir '%s' is on %s: a spilled residual stream stays in memory there", directory, kind)


def _bytes_of(t: Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, writable in place."""
    return t.view(torch.uint8).numpy().reshape(-1).data


class ResidualFile:
    """The residual stream [N, D] of one forward in an unnamed file in `directory` (gone when
    closed, or when the process dies). Rows are read into a buffer of `chunk` rows and written
    back from it; on a CUDA device the buffer is pinned host memory and `read` returns a copy on
    the device."""

    def __init__(self, directory: str, num_rows: int, dim: int, dtype: torch.dtype, chunk: int, device: torch.device):
        self.num_rows, self.dim, self.dtype, self.device = num_rows, dim, dtype, device
        self.row_bytes = dim * torch.empty((), dtype=dtype).element_size()
        self._file = tempfile.TemporaryFile(dir=directory)
        self._fd = self._file.fileno()
        os.ftruncate(self._fd, num_rows * self.row_bytes)
        os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead into the page cache
        pin = device.type == "cuda"
        self._host = torch.empty((chunk, dim), dtype=dtype, pin_memory=pin)

    def read(self, start: int, end: int) -> Tensor:
        """Rows [start, end) (at most `chunk` of them), in a buffer the next `read` reuses."""
        n = end - start
        host = self._host[:n]
        view, offset = _bytes_of(host), start * self.row_bytes
        done = 0
        while done < len(view):
            got = os.preadv(self._fd, [view[done:]], offset + done)
            if got <= 0:
                raise OSError(f"the residual stream's file ended at byte {offset + done}")
            done += got
        os.posix_fadvise(self._fd, offset, len(view), os.POSIX_FADV_DONTNEED)
        return host if self.device.type == "cpu" else host.to(self.device)

    def write(self, start: int, rows: Tensor) -> None:
        """Store `rows` [n, D] at rows [start, start + n), on disk (flushed, not kept in the page cache)."""
        host = rows if rows.device.type == "cpu" and rows.is_contiguous() else self._host[: rows.shape[0]]
        if host is not rows:
            host.copy_(rows)
        view, offset = _bytes_of(host), start * self.row_bytes
        done = 0
        while done < len(view):
            done += os.pwrite(self._fd, view[done:], offset + done)
        os.fdatasync(self._fd)
        os.posix_fadvise(self._fd, offset, len(view), os.POSIX_FADV_DONTNEED)

    def rows(self, index: Tensor) -> Tensor:
        """The rows at `index` [R] (a new tensor [R, D] on the device)."""
        out = torch.empty((index.numel(), self.dim), dtype=self._host.dtype)
        for j, r in enumerate(index.tolist()):
            view, offset = _bytes_of(out[j : j + 1]), int(r) * self.row_bytes
            if os.preadv(self._fd, [view], offset) != len(view):
                raise OSError(f"the residual stream's file ended before row {r}")
        os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return out.to(self.device)

    def close(self) -> None:
        """Remove the file (it has no name: closing it frees its blocks)."""
        self._file.close()
