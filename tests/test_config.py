from pathlib import Path

import pytest

from tiered.config import Config, ConfigError, load_config

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def test_default_yaml_is_the_embedded_tiny_model_on_cpu() -> None:
    cfg = load_config(CONFIGS / "default.yaml")
    assert cfg == Config()
    assert cfg.model.path == "embedded:tiny" and cfg.device == "cpu"


def test_every_shipped_config_loads() -> None:
    """The configs in the package (configs/ links them) and any that benchmarks/ keeps."""
    paths = sorted(CONFIGS.glob("*.yaml")) + sorted((CONFIGS.parent / "benchmarks").glob("*.yaml"))
    assert {"default.yaml", "bench.yaml", "bench-m.yaml"} <= {p.name for p in paths}
    for path in paths:
        load_config(path)


def test_overrides_apply_after_the_file(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("forward:\n  chunk_tokens: 64\n")
    cfg = load_config(f, ["forward.mode=vanilla", "model.max_model_len=100"])
    assert (cfg.forward.chunk_tokens, cfg.forward.mode, cfg.model.max_model_len) == (64, "vanilla", 100)


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["forward.chunk=3"], "forward.chunk"),
        (["nope.x=1"], "nope"),
        (["forward.chunk_tokens=abc"], "forward.chunk_tokens"),
        (["forward.chunk_tokens=0"], "forward.chunk_tokens"),
        (["forward.chunk_tokens=true"], "forward.chunk_tokens"),
        (["forward.mode=fast"], "forward.mode"),
        (["model.dtype=int8"], "model.dtype"),
        (["device=gpu"], "device"),
        (["forward=3"], "forward"),
    ],
)
def test_bad_keys_and_values_name_the_key(overrides: list[str], named: str) -> None:
    with pytest.raises(ConfigError, match=f"'{named}'"):
        load_config(None, overrides)


def test_unknown_key_in_file_is_named(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("model:\n  pth: x\n")
    with pytest.raises(ConfigError, match="'model.pth'"):
        load_config(f)


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
