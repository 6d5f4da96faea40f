import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tiered import __version__
from tiered.api.serve_options import api_key, chat_template, serve_overrides, served_model_names
from tiered.cli import build_parser, main
from tiered.config import ConfigError, load_config
from tiered.config.options import parse_bytes


def test_run_scores_every_example_post_through_the_engine(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    overrides = ["--set", f"model.path={tiny_dir}", "--set", f"scheduler.profile_cache_dir={tmp_path}"]
    assert main(["run", *overrides]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert len(rows) == 12  # two calls of six posts
    first, second = rows[:6], rows[6:]
    for call in (first, second):
        assert [int(r[1]) for r in call] == list(range(6))
        for row in call:
            tokens, device_hit, host_hit, shared, computed, batch = map(int, row[2:8])
            assert device_hit + host_hit + shared + computed == tokens and batch == 6
            p_yes, p_no = float(row[9]), float(row[10])
            assert abs(p_yes + p_no - 1) < 2e-3 and 0 < p_yes < 1
    # First call: one post computes the profile (three 256-token blocks and its tail) for the batch.
    leads = [r for r in first if int(r[5]) == 0]
    assert len(leads) == 1 and all(int(r[3]) == int(r[4]) == 0 for r in first)
    assert all(int(r[5]) >= 768 for r in first if r is not leads[0])
    # Second call: the profile's blocks come from the tiers, so every post computes only its own tokens.
    assert all(int(r[3]) + int(r[4]) == 768 for r in second)
    assert [r[9:11] for r in first] == [r[9:11] for r in second]  # the same answers


def test_run_with_two_pipeline_stages_answers_as_one_process(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    overrides = [
        "--set",
        f"model.path={tiny_dir}",
        "--set",
        f"scheduler.profile_cache_dir={tmp_path}",
        "--set",
        "cache.suffix=discard",
        "--set",
        "model.dtype=float32",
    ]
    assert main(["run", *overrides]) == 0
    one = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert main(["run", "--pipeline-parallel-size", "2", *overrides]) == 0
    two = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    # Equal answers (P(Yes), P(No)), tokens and batches; which post of a batch computes the shared profile
    # follows the JCT fit's order (profiled per thread count), so the hit/shared/computed split may differ.
    assert len(two) == 12 and [r[:3] + r[7:8] + r[9:11] for r in two] == [r[:3] + r[7:8] + r[9:11] for r in one]
    assert sum(int(r[6]) for r in two if r[0] == "1") == sum(int(r[6]) for r in one if r[0] == "1")
    # What stages do not support yet is refused by name.
    assert main(["run", "-pp", "2", "--set", f"model.path={tiny_dir}", "--set", "forward.mode=chunked"]) == 2
    assert "config key 'forward.mode': 'chunked' is not yet supported" in capsys.readouterr().err


def test_run_names_a_bad_config_value(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--set", "forward.mode=turbo"]) == 2
    assert "'forward.mode'" in capsys.readouterr().err


def _unsupported_model(tiny_dir: Path, tmp_path: Path) -> Path:
    """A copy of the tiny model whose config.json names an architecture we do not implement."""
    folder = tmp_path / "gpt2ish"
    shutil.copytree(tiny_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    return folder


def test_serve_names_an_unsupported_architecture_in_one_line_before_any_engine_starts(
    tiny_dir: Path, tmp_path: Path
) -> None:
    folder = _unsupported_model(tiny_dir, tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "tiered", "serve", str(folder), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()[-1:]
    assert line.startswith("tiered: error: ") and "architecture 'GPT2LMHeadModel' is not supported" in line
    assert str(folder / "config.json") in line
    assert "Traceback" not in done.stderr and "engine" not in done.stderr.lower()


SERVE_SCRIPT = """
import multiprocessing, sys
from tiered.api import engine_client

spawn = engine_client.EngineClient.spawn


def recorded(self, hold=False):
    print("torch at the spawn:", "torch" in sys.modules, "held:", hold, flush=True)
    spawn(self, hold)


engine_client.EngineClient.spawn = recorded
from tiered.cli import main

code = main(["serve", sys.argv[1], "--port", "0"])
print("code:", code, "children:", len(multiprocessing.active_children()), flush=True)
"""


def test_serve_spawns_its_engine_held_before_torch_loads_and_stops_it_when_a_check_fails(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """`tiered serve` itself (its check of the model fails after the spawn): the engine process was
    spawned held before the API process loaded torch, and is gone when the command returns."""
    folder = _unsupported_model(tiny_dir, tmp_path)
    cmd = [sys.executable, "-c", SERVE_SCRIPT, str(folder)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["torch at the spawn: False held: True", "code: 2 children: 0"]
    assert "Traceback" not in done.stderr and "architecture 'GPT2LMHeadModel' is not supported" in done.stderr


def test_make_model_cli(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tiered", "make-model", "tiny", "--out", str(tmp_path / "m")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "m" / "config.json").exists()


@pytest.mark.parametrize(
    ("text", "value"), [("1024", 1024), ("512MiB", 512 * 2**20), ("2GB", 2 * 10**9), ("1.5 KiB", 1536)]
)
def test_parse_bytes(text: str, value: int) -> None:
    assert parse_bytes(text) == value


def _serve_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def test_vllms_serving_flags_map_onto_the_config() -> None:
    args = _serve_args(
        "embedded:bench",
        "--max-model-len",
        "2048",
        "--dtype",
        "half",
        "--block-size",
        "64",
        "--kv-offloading-size",
        "1.5",
        "--no-enable-prefix-caching",
        "--enable-lora",
        "--lora-modules",
        "a.b=/x",
        '{"name": "c", "path": "/y"}',
        "--max-loras",
        "2",
        "--max-lora-rank",
        "32",
    )
    cfg = load_config(None, ["model.max_model_len=9", "cache.block_tokens=8", *serve_overrides(args)])
    assert cfg.model.path == "embedded:bench" and cfg.model.max_model_len == 2048 and cfg.model.dtype == "float16"
    assert cfg.cache.block_tokens == 64 and cfg.cache.host.lmcache["max_local_cpu_size"] == 1.5
    assert (cfg.cache.retention, cfg.cache.suffix, cfg.cache.host.enabled) == ("none", "discard", False)
    assert cfg.lora.enabled and cfg.lora.modules == {"a.b": "/x", "c": "/y"}
    assert (cfg.lora.max_loras, cfg.lora.max_lora_rank) == (2, 32)
    assert serve_overrides(_serve_args()) == []  # no flag: the YAML as it is
    pipeline = ["cache.suffix=discard", *serve_overrides(_serve_args("--pipeline-parallel-size", "2"))]
    assert load_config(None, pipeline).engine.pipeline_stages == 2
    # An explicit --dtype auto asks for the per-machine choice even where the YAML forces a dtype.
    cfg = load_config(
        None, ["model.dtype=bfloat16", *serve_overrides(_serve_args("--dtype", "auto", "--kv-cache-dtype", "float32"))]
    )
    assert (cfg.model.dtype, cfg.cache.kv_dtype) == ("auto", "float32")
    with pytest.raises(SystemExit):
        _serve_args("--dtype", "fp8")


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["/path/to/model"], ["/path/to/model"]),  # as given, not the folder's name
        (["org/name"], ["org/name"]),
        (["embedded:tiny"], ["embedded:tiny"]),
        (["~/models/m/"], ["~/models/m/"]),  # not expanded, not stripped
        (["/m", "--served-model-name", "a", "org/b"], ["a", "org/b"]),
        ([], ["embedded:from-yaml"]),  # no argument: the config's model.path
    ],
)
def test_the_served_model_names_default_to_the_model_as_given(argv: list[str], names: list[str]) -> None:
    args = _serve_args(*argv)
    cfg = load_config(None, ["model.path=embedded:from-yaml", *serve_overrides(args)])
    assert served_model_names(args, cfg) == names


def test_return_tokens_as_token_ids_is_a_vllm_flag() -> None:
    assert _serve_args().return_tokens_as_token_ids is False
    assert _serve_args("--return-tokens-as-token-ids").return_tokens_as_token_ids is True


def test_the_api_key_comes_from_the_flag_then_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TIERED_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert api_key(_serve_args()) is None
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert api_key(_serve_args()) == "from-vllm"
    monkeypatch.setenv("TIERED_API_KEY", "from-tiered")
    assert api_key(_serve_args()) == "from-tiered"
    assert api_key(_serve_args("--api-key", "flag")) == "flag"


def test_chat_template_is_a_file_or_inline(tmp_path: Path) -> None:
    (tmp_path / "t.jinja").write_text("{{ messages[0]['content'] }}")
    assert chat_template(str(tmp_path / "t.jinja")) == "{{ messages[0]['content'] }}"
    assert chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}").startswith("{% for")
    with pytest.raises(ConfigError, match="--chat-template 'nope.jinja' is neither a file nor a Jinja template"):
        chat_template("nope.jinja")


def test_help_and_version_do_not_import_torch() -> None:
    code = (
        "import sys; from tiered.cli import main\n"
        "try:\n    main(['serve', '--help'])\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    version = subprocess.run([sys.executable, "-m", "tiered", "--version"], capture_output=True, text=True)
    assert version.stdout.strip() == f"tiered {__version__}"
