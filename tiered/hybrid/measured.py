"""Start-up measurements cached on disk (the JCT profile, the attention kernel choice): a JSON file
per exact setup, named by a hash of what the measurement depends on, so a changed setup measures
again and an unchanged one starts at once."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def cache_key(parts: dict[str, object]) -> str:
    """A short hash of what a measurement depends on, naming its cache file."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def load_cached(folder: str | Path, kind: str, key: str) -> Any | None:
    """The body cached for `key` (None when absent or unreadable: the caller measures again)."""
    path = Path(folder) / f"{kind}-{key}.json"
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())["body"]
    except (ValueError, KeyError, TypeError):
        log.warning("ignoring unreadable cached %s measurement %s", kind, path)
        return None


def save_cached(folder: str | Path, kind: str, key: str, body: Any, parts: dict[str, object]) -> Path:
    """Write a measurement's body (with the parts its key hashes) to its cache file; returns the path."""
    path = Path(folder) / f"{kind}-{key}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"key": parts, "body": body}, indent=1, default=str) + "\n")
    return path
