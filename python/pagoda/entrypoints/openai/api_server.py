"""The OpenAI-compatible HTTP server: `tools/bazel run //server -- --port 8000`.

build_app(engine, served_model_name, ...) makes the Starlette app around an
AsyncLLM (tests run it in-process); main(argv) parses vLLM's flags, builds
the engine and serves the app with uvicorn. The endpoints are one table
(`endpoints` in build_app), which /openapi.json describes."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import secrets
import signal
import socket
import sys

import numpy as np
import uvicorn
import uvicorn.protocols.http.httptools_impl
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pagoda.engine.async_llm import AsyncLLM
from pagoda.entrypoints.cli_args import (add_engine_args, engine_args_from_cli, non_negative_int, positive_float,
                                         positive_int)
from pagoda.entrypoints.openai.errors import APIError, from_validation_error
from pagoda.entrypoints.openai.openapi import Endpoint, openapi_schema
from pagoda.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                DetokenizeResponse, TokenizeChatRequest, TokenizeCompletionRequest,
                                                TokenizeResponse)
from pagoda.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from pagoda.entrypoints.openai.request_log import RequestLogMiddleware
from pagoda.entrypoints.openai.serving_chat import create_chat_completion
from pagoda.entrypoints.openai.serving_completion import create_completion
from pagoda.entrypoints.openai.serving_engine import ServerState, now, with_cancellation
from pagoda.entrypoints.openai.serving_tokenization import create_detokenize, create_tokenize, tokenize_schema
from pagoda.entrypoints.openai.tokenizer_pool import TokenizerPool
from pagoda.entrypoints.openai.tool_parsers import TOOL_PARSERS
from pagoda.logger import init_logger, tag_process_logs
from pagoda.prometheus import PrometheusStatLogger
from pagoda.version import __version__

logger = init_logger("pagoda.server")

MAX_BODY_BYTES = 32 * 1024 * 1024  # a bigger body is refused (413) before it is parsed
# Arrays and objects inside one another at most (a request needs 5); deeper
# bodies are refused before anything walks them recursively.
MAX_JSON_DEPTH = 32
TOO_DEEP = f"the body's JSON is nested more than {MAX_JSON_DEPTH} levels deep"
# A request line and headers over this many bytes are refused (h11's default bound).
MAX_HEADER_BYTES = 16 * 1024
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
ABORT_GRACE_S = 10.0  # after the drain's aborts, how long uvicorn waits before cutting connections


def build_app(engine: AsyncLLM, served_model_name: str | list[str], api_key: str | None = None,
              chat_template: str | None = None, log_requests: bool = False,
              allowed_origins: list[str] | None = None, engine_stall_timeout: float | None = 30.0,
              max_queued_requests: int | None = None, stream_send_timeout: float | None = 30.0,
              tokenizer_threads: int | None = None, tool_call_parser: str | None = None,
              enable_auto_tool_choice: bool = False, reasoning_parser: str | None = None) -> Starlette:
    """allowed_origins: CORS origins (None: no CORS headers). engine_stall_timeout:
    /health fails when the engine has work but no step finished for this
    many seconds (None: only a dead engine fails it). max_queued_requests:
    generation requests get 503 while this many engine requests wait to run
    (None: no bound). stream_send_timeout: a stream whose client has not
    taken a chunk for this many seconds is aborted (None: never).
    tokenizer_threads: how many prompts tokenize at once (TokenizerPool's
    default when None). tool_call_parser, enable_auto_tool_choice,
    reasoning_parser: vLLM's flags (tool_parsers, reasoning_parsers)."""
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError(f"--enable-auto-tool-choice needs --tool-call-parser ({', '.join(TOOL_PARSERS)})")
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    metrics = PrometheusStatLogger(engine, names[0])
    engine.stat_loggers.append(metrics)
    state = ServerState(engine, names, TokenizerPool(engine.get_tokenizer(), tokenizer_threads), api_key,
                        chat_template, metrics, max_queued_requests, stream_send_timeout,
                        None if tool_call_parser is None else TOOL_PARSERS[tool_call_parser](),
                        enable_auto_tool_choice,
                        None if reasoning_parser is None else REASONING_PARSERS[reasoning_parser]())

    def check_key(request: Request) -> None:
        if state.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {state.api_key}".encode()):
            raise APIError("Incorrect or missing API key", status=401, code="invalid_api_key")

    async def parse(request: Request, schema):
        """The body as `schema` (a model, or a function of the JSON picking one)."""
        check_key(request)
        media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media_type and media_type != "application/json":  # no Content-Type at all is taken as JSON
            raise APIError(f"Content-Type must be application/json, got {media_type!r}", status=415,
                           code="unsupported_media_type")
        body = await read_body(request)
        try:
            data = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise APIError(f"the body is not valid JSON: {exc}") from None
        except RecursionError:  # nested past the interpreter's stack, so past MAX_JSON_DEPTH too
            raise APIError(TOO_DEEP) from None
        if nested_deeper(body, MAX_JSON_DEPTH):
            raise APIError(TOO_DEEP)
        if not isinstance(data, dict):
            raise APIError("the body must be a JSON object")
        if not isinstance(schema, type):
            schema = schema(data)
        try:
            return schema.model_validate(data)
        except ValidationError as exc:
            raise from_validation_error(exc) from None

    async def completions(request: Request) -> Response:
        body = await parse(request, CompletionRequest)
        return await answer(request, body, create_completion(state, body))

    async def chat_completions(request: Request) -> Response:
        body = await parse(request, ChatCompletionRequest)
        return await answer(request, body, create_chat_completion(state, body))

    async def answer(request: Request, body, handler) -> Response:
        # A stream's handler returns its response without waiting, and the
        # stream watches for the disconnect itself: no watcher tasks for it.
        return await (handler if body.stream else with_cancellation(request, handler))

    async def tokenize(request: Request) -> Response:
        return await create_tokenize(state, await parse(request, tokenize_schema))

    async def detokenize(request: Request) -> Response:
        return await create_detokenize(state, await parse(request, DetokenizeRequest))

    async def models(request: Request) -> Response:
        check_key(request)
        # root names the model as served, never its path on this machine.
        data = [dict(id=name, object="model", created=now(), owned_by="pagoda", root=name,
                     max_model_len=state.max_model_len) for name in names]
        return JSONResponse(dict(object="list", data=data))

    async def health(request: Request) -> Response:
        try:
            engine.check_health(max_stall=engine_stall_timeout)
        except Exception as exc:  # noqa: BLE001 -- any failure means unhealthy
            return APIError(f"the engine is not serving: {exc}", status=503).response()
        return Response(status_code=200)

    async def version(request: Request) -> Response:
        return JSONResponse({"version": __version__})

    async def prometheus(request: Request) -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def openapi(request: Request) -> Response:
        return JSONResponse(openapi_schema(endpoints, "Pagoda", __version__, api_key is not None))

    async def on_api_error(request: Request, exc: APIError) -> Response:
        return exc.response()

    async def on_http_error(request: Request, exc: HTTPException) -> Response:
        message = "Not Found" if exc.status_code == 404 else str(exc.detail)
        return APIError(f"{message}: {request.method} {request.url.path}", status=exc.status_code).response()

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        logger.exception("unexpected error serving %s", request.url.path)  # the trace stays in the log
        return APIError("internal server error", status=500, type="server_error").response()

    generation_errors = (400, 404, 413, 415, 503)
    endpoints = [
        Endpoint("/v1/completions", "POST", completions, "Text completion (OpenAI)",
                 "A text_completion object, or with stream=true server-sent text_completion chunks ending in "
                 "`data: [DONE]`", (CompletionRequest,), errors=generation_errors,
                 content_types=("application/json", "text/event-stream"), keyed=True),
        Endpoint("/v1/chat/completions", "POST", chat_completions, "Chat completion (OpenAI)",
                 "A chat.completion object, or with stream=true server-sent chat.completion.chunk events ending "
                 "in `data: [DONE]`", (ChatCompletionRequest,), errors=generation_errors,
                 content_types=("application/json", "text/event-stream"), keyed=True),
        Endpoint("/v1/models", "GET", models, "The served model names (OpenAI)", "A list of model objects",
                 keyed=True),
        Endpoint("/tokenize", "POST", tokenize, "A prompt, or chat messages through the chat template, to token ids",
                 "The token ids, their count and max_model_len", (TokenizeCompletionRequest, TokenizeChatRequest),
                 (TokenizeResponse,), errors=(400, 404, 413, 415), keyed=True),
        Endpoint("/detokenize", "POST", detokenize, "Token ids to text", "The text", (DetokenizeRequest,),
                 (DetokenizeResponse,), errors=(400, 404, 413, 415), keyed=True),
        Endpoint("/health", "GET", health, "Liveness of the engine", "Healthy (empty body)", errors=(503,),
                 content_types=()),
        Endpoint("/version", "GET", version, "Pagoda's version", "{\"version\": ...}"),
        Endpoint("/metrics", "GET", prometheus, "Prometheus metrics (pagoda:*)", "Prometheus text format",
                 content_types=("text/plain",)),
        Endpoint("/openapi.json", "GET", openapi, "This document", "OpenAPI 3.1"),
    ]
    routes = [Route(e.path, e.handler, methods=[e.method]) for e in endpoints]
    middleware = [Middleware(RequestLogMiddleware, logger=logger if log_requests else None,
                             count_failure=metrics.record_failure, counted_paths=GENERATION_PATHS)]
    if allowed_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["GET", "POST"],
                                     allow_headers=["*"]))
    app = Starlette(routes=routes, middleware=middleware, exception_handlers={
        APIError: on_api_error, HTTPException: on_http_error, Exception: on_unexpected})
    app.state.pagoda = state
    return app


