"""Pagoda's child processes (the engine core, workers): they end with their
parent, so a SIGKILLed server leaves no process holding the GPU, and an
error they hit while starting is raised in the parent as the kind the caller
would catch in process."""

from __future__ import annotations

import builtins
import os
import select
import threading
import time


def exit_with_parent() -> None:
    """Ends this process as soon as its parent is gone."""
    try:
        parent = os.pidfd_open(os.getppid())
    except (AttributeError, OSError):  # no pidfd (old kernel): poll instead
        parent = None
    parent_pid = os.getppid()

    def watch() -> None:
        if parent is not None:
            select.select([parent], [], [])
        else:
            while os.getppid() == parent_pid:
                time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="pagoda-parent-watch", daemon=True).start()


def raise_startup_error(kind: str, text: str, otherwise: type[Exception], what: str) -> None:
    """Raises the error a child reported while starting (its type's name
    and message): bad flags or model files as ValueError or OSError, as in
    process; anything else as `otherwise` ("{what} failed to start: ...")."""
    error = getattr(builtins, kind, None)
    if isinstance(error, type) and issubclass(error, ValueError):
        raise ValueError(text)
    if isinstance(error, type) and issubclass(error, OSError):
        raise OSError(text)
    raise otherwise(f"{what} failed to start: {kind}: {text}")
