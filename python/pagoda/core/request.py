"""A request's state as the scheduler sees it: token ids and how many of them
have their KV computed. No tensors here."""

from __future__ import annotations

import enum
import time

from pagoda.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_TIMEOUT = "timeout"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self.name.startswith("FINISHED")


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        max_num_tokens: int | None = None,
        want_prompt_logprobs: bool = False,
    ):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        # Tokens sampled (or being sampled) on the device whose ids the host
        # has not read yet: set by the scheduler, resolved by update_from_output.
        # With async scheduling the next step is scheduled before the ids
        # arrive; the one step ahead feeds such a token from the device.
        self.num_pending_tokens = 0
        # Prompt plus max_tokens, capped by max_model_len: no step is scheduled
        # for a request whose pending tokens already take it there.
        self.max_num_tokens = max_num_tokens
        # sampling_params.prompt_logprobs computed for it (of n samples, one computes them)
        self.want_prompt_logprobs = want_prompt_logprobs and sampling_params.prompt_logprobs is not None
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.block_hashes: list[bytes] = []  # chained hashes of full blocks (KVCacheManager fills it)
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling; -1 until then

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated, the pending ones included."""
        return len(self.output_token_ids) + self.num_pending_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        prompt = len(self.prompt_token_ids)
        if end <= prompt:
            return self.prompt_token_ids[start:end]
        # Decode steps slice the outputs alone: no copy of the whole sequence.
        if start >= prompt:
            return self.output_token_ids[start - prompt : end - prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - prompt]

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.value}, prompt={self.num_prompt_tokens}, "
            f"output={len(self.output_token_ids)}, computed={self.num_computed_tokens})"
        )
