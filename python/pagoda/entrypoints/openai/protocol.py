"""Request and response schemas (pydantic) for the OpenAI endpoints, with
vLLM's extras and its /tokenize and /detokenize; /openapi.json is built from
them.

Unknown fields are refused (extra="forbid") rather than ignored, values of
another JSON type than the schema's are refused rather than coerced (strict:
`"n": "2"` or `"stream": 0` is a 400), and known OpenAI features Pagoda
lacks (best_of, non-text content parts) are refused with a 400 that says so: a client must
never get an answer that silently ignored or reinterpreted part of its
request.

Structured outputs come in three shapes, all mapped onto one
SamplingParams.structured_outputs: OpenAI's chat `response_format`
(json_object, json_schema), vLLM's `structured_outputs` object, and vLLM's
older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

from pagoda.entrypoints.openai.tool_parsers import forced_call_schema


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


# Completions per request at most (OpenAI's limit): each one is a sequence in
# the engine, so an unbounded n would let one request occupy the server.
MAX_N = 128
# Top logprobs per token at most (vLLM's default max_logprobs; OpenAI's chat limit).
MAX_LOGPROBS = 20
# logit_bias values (OpenAI's range).
MAX_LOGIT_BIAS = 100.0
# Prompts in one /v1/completions request at most: each is an engine request
# (of n sequences), so an unbounded list would let one request fill the queue.
MAX_PROMPTS = 128

# Fields shared by both endpoints that map 1:1 onto SamplingParams.
_SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens",
                    "logit_bias", "skip_special_tokens", "include_stop_str_in_output", "timeout_seconds")


class StructuredOutputsRequest(_Strict):
    """vLLM's `structured_outputs` field (SamplingParams.structured_outputs)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")  # BaseModel has a json attribute
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


# vLLM's older fields -> the structured_outputs field each one sets.
_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}


class _SamplingRequest(_Strict):
    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # accepted: only identifies the end user
    # vLLM's extras.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    timeout_seconds: float | None = None  # Pagoda's per-request deadline, from arrival
    priority: int = 0
    # Pagoda's: the response (or the last stream chunk) carries
    # timings {queue_s, prefill_s, decode_s, total_s}.
    return_timings: bool = False
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Known OpenAI/vLLM fields that Pagoda refuses (checked below).
    best_of: int | None = None

    @model_validator(mode="after")
    def _refuse_unsupported(self):
        if isinstance(self.n, int) and self.n > MAX_N:
            raise ValueError(f"n must be at most {MAX_N} (OpenAI's limit), got {self.n}")
        if self.logit_bias and any(not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS for v in self.logit_bias.values()):
            raise ValueError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        if self.best_of is not None and self.best_of > 1:
            raise ValueError("best_of > 1 is not supported by Pagoda yet")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            raise ValueError("stream_options.continuous_usage_stats is not supported by Pagoda yet")
        return self

    def sampling_kwargs(self) -> dict[str, Any]:
        """SamplingParams arguments for the fields the client set: unset ones
        keep the model's generation_config defaults. structured_outputs is a
        dict of StructuredOutputsParams' arguments."""
        kwargs = {name: getattr(self, name) for name in _SAMPLING_FIELDS
                  if name in self.model_fields_set and getattr(self, name) is not None}
        structured = self.structured_outputs_kwargs()
        if structured is not None:
            kwargs["structured_outputs"] = structured
        return kwargs

    def structured_outputs_kwargs(self) -> dict[str, Any] | None:
        """The structured_outputs field with the guided fields merged in."""
        kwargs = {} if self.structured_outputs is None else self.structured_outputs.model_dump(exclude_unset=True,
                                                                                             by_alias=True)
        for guided, name in _GUIDED_FIELDS.items():
            value = getattr(self, guided)
            if value is not None:
                if kwargs.get(name) is not None:
                    raise ValueError(f"{guided} and structured_outputs.{name} are both set: give one")
                kwargs[name] = value
        return kwargs or None


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _non_empty_and_bounded(cls, prompt):
        if isinstance(prompt, list) and not prompt:
            raise ValueError("prompt must not be empty")
        if isinstance(prompt, list) and not isinstance(prompt[0], int) and len(prompt) > MAX_PROMPTS:
            raise ValueError(f"prompt has {len(prompt)} prompts: at most {MAX_PROMPTS} per request")
        return prompt

    @model_validator(mode="after")
    def _refuse_completion_features(self):
        if self.suffix:
            raise ValueError("suffix is not supported by Pagoda yet")
        if self.echo and self.logprobs is not None:
            raise ValueError("echo together with logprobs is not supported by Pagoda yet")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        return self

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [p]
        return list(p)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # a JSON text

    @field_validator("arguments")
    @classmethod
    def _json_text(cls, arguments):
        try:
            json.loads(arguments)
        except json.JSONDecodeError:
            raise ValueError(f"a tool call's arguments must be a JSON text, got {arguments[:80]!r}") from None
        return arguments


