"""The real OpenAI server in a test process: build_app + uvicorn on a free
loopback port in a background thread, ready once /health answers 200. Used
by the server tests and by `pagoda bench serve`'s tests."""

import socket
import threading
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RunningServer:
    """Serves `engine` (an AsyncLLM) as `model`; stop() shuts both down.
    app_kwargs go to build_app."""

    def __init__(self, engine, model, api_key=None, **app_kwargs):
        import uvicorn

        from pagoda.entrypoints.openai.api_server import build_app, server_config

        self.engine = engine
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = build_app(engine, model, api_key=api_key, **app_kwargs)
        self.server = uvicorn.Server(server_config(self.app, "127.0.0.1", self.port))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(self.url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(30)
        self.engine.shutdown()
