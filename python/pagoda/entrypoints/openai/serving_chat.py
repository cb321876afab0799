"""POST /v1/chat/completions: messages (and tools) through the chat template
(the tokenizer's, or --chat-template), then one engine request with n
choices; the text of each is split into reasoning_content (--reasoning-parser),
content and tool_calls (--tool-call-parser for tool_choice "auto"; a forced
call's output follows its schema through structured outputs)."""

from __future__ import annotations

from typing import AsyncIterator

from starlette.responses import JSONResponse, Response

from pagoda.engine.async_llm import RequestOutputKind
from pagoda.entrypoints.openai.errors import APIError
from pagoda.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from pagoda.entrypoints.openai.tool_parsers import ToolCall, forced_calls
from pagoda.entrypoints.openai.serving_engine import (EventStream, ServerState, admit, check_model, check_token_ids,
                                                      engine_error, fit_max_tokens, merge, new_id, now,
                                                      request_timings, sampling_params, sse, stream_choices,
                                                      submit_all, usage)
from pagoda.outputs import CompletionOutput


async def apply_chat_template(state: ServerState, messages: list[ChatMessage], add_generation_prompt: bool = True,
                              add_special_tokens: bool = False, tools: list[dict] | None = None) -> list[int]:
    """The messages' token ids through the chat template (the tokenizer's or
    --chat-template), on a tokenizer thread. Rendered to text, then encoded:
    templates write their own BOS, so special tokens are only added when
    asked (/tokenize)."""
    inputs = [m.as_template_input() for m in messages]
    return await state.tokenizers.run(_render_and_encode, state, inputs, add_generation_prompt, add_special_tokens,
                                      tools)


def _render_and_encode(state: ServerState, messages: list[dict], add_generation_prompt: bool,
                       add_special_tokens: bool, tools: list[dict] | None) -> list[int]:
    tokenizer = state.tokenizers.tokenizer
    try:
        text = tokenizer.apply_chat_template(messages, chat_template=state.chat_template, tools=tools,
                                             add_generation_prompt=add_generation_prompt, tokenize=False)
    except Exception as exc:  # noqa: BLE001 -- no template, or the template rejected these messages
        raise APIError(f"could not apply the chat template: {exc}", param="messages") from None
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


async def create_chat_completion(state: ServerState, request: ChatCompletionRequest) -> Response:
    model = check_model(state, request.model)
    if request.effective_tool_choice == "auto" and (state.tool_parser is None or not state.enable_auto_tool_choice):
        raise APIError('tool_choice "auto" (the default with tools) needs the server started with '
                       "--enable-auto-tool-choice and --tool-call-parser (hermes or llama3_json); "
                       '"required", a named function and "none" work without them', param="tool_choice")
    prompt_ids = check_token_ids(state, await apply_chat_template(state, request.messages,
                                                                  tools=request.template_tools))
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
    choices = []
    for c in final.outputs:
        message, finish_reason = _message(state, request, c)
        choices.append(dict(index=c.index, message=message,
                            logprobs=_logprobs(c, tokenizer, logprobs) if logprobs is not None else None,
                            finish_reason=finish_reason, stop_reason=c.stop_reason))
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

    tool_choice = request.effective_tool_choice
    # Only tools or a reasoning parser need the text so far; plain streams send each delta as it is.
    plain = tool_choice == "none" and state.reasoning_parser is None
    deltas: dict[int, _ChoiceDeltas] = {}

    def choice(_, index: int, c: CompletionOutput) -> dict:
        finish_reason = c.finish_reason
        if plain:
            delta = dict(content=c.text) if c.text or finish_reason is None else {}
        else:
            sent = deltas.get(index)
            if sent is None:
                sent = deltas[index] = _ChoiceDeltas(state, tool_choice, request.parallel_tool_calls)
            delta = sent.delta(c.text, finish_reason is not None)
            if sent.called and finish_reason == "stop" and not isinstance(tool_choice, dict):
                finish_reason = "tool_calls"
        return dict(index=index, delta=delta,
                    logprobs=_logprobs(c, tokenizer, params.logprobs) if params.logprobs is not None else None,
                    finish_reason=finish_reason)

    async for event in stream_choices(state, request, chunk, prompts, streams, params, choice):
        yield event