class ToolCallMessage(_Strict):
    """An assistant message's earlier tool call, sent back with the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None  # assistant
    tool_call_id: str | None = None  # tool: the call it answers
    reasoning_content: str | None = None  # an assistant's earlier reasoning (not shown to the template)

    @field_validator("role", mode="before")
    @classmethod
    def _refuse_function_role(cls, role):
        if role == "function":
            raise ValueError("messages with role 'function' (OpenAI's deprecated form) are not supported: "
                             "send role 'tool' with tool_call_id")
        return role

    @field_validator("content", mode="before")
    @classmethod
    def _refuse_non_text_parts(cls, content):
        for part in content if isinstance(content, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind is not None and kind != "text":
                raise ValueError(f"content parts of type {kind!r} are not supported by Pagoda yet (text only)")
        return content

    @model_validator(mode="after")
    def _tool_fields_by_role(self):
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a message with role 'tool' needs tool_call_id")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls are only allowed in assistant messages, not {self.role!r}")
        return self

    def as_template_input(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):  # text parts only: joined as OpenAI does
            content = "\n".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.tool_calls:
            # Templates render the arguments as a mapping (`| tojson`).
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": json.loads(c.function.arguments)}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
    strict: bool | None = None  # the arguments always follow the schema when a call is forced


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedToolChoice(_Strict):
    class Function(_Strict):
        name: str

    type: Literal["function"]
    function: Function


class JsonSchemaFormat(_Strict):
    name: str
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    # OpenAI's strict mode: the output follows the schema exactly, as it
    # always does here.
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type 'json_schema' needs json_schema")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"json_schema is only allowed with type 'json_schema', not {self.type!r}")
        return self


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: auto with tools
    parallel_tool_calls: bool | None = None  # None: true, as OpenAI
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _check_chat_features(self):
        names = [tool.function.name for tool in self.tools or ()]
        if self.tool_choice not in (None, "none") and not names:
            raise ValueError("tool_choice needs tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names the function {self.tool_choice.function.name!r}, which is not "
                             f"in tools ({', '.join(names)})")
        if len(set(names)) != len(names):
            raise ValueError("tools: two functions have the same name")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs to be true")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}")
        return self

    @property
    def effective_tool_choice(self) -> str | dict[str, Any]:
        """"none", "auto", "required" or the named choice as a dict (tools
        given and no tool_choice: "auto", as OpenAI)."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if self.tool_choice is None:
            return "auto"
        return self.tool_choice if isinstance(self.tool_choice, str) else self.tool_choice.model_dump()

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools for the chat template (none when tool_choice is "none")."""
        if self.effective_tool_choice == "none":
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    def structured_outputs_kwargs(self) -> dict[str, Any] | None:
        """response_format, or a forced tool call's schema, as
        structured_outputs (with the options given in structured_outputs,
        e.g. disable_any_whitespace); "text" is none."""
        kwargs = super().structured_outputs_kwargs()
        kind = None if self.response_format is None else self.response_format.type
        choice = self.effective_tool_choice
        forced = choice == "required" or isinstance(choice, dict)
        if kind in ("json_object", "json_schema") or forced:
            kwargs = kwargs or {}
            given = [f"structured_outputs.{name}" for name in ("json", "regex", "choice", "grammar", "json_object")
                     if kwargs.get(name)]
            given += ["response_format"] if forced and kind in ("json_object", "json_schema") else []
            if given:
                raise ValueError(f"{'tool_choice' if forced else 'response_format'} and {given[0]} both constrain "
                                 f"the output: give one")
            if forced:
                tools = [tool.model_dump() for tool in self.tools]
                kwargs["json"] = forced_call_schema(tools, choice, self.parallel_tool_calls is not False)
            elif kind == "json_object":
                kwargs["json_object"] = True
            else:
                kwargs["json"] = self.response_format.json_schema.schema_
        return kwargs

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeCompletionRequest(_Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Strict):
    """The messages through the chat template, as /v1/chat/completions would
    see them (add_special_tokens=False: templates write their own)."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[StrictInt]


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error body: {"error": {"message", "type", "param", "code"}}."""

    error: ErrorInfo