async def read_body(request: Request) -> bytes:
    """The body, refused (413) as soon as it passes MAX_BODY_BYTES: by its
    Content-Length, or counted as it streams in (a chunked body has none),
    so no more than the limit is ever held (uvicorn discards the rest)."""
    too_large = APIError(f"request body over {MAX_BODY_BYTES} bytes", status=413)
    if int(request.headers.get("content-length") or 0) > MAX_BODY_BYTES:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


# +1 for an opening bracket, -1 for a closing one, 0 for every other byte.
_BRACKET_STEP = np.zeros(256, np.int8)
_BRACKET_STEP[list(b"[{")], _BRACKET_STEP[list(b"]}")] = 1, -1


def nested_deeper(body: bytes, limit: int) -> bool:
    """Whether valid JSON nests arrays and objects more than `limit` deep,
    vectorized (no Python loop over a body of megabytes): with the escaped
    backslashes and quotes dropped, every quote opens or closes a string,
    and the depth is the running count of the brackets outside them."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False  # too few brackets to nest that deep
    text = np.frombuffer(body.replace(b"\\\\", b"").replace(b'\\"', b""), np.uint8)
    outside = np.cumsum(text == ord('"'), dtype=np.uint8) % 2 == 0  # the uint8 wrap keeps the parity
    # json.loads parsed it, so it nests less deep than the interpreter's stack: int16 holds the count.
    return int(np.cumsum(_BRACKET_STEP[text] * outside, dtype=np.int16).max()) > limit


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagoda serve", description="Pagoda's OpenAI-compatible server")
    add_engine_args(p)  # --model, --dtype, --max-model-len, ... as `pagoda generate` and `bench` take them
    p.add_argument("--served-model-name", nargs="+", default=None, help="names clients use (default: --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("PAGODA_API_KEY"), help="also PAGODA_API_KEY")
    p.add_argument("--chat-template", default=None, help="a Jinja file or template string")
    p.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                   help="how tool calls are read from the text for tool_choice \"auto\": hermes (Qwen2.5, Qwen3), "
                        "llama3_json (Llama 3.1+)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let the model decide whether to call a tool (tool_choice "auto", the default with tools); '
                        "needs --tool-call-parser")
    p.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                   help="split the model's thinking into reasoning_content: qwen3 (<think>...</think>); "
                        "default: off")
    p.add_argument("--allowed-origins", type=origins, default=None,
                   help='CORS origins, a JSON list or comma-separated (e.g. \'["*"]\'); default: no CORS')
    p.add_argument("--disable-log-requests", action="store_true", help="no per-request log lines")
    p.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="the same: the per-request line is the server's access log")
    p.add_argument("--disable-log-stats", action="store_true", help="no periodic stats line")
    p.add_argument("--engine-stall-timeout", type=float, default=30.0,
                   help="/health fails when the engine has work but finished no step for this many seconds "
                        "(0: only when it died)")
    p.add_argument("--timeout-graceful-shutdown", type=float, default=30.0,
                   help="on SIGTERM, seconds in-flight requests get to finish before they are aborted "
                        "(uvicorn's name)")
    p.add_argument("--max-queued-requests", type=non_negative_int, default=None,
                   help="generation requests get 503 (with Retry-After) while this many engine requests (one per "
                        "prompt) wait to run (SGLang's name; default: no bound)")
    p.add_argument("--api-server-count", type=positive_int, default=1,
                   help="API server processes (HTTP, tokenization, detokenization, streaming) in front of the one "
                        "engine core, sharing the port (vLLM's name)")
    p.add_argument("--in-process-engine", action="store_true",
                   help="run the engine core in a thread of the API server process, not in a process of its own "
                        "(the GIL then shares one interpreter between the model and HTTP: for debugging)")
    p.add_argument("--tokenizer-threads", type=positive_int, default=None,
                   help="threads per API server that tokenize prompts and render chat templates, off the event "
                        "loop (default: the CPUs, at most 8)")
    p.add_argument("--stream-send-timeout", type=positive_float, default=30.0,
                   help="a stream whose client has not read a chunk for this many seconds is aborted and its "
                        "connection closed")
    return p


def origins(text: str) -> list[str]:
    """--allowed-origins: a JSON list of strings, or a comma-separated list."""
    if text.lstrip().startswith("["):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"not a JSON list: {exc}") from None
        if not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError(f"must be a list of strings, got {text!r}")
        return value
    return [o.strip() for o in text.split(",") if o.strip()]


class HttpToolsProtocol(uvicorn.protocols.http.httptools_impl.HttpToolsProtocol):
    """uvicorn's protocol on httptools (llhttp, in C: what `uvicorn[standard]`
    runs, several times cheaper per streamed chunk than h11), with the bound
    h11 has and llhttp lacks: a request line and headers over
    MAX_HEADER_BYTES are refused. A request it cannot parse gets an OpenAI
    error object rather than plain text; the connection is closed."""

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.head_bytes, self.head_done = 0, False

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.head_bytes, self.head_done = 0, False

    def on_headers_complete(self) -> None:
        self.head_done = True
        super().on_headers_complete()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # Counted after parsing: data that did not complete the head was all head.
        if not self.head_done and not self.transport.is_closing():
            self.head_bytes += len(data)
            if self.head_bytes > MAX_HEADER_BYTES:
                self.send_400_response(f"the request's headers are too large: over {MAX_HEADER_BYTES} bytes "
                                       f"with the request line")

    def send_400_response(self, msg: str) -> None:
        # msg: uvicorn's for what llhttp cannot parse, or ours for a head too large.
        body = json.dumps(APIError(msg).body()).encode()
        self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
        self.transport.close()


def server_config(app: Starlette, host: str, port: int, **kwargs) -> uvicorn.Config:
    """uvicorn's config for the app: our httptools protocol, uvloop,
    no access log (RequestLogMiddleware writes ours)."""
    return uvicorn.Config(app, host=host, port=port, http=HttpToolsProtocol, loop="uvloop", access_log=False,
                          log_level=logging.WARNING, **kwargs)


class DrainingServer(uvicorn.Server):
    """uvicorn's graceful shutdown (no new connections, wait for the open
    ones), bounded our way: `drain_timeout` seconds in, the requests still
    in flight are aborted, so each ends as a well-formed response with
    finish_reason "abort" rather than a cut connection. uvicorn's own cancel
    stays as the backstop (an engine that no longer steps).

    An engine that dies (a fault no request can be blamed for) shuts the
    server down the same way (main() then exits 1, so that a supervisor
    restarts it); until then /health and every request get 503."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLM, drain_timeout: float):
        super().__init__(config)
        self.engine, self.drain_timeout = engine, drain_timeout

    async def on_tick(self, counter: int) -> bool:
        # uvicorn's main loop ticks every 0.1 s until should_exit.
        if self.engine.errored and not self.should_exit:
            logger.error("the engine died (%r): shutting down, to exit with status 1", self.engine.dead_error)
            self.should_exit = True
        return await super().on_tick(counter)

    async def shutdown(self, sockets=None) -> None:
        logger.info("shutting down: in-flight requests get %.1f s to finish", self.drain_timeout)
        asyncio.get_running_loop().call_later(self.drain_timeout, self.engine.abort_all)
        await super().shutdown(sockets)