def _split(state: ServerState, tool_choice: str | dict, parallel_tool_calls: bool | None, text: str,
           final: bool) -> tuple[str | None, str | None, list[ToolCall], int]:
    """(reasoning_content, content, tool calls, how much of content is surely
    content) of a choice's text so far, for a request's effective tool
    choice. Tool calls are found at the end (final), except a named call's,
    known from the start (its content is the arguments)."""
    reasoning, content = (None, text) if state.reasoning_parser is None else state.reasoning_parser.split(text, final)
    content = content or ""
    if isinstance(tool_choice, dict):
        return reasoning, None, forced_calls(content, tool_choice), 0
    if tool_choice == "none":
        return reasoning, content, [], len(content)
    parser = state.tool_parser if tool_choice == "auto" else None
    if not final:
        return reasoning, content, [], 0 if parser is None else parser.content_end(content)
    try:
        calls = forced_calls(content, tool_choice) if parser is None else parser.extract(content)[1]
    except (ValueError, KeyError, TypeError):  # a forced output cut short (max_tokens): not a call
        calls = []
    calls = calls if parallel_tool_calls is not False else calls[:1]
    if not calls:
        return reasoning, content, [], len(content)
    before = 0 if parser is None else parser.content_end(content)
    return reasoning, content[:before], calls, before


def _message(state: ServerState, request: ChatCompletionRequest, c: CompletionOutput) -> tuple[dict, str | None]:
    """A choice's message and finish_reason ("tool_calls" when it called one)."""
    tool_choice = request.effective_tool_choice
    reasoning, content, calls, _ = _split(state, tool_choice, request.parallel_tool_calls, c.text, final=True)
    finish_reason = c.finish_reason
    if calls:
        content = (content or "").strip() or None  # the text before the calls, if any
        if finish_reason == "stop" and not isinstance(tool_choice, dict):
            finish_reason = "tool_calls"
    message = dict(role="assistant", content=content)
    if state.reasoning_parser is not None:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [call.as_openai() for call in calls]
    return message, finish_reason


class _ChoiceDeltas:
    """What a stream has sent of one choice: its reasoning and content grow
    with the text (a tail that may open a tool call is held back); tool
    calls go out once known, a named call's arguments as they are made."""

    def __init__(self, state: ServerState, tool_choice: str | dict, parallel_tool_calls: bool | None):
        self.state, self.tool_choice, self.parallel_tool_calls = state, tool_choice, parallel_tool_calls
        self.text, self.sent_reasoning, self.sent_content, self.sent_arguments = "", 0, 0, 0
        self.called = False

    def delta(self, new_text: str, final: bool) -> dict:
        self.text += new_text
        reasoning, content, calls, visible = _split(self.state, self.tool_choice, self.parallel_tool_calls, self.text,
                                                    final)
        delta = {}
        if reasoning is not None and len(reasoning) > self.sent_reasoning:
            delta["reasoning_content"], self.sent_reasoning = reasoning[self.sent_reasoning:], len(reasoning)
        if content is not None and visible > self.sent_content:
            delta["content"], self.sent_content = content[self.sent_content:visible], visible
        if isinstance(self.tool_choice, dict):
            call, sent = calls[0], self.sent_arguments
            new_arguments = call.arguments[sent:]
            if not self.called:  # the first delta names the call
                opened = call.as_openai(0)
                opened["function"]["arguments"] = new_arguments
                delta["tool_calls"] = [opened]
            elif new_arguments:
                delta["tool_calls"] = [dict(index=0, function=dict(arguments=new_arguments))]
            self.sent_arguments, self.called = len(call.arguments), True
        elif calls:
            delta["tool_calls"] = [call.as_openai(i) for i, call in enumerate(calls)]
            self.called = True
        return delta


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
