"""What crosses between the front end (tokenization, detokenization, the API)
and the engine core (scheduler, model, sampler): requests in, one message of
outputs per step back, in token ids only -- never text. The same objects
serve the in-process engine and the engine-core process, where they travel
as msgpack (msgspec: typed decoding, no pickle).

A core request is one sequence: the front end fans a request with n > 1 out
into n of them (child ids, seeds counted on) and gathers their outputs."""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from pagoda.outputs import TokenLogprobs
from pagoda.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams  # n is 1; the seed is this sequence's own
    arrival_time: float  # time.time() when the front end received it
    priority: int = 0
    want_prompt_logprobs: bool = False  # only the first of n sequences scores the prompt
    client_index: int = 0  # which front end (API server process) the outputs go to


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one sequence gained in one step: its new token ids (none when it
    only ended), their logprobs, and how it ended. The core decides
    token-level stops (EOS, stop token ids, max_tokens, max_model_len,
    deadlines, errors); stop strings are the front end's (it sees text)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "timeout", "error"; None while running
    stop_reason: int | None = None  # the stop token id that ended it (not EOS)
    new_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None  # once, complete, for prompt tokens 1..
    scheduled_time: float | None = None  # once: time.time() of its first scheduling
    num_cached_tokens: int | None = None  # once: prompt tokens found in the prefix cache
    error: str | None = None  # finish_reason "error": why

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, array_like=True, gc=False):
    """The core's state after a step, for gauges and admission."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of blocks in use
    num_blocks: int = 0
    num_used_blocks: int = 0  # held by requests (prefix-cached blocks nobody holds are free)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    prefix_caching: bool = False  # whether the prefix counters mean anything


class EngineCoreOutputs(msgspec.Struct, array_like=True, gc=False):
    """One step's outputs for one front end, with the core's stats after it."""

    outputs: list[EngineCoreOutput]
    stats: SchedulerStats


class EngineCoreReady(msgspec.Struct, array_like=True):
    """The core's first message: what start-up decided that the front end
    needs (max_model_len may have been fitted to the KV cache)."""

    max_model_len: int
    num_blocks: int
    block_size: int
    async_scheduling: bool
    dtype: str  # e.g. "bfloat16"
    device: str  # e.g. "cuda:0"


class UtilityCall(msgspec.Struct, array_like=True):
    """A front end calls one of core.UTILITY_METHODS; the core runs it between steps."""

    client_index: int  # whose output socket gets the UtilityResult
    call_id: int  # unique per client, echoed in the result
    method: str
    args: list = []


class UtilityResult(msgspec.Struct, array_like=True, omit_defaults=True):
    call_id: int
    result: Any = None
    error_type: str | None = None  # the call raised: the exception's type name and message
    error: str | None = None


class RequestType(bytes, enum.Enum):
    """The first frame of every message on the core's channel."""

    ADD = b"\x00"  # EngineCoreRequest
    ABORT = b"\x01"  # list of request ids
    SHUTDOWN = b"\x02"
    HELLO = b"\x03"  # a front end announces itself, [client index, its output address]; answered with READY
    READY = b"\x04"  # EngineCoreReady
    OUTPUTS = b"\x05"  # EngineCoreOutputs
    DEAD = b"\x06"  # the core died: the reason, as text
    UTILITY = b"\x07"  # UtilityCall
    UTILITY_RESULT = b"\x08"  # UtilityResult, to the caller's output socket


ENCODER = msgspec.msgpack.Encoder()
DECODERS = {
    RequestType.ADD: msgspec.msgpack.Decoder(EngineCoreRequest),
    RequestType.ABORT: msgspec.msgpack.Decoder(list[str]),
    RequestType.HELLO: msgspec.msgpack.Decoder(tuple[int, str]),
    RequestType.READY: msgspec.msgpack.Decoder(EngineCoreReady),
    RequestType.OUTPUTS: msgspec.msgpack.Decoder(EngineCoreOutputs),
    RequestType.DEAD: msgspec.msgpack.Decoder(str),
    RequestType.UTILITY: msgspec.msgpack.Decoder(UtilityCall),
    RequestType.UTILITY_RESULT: msgspec.msgpack.Decoder(UtilityResult),
}
