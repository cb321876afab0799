"""POST /tokenize and /detokenize with vLLM's shapes: a prompt (or chat
messages through the template, as /v1/chat/completions builds its prompt) to
token ids, and token ids back to text."""

from __future__ import annotations

from starlette.responses import JSONResponse, Response

from pagoda.entrypoints.openai.errors import APIError
from pagoda.entrypoints.openai.protocol import (DetokenizeRequest, DetokenizeResponse, TokenizeChatRequest,
                                                TokenizeCompletionRequest, TokenizeResponse)
from pagoda.entrypoints.openai.serving_chat import apply_chat_template
from pagoda.entrypoints.openai.serving_engine import ServerState, check_model, check_vocab


def tokenize_schema(data: dict) -> type[TokenizeCompletionRequest] | type[TokenizeChatRequest]:
    """Which of vLLM's two request shapes a body is: `messages` means chat."""
    if "messages" in data and "prompt" in data:
        raise APIError("pass either prompt or messages, not both", param="messages")
    return TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest


async def create_tokenize(state: ServerState, request: TokenizeCompletionRequest | TokenizeChatRequest) -> Response:
    check_model(state, request.model)
    tokenizer = state.engine.get_tokenizer()
    if isinstance(request, TokenizeChatRequest):
        tokens = await apply_chat_template(state, request.messages, request.add_generation_prompt,
                                           request.add_special_tokens)
    else:
        tokens = await state.tokenizers.encode(request.prompt, add_special_tokens=request.add_special_tokens)
    token_strs = tokenizer.convert_ids_to_tokens(tokens) if request.return_token_strs else None
    response = TokenizeResponse(count=len(tokens), max_model_len=state.max_model_len, tokens=tokens,
                                token_strs=token_strs)
    return JSONResponse(response.model_dump(exclude_none=True))


async def create_detokenize(state: ServerState, request: DetokenizeRequest) -> Response:
    check_model(state, request.model)
    tokens = check_vocab(state, request.tokens, "tokens")
    return JSONResponse(DetokenizeResponse(prompt=state.engine.get_tokenizer().decode(tokens)).model_dump())
