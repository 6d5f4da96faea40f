"""The residual stream in a file (`forward.spill_dir`): the same results as in memory, the bytes on
disk and not in the page cache, memory per token down by the stream's size, bad paths refused."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

import pytest
import torch

import tiered.hybrid.forward as forward_module
from benchmarks.mil import ForwardSetup, probe_peak
from tiered.cli import main
from tiered.config import ConfigError, load_config
from tiered.engine import Engine, ScoreParams
from tiered.hybrid.forward import BatchItem, forward_batch
from tiered.hybrid.loader import load_model, read_args
from tiered.hybrid.model import CausalLM
from tiered.hybrid.spill import Spill, check_spill

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def _resident_bytes(fd: int) -> int:
    """Bytes of the file behind `fd` in the page cache (mincore on a mapping of it)."""
    size = os.fstat(fd).st_size
    if size == 0:
        return 0
    addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
    try:
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = ctypes.create_string_buffer(pages)
        assert _libc.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
        return sum(b & 1 for b in vec.raw) * mmap.PAGESIZE
    finally:
        _libc.munmap(addr, size)


def _files_open_in(directory: Path) -> list[int]:
    """This process's descriptors of files in `directory` (unnamed ones included)."""
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(directory) + "/"):
            fds.append(int(fd))
    return fds


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def model(request: pytest.FixtureRequest, tiny_dir: Path) -> CausalLM:
    return load_model(tiny_dir, request.param, "cpu")


def _batch(model: CausalLM, kept: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]) -> list[BatchItem]:
    """A prefix shared by two requests (one a follower of the other), and a request without one;
    every computed layer's K,V kept in `kept` by (item, layer)."""
    a = model.args
    g = torch.Generator().manual_seed(0)
    dtype = model.model.embed_tokens.weight.dtype
    prefix = [
        tuple(torch.randn((40, a.num_kv_heads, a.head_dim), generator=g).to(dtype) for _ in "kv")
        for _ in range(a.num_layers)
    ]

    def sink(item: int):
        return lambda layer, k, v: kept.__setitem__((item, layer), (k.clone(), v.clone()))

    ids = [torch.randint(0, a.vocab_size, (n,), generator=g) for n in (300, 90, 500)]
    return [
        BatchItem(ids[0], prefix, sink(0)),  # type: ignore[arg-type]
        BatchItem(ids[1], prefix, sink(1), lead=0, num_shared=50),  # type: ignore[arg-type]
        BatchItem(ids[2], None, sink(2)),
    ]


def test_a_spilled_forward_equals_the_one_in_memory(model: CausalLM, tmp_path: Path) -> None:
    """The same operations on the same rows, read from a file: logits and every layer's K,V bitwise equal."""
    kept_mem: dict = {}
    kept_file: dict = {}
    in_memory = forward_batch(model, _batch(model, kept_mem), chunk_tokens=128)
    spilled = forward_batch(model, _batch(model, kept_file), chunk_tokens=128, spill=Spill(str(tmp_path), 1))
    assert torch.equal(in_memory, spilled)
    assert kept_mem.keys() == kept_file.keys() and len(kept_mem) == 3 * model.args.num_layers
    for key, (k, v) in kept_mem.items():
        assert torch.equal(k, kept_file[key][0]) and torch.equal(v, kept_file[key][1]), key
    assert not list(tmp_path.iterdir())  # the file had no name and is gone


