"""What the completion and chat handlers share: the served model, prompt
checks, SamplingParams from a request, admission (priority, queue bound),
running several engine requests as one, cancelling on client disconnect,
timings, and the streamed chunks (server-sent events) with their send bound."""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from pagoda.engine.async_llm import AsyncLLM, EngineDeadError, RequestFailedError, RequestOutputKind, RequestStream
from pagoda.engine import structured_output
from pagoda.engine.processor import ids_outside_vocab
from pagoda.entrypoints.openai.errors import APIError
from pagoda.entrypoints.openai.tokenizer_pool import TokenizerPool
from pagoda.logger import init_logger
from pagoda.outputs import CompletionOutput, RequestOutput
from pagoda.prometheus import PrometheusStatLogger
from pagoda.sampling_params import DEFAULTS, SamplingParams, StructuredOutputsParams

logger = init_logger("pagoda.server")
RETRY_AFTER_S = 1  # what a 503 for a full queue tells clients to wait


@dataclass
class ServerState:
    engine: AsyncLLM
    served_model_names: list[str]
    tokenizers: TokenizerPool  # prompts' tokenization, off the event loop
    api_key: str | None = None
    chat_template: str | None = None
    metrics: PrometheusStatLogger | None = None
    max_queued_requests: int | None = None
    stream_send_timeout: float | None = None
    tool_parser: Any = None  # for tool_choice "auto" (tool_parsers.TOOL_PARSERS), with enable_auto_tool_choice
    enable_auto_tool_choice: bool = False
    reasoning_parser: Any = None  # splits reasoning_content out (reasoning_parsers.REASONING_PARSERS)

    @property
    def max_model_len(self) -> int:
        return self.engine.model_config.max_model_len

    @property
    def num_queued_requests(self) -> int:
        """Engine sequences accepted but not running yet (a snapshot, which
        is all admission needs)."""
        return self.engine.num_waiting_requests


def check_model(state: ServerState, model: str | None) -> str:
    """The name to answer with; 404 for a model this server does not serve."""
    if model is None or model in state.served_model_names:
        return state.served_model_names[0] if model is None else model
    raise APIError(f"The model `{model}` does not exist.", status=404, param="model", code="model_not_found")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def check_vocab(state: ServerState, token_ids: list[int], param: str) -> list[int]:
    vocab = state.engine.vocab_size
    bad = ids_outside_vocab(token_ids, vocab)
    if bad:
        raise APIError(f"{param} has token ids outside the vocabulary [0, {vocab}): {bad}", param=param)
    return token_ids


def check_token_ids(state: ServerState, token_ids: list[int]) -> list[int]:
    check_vocab(state, token_ids, "prompt")
    if not token_ids:
        raise APIError("prompt is empty: it needs at least one token", param="prompt")
    return token_ids


def fit_max_tokens(state: ServerState, num_prompt_tokens: int, max_tokens: int | None, param: str) -> int:
    """max_tokens after the context check: prompt + max_tokens must fit in
    max_model_len (OpenAI's context_length_exceeded); unset means all that is left."""
    limit = state.max_model_len
    requested = num_prompt_tokens + (max_tokens if max_tokens is not None else 1)
    if requested > limit or num_prompt_tokens >= limit:
        raise APIError(
            f"This model's maximum context length is {limit} tokens. However, you requested {requested} tokens "
            f"({num_prompt_tokens} in the prompt, {max_tokens if max_tokens is not None else 1} for the completion). "
            f"Please reduce the length of the prompt or the completion.",
            param=param, code="context_length_exceeded")
    return max_tokens if max_tokens is not None else limit - num_prompt_tokens


def admit(state: ServerState, priority: int) -> None:
    """Checks a valid generation request against the server: its priority
    needs the priority scheduling policy, and while --max-queued-requests
    engine requests wait, it is refused with 503 and Retry-After."""
    policy = state.engine.scheduling_policy
    if priority != 0 and policy != "priority":
        raise APIError(f"priority is only used with --scheduling-policy priority (this server schedules {policy})",
                       param="priority")
    limit, queued = state.max_queued_requests, state.num_queued_requests
    if limit is not None and queued >= limit:
        raise APIError(f"the server is busy: {queued} requests are waiting (--max-queued-requests {limit}); "
                       f"retry later", status=503, code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})


