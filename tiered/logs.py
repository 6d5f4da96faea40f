"""One log format for every process of `tiered serve` (API, uvicorn, engine) and for the CLI.

Plain text, no colours (a log file holds no ANSI codes): time, level, process, logger, message.
"""

from __future__ import annotations

import logging
from typing import Any

FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s"
DATE_FORMAT = "%H:%M:%S"


def setup(level: int = logging.INFO) -> None:
    """Configure the root logger with the shared format at `level` (a no-op if logging is already set up)."""
    logging.basicConfig(level=level, format=FORMAT, datefmt=DATE_FORMAT)


def setup_ours(level: int = logging.INFO) -> None:
    """Our loggers only (`tiered.*`), in a process whose logging another framework set up (a Ray
    Serve replica: Ray's own loggers keep their handlers)."""
    logger = logging.getLogger("tiered")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(FORMAT, DATE_FORMAT))
        logger.addHandler(handler)
        logger.setLevel(level)
        logger.propagate = False


def uvicorn_config(level: str) -> dict[str, Any]:
    """uvicorn's `log_config`: its error and access logs in our format, at `level`."""
    formatter = {"format": FORMAT, "datefmt": DATE_FORMAT}
    handler = {"class": "logging.StreamHandler", "formatter": "plain", "stream": "ext://sys.stderr"}
    upper = "DEBUG" if level == "trace" else level.upper()
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": formatter},
        "handlers": {"plain": handler},
        "loggers": {
            name: {"handlers": ["plain"], "level": upper, "propagate": False}
            for name in ("uvicorn", "uvicorn.error", "uvicorn.access")
        },
    }