def main(argv: list[str] | None = None) -> None:
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.engine_stall_timeout < 0 or args.timeout_graceful_shutdown < 0:
        parser.error("--engine-stall-timeout and --timeout-graceful-shutdown must be >= 0 seconds")
    if args.skip_tokenizer_init:
        parser.error("--skip-tokenizer-init: the server needs the tokenizer (text prompts, chat, /tokenize)")
    if args.api_server_count > 1 and args.in_process_engine:
        parser.error("--api-server-count > 1 needs the engine core in its own process (drop --in-process-engine)")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        parser.error(f"--enable-auto-tool-choice needs --tool-call-parser ({', '.join(sorted(TOOL_PARSERS))})")
    os.chdir(os.environ.get("BUILD_WORKING_DIRECTORY", os.getcwd()))  # relative paths as the user typed them
    if args.chat_template is not None and os.path.isfile(args.chat_template):
        with open(args.chat_template) as f:
            args.chat_template = f.read()
    try:
        engine_args = engine_args_from_cli(args)
    except ValueError as exc:
        raise SystemExit(f"pagoda serve: error: {exc}") from None
    if args.api_server_count > 1:
        raise SystemExit(serve_with_api_servers(args, engine_args))
    raise SystemExit(serve(args, engine_args))


def serve(args: argparse.Namespace, engine_args, core: tuple[str, int, int] | None = None,
          sock: socket.socket | None = None) -> int:
    """One API server: its engine (a new engine-core process, a thread with
    --in-process-engine, or the running core given as (address, pid,
    client index)), served until SIGTERM or the engine's death. Returns
    the exit status: 0 after a clean drain, 1 when the engine died."""
    address, pid, index = core if core is not None else (None, None, 0)
    try:
        engine = AsyncLLM.from_engine_args(engine_args, multiprocess=not args.in_process_engine, core_address=address,
                                           core_pid=pid, client_index=index)
    except (ValueError, OSError) as exc:  # bad flags or model files: one line, no traceback
        raise SystemExit(f"pagoda serve: error: {exc}") from None
    model = engine.model_config.model
    names = args.served_model_name or [args.model or os.path.basename(model)]
    log_requests = not (args.disable_log_requests or args.disable_uvicorn_access_log)
    app = build_app(engine, names, api_key=args.api_key, chat_template=args.chat_template, log_requests=log_requests,
                    allowed_origins=args.allowed_origins, engine_stall_timeout=args.engine_stall_timeout or None,
                    max_queued_requests=args.max_queued_requests, stream_send_timeout=args.stream_send_timeout,
                    tokenizer_threads=args.tokenizer_threads, tool_call_parser=args.tool_call_parser,
                    enable_auto_tool_choice=args.enable_auto_tool_choice, reasoning_parser=args.reasoning_parser)
    ready = engine.ready
    if index == 0:
        where = "in this process" if engine.core_pid is None else f"in process {engine.core_pid}"
        logger.info("serving %s as %s: dtype %s on %s, max_model_len %d, KV cache %d tokens, engine core %s, "
                    "on http://%s:%d", model, names[0], ready.dtype, ready.device, ready.max_model_len,
                    ready.num_blocks * ready.block_size, where, args.host, args.port)
    # SIGTERM/SIGINT: the server drains (DrainingServer), then uvicorn
    # re-raises the signal; this handler makes that a clean exit 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    config = server_config(app, args.host, args.port,
                           timeout_graceful_shutdown=args.timeout_graceful_shutdown + ABORT_GRACE_S)
    try:
        DrainingServer(config, engine, args.timeout_graceful_shutdown).run(sockets=None if sock is None else [sock])
        died = engine.errored  # read before shutdown(), which stops it for good
    finally:
        app.state.pagoda.tokenizers.close()
        engine.shutdown(timeout=ABORT_GRACE_S)
    if died:
        return 1
    logger.info("shut down cleanly")
    return 0


