"""POST /v1/completions: one engine request per prompt, n choices each
(choice index = prompt index * n + output index, as OpenAI numbers them)."""

from __future__ import annotations

from typing import AsyncIterator

from starlette.responses import JSONResponse, Response

from pagoda.engine.async_llm import RequestOutputKind
from pagoda.entrypoints.openai.protocol import CompletionRequest
from pagoda.entrypoints.openai.serving_engine import (EventStream, ServerState, admit, check_model, check_token_ids,
                                                      engine_error, fit_max_tokens, merge, new_id, now,
                                                      request_timings, sampling_params, stream_choices, submit_all,
                                                      usage)
from pagoda.outputs import CompletionOutput


async def create_completion(state: ServerState, request: CompletionRequest) -> Response:
    model = check_model(state, request.model)
    tokenizer = state.engine.get_tokenizer()
    # Tokenized here (not in the engine) so the context check can count them.
    prompts = []
    for p in request.prompts():
        ids = await state.tokenizers.encode(p) if isinstance(p, str) else list(p)
        prompts.append({"prompt": p if isinstance(p, str) else None, "prompt_token_ids": check_token_ids(state, ids)})
    max_tokens = [fit_max_tokens(state, len(p["prompt_token_ids"]), request.max_tokens, "max_tokens") for p in prompts]
    # One SamplingParams serves all prompts: max_tokens fits the longest.
    params = await sampling_params(state, request, max_tokens=min(max_tokens), logprobs=request.logprobs)
    echo = [(p["prompt"] if p["prompt"] is not None else tokenizer.decode(p["prompt_token_ids"])) if request.echo
            else "" for p in prompts]
    admit(state, request.priority)
    request_id, created = new_id("cmpl"), now()
    kind = RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
    streams = submit_all(state.engine, prompts, params, request_id, request.priority, kind)
    if request.stream:
        return EventStream(_stream(state, request, request_id, created, model, prompts, streams, params, echo),
                           state.stream_send_timeout)

    finals = {}
    try:
        async for i, out in merge(streams):
            finals[i] = out
    except Exception as exc:  # noqa: BLE001 -- reported as an OpenAI error
        raise engine_error(exc) from exc
    choices, completion_tokens = [], 0
    for i in range(len(prompts)):
        for c in finals[i].outputs:
            completion_tokens += len(c.token_ids)
            choices.append(dict(index=i * params.n + c.index, text=echo[i] + c.text,
                                logprobs=_logprobs(c, tokenizer) if params.logprobs is not None else None,
                                finish_reason=c.finish_reason, stop_reason=c.stop_reason))
    prompt_tokens = sum(len(finals[i].prompt_token_ids) for i in range(len(prompts)))
    body = dict(id=request_id, object="text_completion", created=created, model=model, choices=choices,
                usage=usage(prompt_tokens, completion_tokens))
    if request.return_timings:
        body["timings"] = request_timings(list(finals.values()))
    return JSONResponse(body)


async def _stream(state, request, request_id, created, model, prompts, streams, params,
                  echo) -> AsyncIterator[bytes]:
    tokenizer = state.engine.get_tokenizer()
    chunk = dict(id=request_id, object="text_completion", created=created, model=model)
    started = set()  # choices whose echoed prompt went out

    def choice(i: int, index: int, c: CompletionOutput) -> dict:
        text = c.text if index in started else echo[i] + c.text
        started.add(index)
        return dict(index=index, text=text, finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                    logprobs=_logprobs(c, tokenizer) if params.logprobs is not None else None)

    async for event in stream_choices(state, request, chunk, prompts, streams, params, choice):
        yield event


def _logprobs(c: CompletionOutput, tokenizer) -> dict:
    """OpenAI's legacy completion logprobs for the tokens in `c`."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    offset = 0
    for token_id, entry in zip(c.token_ids, c.logprobs or []):
        chosen = entry.get(token_id)
        text = _decoded(chosen, token_id, tokenizer)
        tokens.append(text)
        token_logprobs.append(max(chosen.logprob, -9999.0) if chosen else None)
        top.append({_decoded(lp, t, tokenizer): max(lp.logprob, -9999.0) for t, lp in entry.items()})
        offsets.append(offset)
        offset += len(text)
    return dict(tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top, text_offset=offsets)


def _decoded(lp, token_id: int, tokenizer) -> str:
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return tokenizer.decode([token_id])