async def sampling_params(state: ServerState, request: Any, **kwargs) -> SamplingParams:
    """The request's SamplingParams (its sampling fields, updated by
    kwargs), checked against the model's vocabulary, and its structured
    output's spec against xgrammar (on a tokenizer thread: a large schema
    takes a while): every bad value is a 400 before a stream starts, never
    an error event after its 200."""
    try:
        kwargs = dict(request.sampling_kwargs(), **kwargs)
        if kwargs.get("structured_outputs") is not None:
            kwargs["structured_outputs"] = StructuredOutputsParams(**kwargs["structured_outputs"])
        params = SamplingParams(**kwargs)
        params.verify_vocab(state.engine.vocab_size)
        if params.structured_outputs is not None:
            await state.tokenizers.run(structured_output.check, params.structured_outputs)
        return params
    except ValueError as exc:  # the message starts with the field's name
        message = str(exc)
        field = re.split(r"[ .:]", message, 1)[0]
        raise APIError(message, param=field if field in DEFAULTS else None) from None


def engine_error(exc: BaseException) -> APIError:
    """An engine failure as the error a client should see."""
    if isinstance(exc, EngineDeadError):
        return APIError("the engine is not running; the server must be restarted", status=503)
    if isinstance(exc, RequestFailedError):  # this request alone: the engine serves on
        return APIError(f"the request failed inside the engine: {exc}", status=500, type="server_error")
    if isinstance(exc, ValueError):
        return APIError(str(exc))
    return APIError("internal server error", status=500, type="server_error")


def submit_all(engine: AsyncLLM, prompts: list[Any], params: SamplingParams, request_id: str, priority: int,
               kind: RequestOutputKind) -> list[RequestStream]:
    """One engine request per prompt, sent now: the engine starts on them
    while the response is still being set up (a stream's first send waits
    its turn on the loop). If one fails, those sent are aborted and the
    failure is raised as the client's error."""
    streams = []
    try:
        for i, prompt in enumerate(prompts):
            streams.append(engine.submit(prompt, params, f"{request_id}-{i}", priority=priority, output_kind=kind))
    except Exception as exc:  # noqa: BLE001 -- reported as an OpenAI error
        for stream in streams:
            stream.close()
        raise engine_error(exc) from exc
    return streams


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yields (prompt index, output) from the requests' streams as they
    come. Closing this iterator (or cancelling its consumer, as a client
    disconnect does) closes every stream, which aborts them in the engine
    and frees their KV blocks."""
    if len(streams) == 1:  # the common case: no task and queue between the engine and the stream
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            streams[0].close()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def drain(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
            queue.put_nowait((i, done))
        except Exception as exc:  # noqa: BLE001 -- handed to the consumer
            queue.put_nowait((i, exc))

    tasks = [asyncio.create_task(drain(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            stream.close()


async def with_cancellation(request: Request, handler: Awaitable[Response]) -> Response:
    """Runs a handler until it answers or the client disconnects, whichever
    comes first. A disconnect cancels it, which aborts its engine requests
    and frees their KV blocks (streams notice disconnects themselves); the
    status is then 499, nginx's "client closed request", seen only in logs."""
    task = asyncio.ensure_future(handler)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.done() and not task.cancelled():
        return task.result()
    await asyncio.gather(task, return_exceptions=True)  # let the aborts run
    return Response(status_code=499)


async def _disconnected(request: Request) -> None:
    # The body was read already: the next message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


def request_timings(outputs: list[RequestOutput]) -> dict[str, float]:
    """The timings (return_timings) of an HTTP request: those of its engine
    request that finished last."""
    last = max(outputs, key=lambda o: o.metrics.finished_time or 0.0)
    return last.metrics.timings()