def serve_with_api_servers(args: argparse.Namespace, engine_args) -> int:
    """--api-server-count N: one engine-core process and N API server
    processes on one port, each tokenizing, detokenizing and streaming for
    its own connections. SIGTERM drains them
    all; if the core or any API server dies, the rest shut down and the
    exit status is 1."""
    import multiprocessing
    import multiprocessing.connection

    from pagoda.engine.core_client import CoreStart, stop_engine_core
    from pagoda.engine.processor import front_end_model_config, eos_token_ids, load_tokenizer

    start = CoreStart(engine_args)  # the core loads while this process reads the tokenizer
    try:
        with start.cancelled_on_failure():
            model_config = front_end_model_config(engine_args)
            stop_ids = eos_token_ids(model_config, load_tokenizer(model_config))
        core, address, socket_dir = start.finish(stop_ids)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"pagoda serve: error: {exc}") from None
    # Each API server listens on a socket of its own bound to one port
    # (SO_REUSEPORT): the kernel spreads new connections over them. This one
    # only holds the port (it never listens) until they have bound it.
    reserved = reuse_port_socket(args.host, args.port)
    port = reserved.getsockname()[1]
    context = multiprocessing.get_context("spawn")
    servers = [context.Process(target=_api_server_process, args=(args, engine_args, (address, core.pid, i), port),
                               name=f"pagoda-api-server-{i}") for i in range(args.api_server_count)]
    stopping = False

    def stop(*_) -> None:
        nonlocal stopping
        stopping = True
        for server in servers:
            if server.is_alive():
                os.kill(server.pid, signal.SIGTERM)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    for server in servers:
        server.start()
    logger.info("%d API server processes on http://%s:%d in front of engine core process %d", len(servers),
                args.host, port, core.pid)
    while any(server.is_alive() for server in servers):
        # A dead core's sentinel stays ready: waiting on it then would spin through the drain.
        sentinels = [s.sentinel for s in servers if s.is_alive()] + ([core.sentinel] if core.is_alive() else [])
        multiprocessing.connection.wait(sentinels, timeout=1.0)
        failed = not core.is_alive() or any(s.exitcode not in (None, 0) for s in servers)
        if failed and not stopping:
            logger.error("an API server or the engine core stopped: shutting the others down, to exit with status 1")
            stop()
    reserved.close()
    stop_engine_core(core, address, socket_dir)
    return 0 if all(s.exitcode == 0 for s in servers) and core.exitcode == 0 else 1


def reuse_port_socket(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def _api_server_process(args: argparse.Namespace, engine_args, core: tuple[str, int, int], port: int) -> None:
    tag_process_logs()
    sock = reuse_port_socket(args.host, port)
    sock.listen(2048)
    raise SystemExit(serve(args, engine_args, core, sock))


if __name__ == "__main__":
    main(sys.argv[1:])
