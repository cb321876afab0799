"""Child processes that end with their parent: a SIGKILLed server must not
leave an engine core or a worker holding the GPU."""

from __future__ import annotations

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