def test_the_stream_is_on_disk_not_in_the_page_cache(model: CausalLM, tmp_path: Path) -> None:
    """At every layer the file holds the whole stream and none of its pages is cached in memory."""
    a = model.args
    seen: list[tuple[int, int]] = []  # (file size, resident bytes) at each layer's K,V

    def sink(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        (fd,) = _files_open_in(tmp_path)
        seen.append((os.fstat(fd).st_size, _resident_bytes(fd)))

    ids = torch.randint(0, a.vocab_size, (3000,), generator=torch.Generator().manual_seed(1))
    forward_batch(model, [BatchItem(ids, None, sink)], chunk_tokens=256, spill=Spill(str(tmp_path), 1))
    row_bytes = a.hidden_size * model.model.embed_tokens.weight.element_size()
    assert seen == [(3000 * row_bytes, 0)] * a.num_layers


def test_only_forwards_of_min_tokens_spill(model: CausalLM, tmp_path: Path) -> None:
    """Below `min_tokens` no file is made (a missing directory is never opened); at it, one is."""
    a = model.args
    ids = torch.randint(0, a.vocab_size, (600,), generator=torch.Generator().manual_seed(2))
    missing = tmp_path / "missing"
    forward_batch(model, [BatchItem(ids[:300]), BatchItem(ids[300:])], spill=Spill(str(missing), 601))
    with pytest.raises(FileNotFoundError):
        forward_batch(model, [BatchItem(ids[:300]), BatchItem(ids[300:])], spill=Spill(str(missing), 600))


def test_spilling_takes_the_stream_out_of_the_measured_peak(tiny_dir: Path, tmp_path: Path) -> None:
    """Per extra token, a spilled forward's peak grows by about the residual stream's bytes less."""
    a = read_args(tiny_dir)
    slope = {}
    for name, spill in (("memory", None), ("file", Spill(str(tmp_path), 1))):
        setup = ForwardSetup(str(tiny_dir), "float32", "cpu", 512, spill)
        short, long = (probe_peak(setup, "hybrid", n) for n in (4096, 16384))
        slope[name] = (long - short) / (16384 - 4096)
    stream = 4 * a.hidden_size  # fp32 bytes per token
    assert 0.7 * stream < slope["memory"] - slope["file"] < 1.3 * stream, slope


def test_an_engine_with_a_spill_dir_answers_as_one_without(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    opened: list[int] = []  # rows of each spilled stream the engine's forwards opened

    class Counted(forward_module.ResidualFile):
        def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
            super().__init__(*args, **kwargs)
            opened.append(self.num_rows)

    monkeypatch.setattr(forward_module, "ResidualFile", Counted)
    fixed = [f"model.path={tiny_dir}", "cache.block_tokens=16", "model.max_model_len=2048", "cache.suffix=discard"]
    profile = ["scheduler.profile_tokens=[64, 256]", f"scheduler.profile_cache_dir={tmp_path}"]
    spill = [f"forward.spill_dir={tmp_path / 'spill'}", "forward.spill_min_tokens=1200"]
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 1300, (n,), generator=g) for n in (200, 1500)]
    answers = []
    for extra in ([], spill):
        engine = Engine(load_config(None, [*fixed, *profile, *extra]))
        opened.clear()  # not the start-up profile's forwards
        ids = [engine.submit(p, ScoreParams(logprob_token_ids=(11,))) for p in prompts]
        by_id = {r.request_id: r.logprobs[11] for r in engine.run()}
        answers.append([by_id[i] for i in ids])
        engine.close()
        if extra:  # the long prompt's forward (alone or batched with the short one) spilled, only it
            assert len(opened) == 1 and opened[0] >= 1500, opened
        else:
            assert opened == []
    assert answers[0] == answers[1]
    assert (tmp_path / "spill").is_dir()  # made at start-up


def test_a_spill_dir_that_cannot_hold_files_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a_file = tmp_path / "not-a-directory"
    a_file.write_text("")
    cfg = load_config(None, [f"forward.spill_dir={a_file}"])
    with pytest.raises(ConfigError, match=r"config key 'forward.spill_dir': '.*not-a-directory' cannot hold"):
        check_spill(cfg.forward)
    assert main(["serve", "--set", f"forward.spill_dir={a_file}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "config key 'forward.spill_dir'" in err[0] and str(a_file) in err[0]
    with pytest.raises(ConfigError, match="forward.spill_min_tokens"):
        load_config(None, ["forward.spill_min_tokens=0"])
    with pytest.raises(ConfigError, match="forward.spill_dir"):
        load_config(None, [f"forward.spill_dir={tmp_path}", "engine.pipeline_stages=2"])
