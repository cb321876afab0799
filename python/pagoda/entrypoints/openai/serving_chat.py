"""POST /v1/chat/completions: messages through the chat template (the
tokenizer's, or --chat-template), then one engine request with n choices."""

from __future__ import annotations

from typing import AsyncIterator

from starlette.responses import JSONResponse, Response

from pagoda.engine.async_llm import RequestOutputKind
from pagoda.entrypoints.openai.errors import APIError
from pagoda.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from pagoda.entrypoints.openai.serving_engine import (EventStream, ServerState, admit, check_model, check_token_ids,
                                                      engine_error, fit_max_tokens, merge, new_id, now,
                                                      request_timings, sampling_params, sse, stream_choices,
                                                      submit_all, usage)
from pagoda.outputs import CompletionOutput


async def apply_chat_template(state: ServerState, messages: list[ChatMessage], add_generation_prompt: bool = True,
                              add_special_tokens: bool = False) -> list[int]:
    """The messages' token ids through the chat template (the tokenizer's or
    --chat-template), on a tokenizer thread. Rendered to text, then encoded:
    templates write their own BOS, so special tokens are only added when
    asked (/tokenize)."""
    inputs = [m.as_template_input() for m in messages]
    return await state.tokenizers.run(_render_and_encode, state, inputs, add_generation_prompt, add_special_tokens)


def _render_and_encode(state: ServerState, messages: list[dict], add_generation_prompt: bool,
                       add_special_tokens: bool) -> list[int]:
    tokenizer = state.tokenizers.tokenizer
    try:
        text = tokenizer.apply_chat_template(messages, chat_template=state.chat_template,
                                             add_generation_prompt=add_generation_prompt, tokenize=False)
    except Exception as exc:  # noqa: BLE001 -- no template, or the template rejected these messages
        raise APIError(f"could not apply the chat template: {exc}", param="messages") from None
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


async def create_chat_completion(state: ServerState, request: ChatCompletionRequest) -> Response:
    model = check_model(state, request.model)
    prompt_ids = check_token_ids(state, await apply_chat_template(state, request.messages))
    param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
    max_tokens = fit_max_tokens(state, len(prompt_ids), request.requested_max_tokens, param)
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    params = await sampling_params(state, request, max_tokens=max_tokens, logprobs=logprobs)
    prompts = [{"prompt_token_ids": prompt_ids}]
    admit(state, request.priority)
    request_id, created = new_id("chatcmpl"), now()
    kind = RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
    streams = submit_all(state.engine, prompts, params, request_id, request.priority, kind)
    if request.stream:
        return EventStream(_stream(state, request, request_id, created, model, prompts, streams, params),
                           state.stream_send_timeout)
    final = None
    try:
        async for _, out in merge(streams):
            final = out
    except Exception as exc:  # noqa: BLE001 -- reported as an OpenAI error
        raise engine_error(exc) from exc
    tokenizer = state.engine.get_tokenizer()
    choices = [dict(index=c.index, message=dict(role="assistant", content=c.text),
                    logprobs=_logprobs(c, tokenizer, logprobs) if logprobs is not None else None,
                    finish_reason=c.finish_reason, stop_reason=c.stop_reason) for c in final.outputs]
    completion_tokens = sum(len(c.token_ids) for c in final.outputs)
    body = dict(id=request_id, object="chat.completion", created=created, model=model, choices=choices,
                usage=usage(len(prompt_ids), completion_tokens))
    if request.return_timings:
        body["timings"] = request_timings([final])
    return JSONResponse(body)


async def _stream(state, request, request_id, created, model, prompts, streams, params) -> AsyncIterator[bytes]:
    tokenizer = state.engine.get_tokenizer()
    chunk = dict(id=request_id, object="chat.completion.chunk", created=created, model=model)
    # OpenAI opens every choice with a delta that only carries the role.
    for index in range(params.n):
        yield sse(dict(chunk, choices=[dict(index=index, delta=dict(role="assistant", content=""), logprobs=None,
                                            finish_reason=None)]))

    def choice(_, index: int, c: CompletionOutput) -> dict:
        return dict(index=index, delta=dict(content=c.text) if c.text or c.finish_reason is None else {},
                    logprobs=_logprobs(c, tokenizer, params.logprobs) if params.logprobs is not None else None,
                    finish_reason=c.finish_reason)

    async for event in stream_choices(state, request, chunk, prompts, streams, params, choice):
        yield event


def _logprobs(c: CompletionOutput, tokenizer, top_n: int) -> dict:
    """OpenAI's chat logprobs: per token its text, logprob, bytes and the top_n alternatives."""
    def entry(token_id, lp) -> dict:
        text = lp.decoded_token if lp.decoded_token is not None else tokenizer.decode([token_id])
        return dict(token=text, logprob=max(lp.logprob, -9999.0), bytes=list(text.encode("utf-8")))

    content = []
    for token_id, position in zip(c.token_ids, c.logprobs or []):
        chosen = position.get(token_id)
        item = entry(token_id, chosen) if chosen else dict(token=tokenizer.decode([token_id]), logprob=None, bytes=None)
        ranked = sorted(position.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)
        # The chosen token is in the dict too; the top list is rank 1..top_n.
        item["top_logprobs"] = [entry(t, lp) for t, lp in ranked if lp.rank is not None and lp.rank <= top_n][:top_n]
        content.append(item)
    return dict(content=content, refusal=None)
