import subprocess
import sys
from pathlib import Path

import pytest

from tiered.cli import main, parse_bytes


def test_run_scores_every_example_post(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--set", f"model.path={tiny_dir}"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert len(rows) == 6
    for i, row in enumerate(rows):
        tokens, device_hit, host_hit, computed = map(int, row[1:5])
        assert device_hit + host_hit + computed == tokens
        # The profile is a shared prefix: the first post computes it, the others find it on the device.
        assert device_hit == (0 if i == 0 else 768) and host_hit == 0
        p_yes, p_no = float(row[6]), float(row[7])
        assert abs(p_yes + p_no - 1) < 2e-3 and 0 < p_yes < 1


def test_run_names_a_bad_config_value(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--set", "forward.mode=turbo"]) == 2
    assert "'forward.mode'" in capsys.readouterr().err


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
