"""The server's access log and failure count, from each response's status
(pure ASGI, so streamed responses pass through untouched): at most one line
per request, written when it ends, with its status and duration. It replaces
uvicorn's access log; monitoring polls (/health, /metrics) are not logged."""

from __future__ import annotations

import logging
import time

QUIET_PATHS = frozenset({"/health", "/metrics"})
CLIENT_CLOSED = 499  # the client left before the answer (nginx's code): an abort, not a failure


class RequestLogMiddleware:
    def __init__(self, app, logger: logging.Logger | None, count_failure=None, counted_paths=frozenset()):
        """logger: None logs nothing. count_failure(status) is called for
        each response >= 400 on counted_paths."""
        self.app, self.logger = app, logger
        self.count_failure, self.counted_paths = count_failure, counted_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, status, complete = time.perf_counter(), None, False

        async def send_and_watch(message):
            nonlocal status, complete
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                complete = True
            await send(message)

        try:
            await self.app(scope, receive, send_and_watch)
        finally:
            path = scope["path"]
            status = status or 500  # nothing was sent: the app failed (or was cancelled)
            if self.count_failure is not None and path in self.counted_paths and 400 <= status != CLIENT_CLOSED:
                self.count_failure(status)
            if self.logger is not None and path not in QUIET_PATHS:
                self.logger.info("%s %s %d %.3fs%s", scope["method"], path, status, time.perf_counter() - started,
                                 "" if complete else " (incomplete)")
