"""Pagoda's loggers: one 'pagoda' hierarchy with a compact operator-facing
format; PAGODA_LOG_LEVEL (default INFO) sets the level."""

from __future__ import annotations

import logging
import os

_configured = False


def init_logger(name: str) -> logging.Logger:
    global _configured
    if not _configured:
        root = logging.getLogger("pagoda")
        if not root.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s", "%m-%d %H:%M:%S"))
            root.addHandler(handler)
        root.setLevel(os.environ.get("PAGODA_LOG_LEVEL", "INFO").upper())
        root.propagate = False
        _configured = True
    return logging.getLogger(name)
