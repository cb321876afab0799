"""Pagoda's loggers: one 'pagoda' hierarchy with a compact operator-facing
format; PAGODA_LOG_LEVEL (default INFO) sets the level."""

from __future__ import annotations

import logging
import os

_configured = False
_FORMAT = "%(levelname)s %(asctime)s %(name)s: %(message)s"
_DATE_FORMAT = "%m-%d %H:%M:%S"


def init_logger(name: str) -> logging.Logger:
    global _configured
    if not _configured:
        root = logging.getLogger("pagoda")
        if not root.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter(_FORMAT, _DATE_FORMAT))
            root.addHandler(handler)
        root.setLevel(os.environ.get("PAGODA_LOG_LEVEL", "INFO").upper())
        root.propagate = False
        _configured = True
    return logging.getLogger(name)


def tag_process_logs() -> None:
    """Names the process in every line ("(pagoda-engine-core) ..."): the
    server's processes share one stderr."""
    init_logger("pagoda")
    for handler in logging.getLogger("pagoda").handlers:
        handler.setFormatter(logging.Formatter("(%(processName)s) " + _FORMAT, _DATE_FORMAT))
