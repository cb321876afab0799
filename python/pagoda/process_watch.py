"""Pagoda's child processes (the engine core, workers): they are spawned
without the caller's __main__, end with their parent, so a SIGKILLed server
leaves no process holding the GPU, and an error they hit while starting is
raised in the parent as the kind the caller would catch in process."""

from __future__ import annotations

import builtins
import multiprocessing
import os
import select
import sys
import threading
import time

_UNSET = object()


def spawn(process: multiprocessing.Process) -> None:
    """Starts a process of the "spawn" context (CUDA cannot be forked)
    without running the caller's __main__ in it: multiprocessing would
    re-run a script there, and a script that builds an LLM at its top level
    (no `if __name__ == "__main__":` guard, as most offline scripts are
    written) would start another engine inside the child. Pagoda's children
    need nothing from __main__: their targets and arguments are Pagoda's."""
    main = sys.modules["__main__"]
    saved_file, saved_spec = main.__dict__.pop("__file__", _UNSET), main.__dict__.get("__spec__")
    main.__spec__ = None  # with neither, spawn leaves __main__ alone in the child
    try:
        process.start()
    finally:
        main.__spec__ = saved_spec
        if saved_file is not _UNSET:
            main.__file__ = saved_file


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


def reported_error(kind: str, text: str, kinds: tuple[type[Exception], ...]) -> Exception | None:
    """An error another process reported as its type's name and message,
    rebuilt as the first of `kinds` that type is (a builtin subclass comes
    back as its base: not every subclass is made from a message alone), or
    None when it is none of them."""
    error = getattr(builtins, kind, None)
    for base in kinds:
        if isinstance(error, type) and issubclass(error, base):
            return base(text)
    return None


def raise_startup_error(kind: str, text: str, otherwise: type[Exception], what: str) -> None:
    """Raises the error a child reported while starting (its type's name
    and message): bad flags or model files as ValueError or OSError, as in
    process; anything else as `otherwise` ("{what} failed to start: ...")."""
    raise reported_error(kind, text, (ValueError, OSError)) or otherwise(f"{what} failed to start: {kind}: {text}")
