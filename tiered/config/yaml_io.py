"""The configuration tree read from and written to YAML: one key of the file per field, unknown
keys and values of the wrong type or range refused by name, `--set section.key=value` overrides."""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from tiered.config.tree import Config, ConfigError, require


def _check_value(value: Any, hint: Any, key: str) -> Any:
    """Check `value` against a type hint of the config tree; return it (ints widen to float)."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        allowed = typing.get_args(hint)
        require(value in allowed, key, f"must be one of {', '.join(map(str, allowed))}; got {value!r}")
        return value
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _check_value(value, option, key)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0])
    if dataclasses.is_dataclass(hint):
        require(isinstance(value, dict), key, f"must be a mapping, got {value!r}")
        return _build(hint, value, key)  # type: ignore[arg-type]
    if origin is list:
        require(isinstance(value, list), key, f"must be a list, got {value!r}")
        (item,) = typing.get_args(hint)
        return [_check_value(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        require(isinstance(value, dict), key, f"must be a mapping, got {value!r}")
        return dict(value)
    if hint is bool:
        require(isinstance(value, bool), key, f"must be true or false, got {value!r}")
    elif hint is int:
        require(isinstance(value, int) and not isinstance(value, bool), key, f"must be an integer, got {value!r}")
    elif hint is float:
        require(isinstance(value, int | float) and not isinstance(value, bool), key, f"must be a number, got {value!r}")
        return float(value)
    elif hint is str:
        require(isinstance(value, str), key, f"must be a string, got {value!r}")
    return value


def _build(cls: type, raw: dict[str, Any], prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in names:
            full = f"{prefix}.{key}" if prefix else str(key)
            raise ConfigError(f"unknown config key '{full}' (known here: {', '.join(sorted(names))})")
    kwargs = {key: _check_value(value, hints[key], f"{prefix}.{key}" if prefix else key) for key, value in raw.items()}
    return cls(**kwargs)


def _apply_override(raw: dict[str, Any], assignment: str) -> None:
    key, sep, text = assignment.partition("=")
    if not sep or not key:
        raise ConfigError(f"override '{assignment}' must look like section.key=value")
    node = raw
    parts = key.strip().split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"config key '{key}': '{part}' is not a section")
        node = child
    node[parts[-1]] = yaml.safe_load(text) if text.strip() else ""


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Build the config from an optional YAML file, then `key=value` overrides, in that order."""
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file '{path}' does not exist") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file '{path}' is not valid YAML: {exc}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file '{path}' must hold a mapping at the top level")
        raw = loaded or {}
    for assignment in overrides or []:
        _apply_override(raw, assignment)
    return _build(Config, raw)


def config_to_dict(config: Config) -> dict[str, Any]:
    """The config as plain data (for logs and benchmark JSON)."""
    return dataclasses.asdict(config)


def with_overrides(config: Config, overrides: list[str]) -> Config:
    """`config` with `key=value` overrides applied (checked as in `load_config`)."""
    raw = config_to_dict(config)
    for assignment in overrides:
        _apply_override(raw, assignment)
    return _build(Config, raw)  # type: ignore[no-any-return]


def write_config(config: Config, path: str | Path) -> Path:
    """Write `config` as YAML that `load_config` reads back to an equal config."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(yaml.safe_dump(config_to_dict(config), sort_keys=False))
    return Path(path)
