"""The wheel carries what the package reads at run time; the container files agree with the CLI."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import yaml

from tiered import __version__
from tiered.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent


def test_the_wheel_holds_data_configs_and_the_typing_marker(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path)],
        capture_output=True, text=True, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = tmp_path.glob("tiered-*.whl")
    assert wheel.name.startswith(f"tiered-{__version__}-")  # the version has one source
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in ("tiered/data/examples.json", "tiered/data/corpus.txt", "tiered/configs/default.yaml",
                   "tiered/configs/bench-m.yaml", "tiered/py.typed"):  # fmt: skip
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