async def stream_choices(state: ServerState, request: Any, chunk: dict, prompts: list[Any],
                         streams: list[RequestStream], params: SamplingParams,
                         choice: Callable[[int, int, CompletionOutput], dict]) -> AsyncIterator[bytes]:
    """The streamed body after any opening chunks: one chunk per choice that
    has something new (choice index = prompt index * n + output index;
    choice(prompt index, choice index, delta) builds it), an error event if
    the engine fails, the closing usage/timings chunk asked for, [DONE]."""
    finished, completion_tokens, finals = set(), 0, []
    try:
        async for i, out in merge(streams):
            if out.finished:
                finals.append(out)
            for c in out.outputs:
                index = i * params.n + c.index
                if index in finished or (not c.token_ids and not c.text and c.finish_reason is None):
                    continue  # nothing new for this choice in this output
                completion_tokens += len(c.token_ids)
                if c.finish_reason is not None:
                    finished.add(index)
                yield sse(dict(chunk, choices=[choice(i, index, c)]))
    except Exception as exc:  # noqa: BLE001 -- headers are sent: the error goes in the stream
        yield stream_error(state, exc)
    else:
        include_usage = request.stream_options is not None and request.stream_options.include_usage
        prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
        last = closing_chunk(chunk, usage(prompt_tokens, completion_tokens) if include_usage else None,
                             request_timings(finals) if request.return_timings else None)
        if last is not None:
            yield last
    yield sse("[DONE]")


def stream_error(state: ServerState, exc: BaseException) -> bytes:
    """An error after the stream's headers went out: the error object as an
    event (and a failed request in /metrics)."""
    error = engine_error(exc)
    if state.metrics is not None:
        state.metrics.record_failure(error.status)
    return sse(error.body())


def closing_chunk(chunk: dict, usage: dict | None, timings: dict | None) -> bytes | None:
    """The stream's last chunk before [DONE]: no choices, with the usage
    and/or timings the request asked for (None when it asked for neither)."""
    if usage is None and timings is None:
        return None
    extra = dict(usage=usage) if usage is not None else {}
    if timings is not None:
        extra["timings"] = timings
    return sse(dict(chunk, choices=[], **extra))


class EventStream(StreamingResponse):
    """Server-sent events for a client that must keep reading: a chunk that
    cannot be sent for `send_timeout` seconds (the client stopped reading
    and the socket buffers are full, so the send waits) ends the stream. Its
    engine requests are aborted, freeing their KV blocks, and the
    connection is closed, so a stalled client holds no more than the
    buffers and the time bound.

    The bound costs a clock read per chunk: one deadline for the whole
    stream, moved by a watchdog that wakes once per send_timeout, rather
    than a timer armed and cancelled around every send."""

    def __init__(self, events: AsyncIterator[bytes], send_timeout: float | None):
        super().__init__(events, media_type="text/event-stream")
        self.send_timeout = send_timeout

    async def stream_response(self, send) -> None:
        if self.send_timeout is None:
            return await super().stream_response(send)
        loop, timeout = asyncio.get_running_loop(), self.send_timeout
        waiting_since: float | None = None  # when the send now in flight began

        async def watched_send(message) -> None:
            nonlocal waiting_since
            waiting_since = loop.time()
            await send(message)
            waiting_since = None

        def watch() -> None:
            nonlocal watchdog
            began = waiting_since
            if began is not None and loop.time() - began >= timeout:
                deadline.reschedule(loop.time())  # cancels the waiting send, as a timeout does
            else:
                watchdog = loop.call_at((began if began is not None else loop.time()) + timeout, watch)

        try:
            async with asyncio.timeout(None) as deadline:
                watchdog = loop.call_later(timeout, watch)
                try:
                    await super().stream_response(watched_send)
                finally:
                    watchdog.cancel()
        except TimeoutError:
            if not deadline.expired():
                raise
            logger.warning("a client read nothing of its stream for %g s: its request is aborted", timeout)
            await self.body_iterator.aclose()  # its cleanup (merge's) aborts the engine requests
            # Returning with the response unfinished makes uvicorn close the connection.


def sse(payload: dict | str) -> bytes:
    """One server-sent event, as OpenAI frames them (msgspec's JSON: UTF-8
    as is, about ten times faster than json.dumps for a chunk)."""
    return b"data: " + (payload.encode() if isinstance(payload, str) else _json(payload)) + b"\n\n"


_json = msgspec.json.Encoder().encode


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
