"""One JSON document per benchmark run: a common header (what, when, command, machine) + results."""

from __future__ import annotations

import json
import logging
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)


def write_report(json_path: str | None, bench: str, device: str, results: dict[str, Any]) -> dict[str, Any]:
    """Build the document; write it to `json_path` when given. Returns it either way."""
    doc: dict[str, Any] = {
        "bench": bench,
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(sys.argv),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "device": device,
            "torch": torch.__version__,
        },  # fmt: skip
        **results,
    }
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(doc, indent=2, default=str) + "\n")
        log.info("wrote %s", json_path)
    return doc
