"""Continuous batching as one token-budget loop (vLLM v1's shape): every step
each request is given the tokens it still lacks KV for -- a prompt chunk, a
recomputation after preemption, or the one token sampled last step -- up to
max_num_batched_tokens in total and max_num_seqs running. Chunked prefill,
decode and prefix-cache hits (a waiting request starts with num_computed_tokens
at the end of its cached prefix) are the same arithmetic over
num_computed_tokens. The waiting queue is ordered by the scheduling policy
(fcfs or priority), and so is the choice of whom to preempt.

The scheduler never touches tensors: its output is a plain dataclass the
worker turns into inputs, and update_from_output takes plain token ids back.
The output is incremental, as the worker keeps each request's state: a
request's prompt and sampling parameters go once (new_requests), its block
ids as they are allocated (the whole table again only after a preemption
dropped it), and the ids of requests that ended since the last step
(finished_ids), so the worker forgets them.

A step's computed tokens count at scheduling time, and its samples as pending
tokens until update_from_output brings their ids, so the next step can be
scheduled before the ids reach the host (async scheduling): a request whose
last token is still pending gets that token as a placeholder
(ScheduledRequest.last_token_pending), which the model runner fills on the
device from the previous step's samples.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.request import Request, RequestStatus
from pagoda.core.request_queue import create_request_queue
from pagoda.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """What the worker keeps of a request, sent with its first step."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    want_prompt_logprobs: bool  # compute them (sampling_params.prompt_logprobs of them)


@dataclass
class ScheduledRequest:
    request_id: str
    token_ids: list[int]  # the tokens whose KV this step computes
    start_position: int  # position of token_ids[0]
    new_block_ids: list[int]  # blocks allocated since the request's last step ...
    sample: bool  # this step completes the request's known tokens: sample the next one
    num_prompt_tokens: int
    # token_ids[-1] is a placeholder for the token this request sampled in
    # the previous step, not read by the host yet (async scheduling).
    last_token_pending: bool = False
    reset_blocks: bool = False  # ... or its whole block table (first step, or after a preemption)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    new_requests: list[NewRequestData] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)  # ended since the previous step
    preempted_ids: list[str] = field(default_factory=list)
    # Requests ended (FINISHED_LENGTH) because the whole KV cache cannot hold
    # their next token: they would only be preempted and readmitted forever.
    capped: list[Request] = field(default_factory=list)
    # Structured outputs (set by the engine core after schedule()): the tokens
    # these sampling requests may pick, one row each of an int32 numpy array
    # [len(grammar_request_ids), ceil(vocab / 32)] (bit j of a row: token j).
    grammar_request_ids: list[str] = field(default_factory=list)
    grammar_bitmask: Any = None

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


_UNSENT = object()  # _sent_blocks' default: the worker has not seen the request yet


class Scheduler:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        policy: str = "fcfs",
    ):
        self.kv = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self.waiting = create_request_queue(policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        # What the worker was told: blocks sent per request (None: its table
        # starts over next step), requests ended since the last step.
        self._sent_blocks: dict[str, int | None] = {}
        self.finished_ids_to_send: list[str] = []  # the next output's finished_ids

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput(finished_ids=self.finished_ids_to_send)
        self.finished_ids_to_send = []
        budget = self.max_num_batched_tokens

        if self.policy == "priority":
            # Most important first, so the preemption victim below -- always
            # the last running request -- is the least important (latest
            # arrival among equals), and it is never one already scheduled.
            self.running.sort(key=lambda r: (r.priority, r.arrival_time))

        # Running requests first; on a full pool the last running request is
        # preempted (recomputed later) to make room.
        index, extending = 0, False
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(self._num_uncomputed(request), budget)
            if num_new == 0:
                index += 1  # its pending tokens end it (length): it waits for their ids
                continue
            while self.kv.allocate_slots(request, request.num_computed_tokens + num_new) is None:
                victim = self.running[-1]
                if victim is request and len(self.running) == 1:
                    self._cap(output, request)
                    num_new = 0
                    break
                self._preempt(victim)
                output.preempted_ids.append(victim.request_id)
                if victim is request:
                    num_new = 0
                    break
            if num_new == 0:
                continue  # request itself was preempted or capped: it left self.running
            self._add_to_step(output, request, num_new)
            extending |= num_new > 1
            budget -= num_new
            index += 1
        if extending:
            # Decodes first (stable): the GPU's attention takes the leading
            # one-token sequences to its decode kernel and the rest to its
            # prefill kernel, splitting the batch at the first longer one.
            output.scheduled.sort(key=lambda item: len(item.token_ids) > 1)

        # Then waiting requests, in policy order, while there is room and no
        # one was just preempted (they would take the blocks straight back).
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not output.preempted_ids:
            request = self.waiting.peek()
            # A waiting request has no KV (preemption drops it); its cached
            # prefix, if any, counts as computed.
            computed_blocks = self.kv.get_computed_blocks(request)
            num_computed = len(computed_blocks or ()) * self.kv.block_size
            num_new = min(request.num_tokens + request.num_pending_tokens - num_computed, budget)
            if self.kv.allocate_slots(request, num_computed + num_new, computed_blocks) is None:
                if not self.running:  # the whole cache is free (or evictable) and still too small
                    self._cap(output, request)
                    continue
                break
            self.waiting.pop()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_computed
            self.running.append(request)
            self._add_to_step(output, request, num_new)
            budget -= num_new
        return output

    def _add_to_step(self, output: SchedulerOutput, request: Request, num_new: int) -> None:
        """Schedules num_new tokens of a request whose slots are allocated (a
        request already in the step is never preempted later in it, so its
        block table is final)."""
        start, end, known = request.num_computed_tokens, request.num_computed_tokens + num_new, request.num_tokens
        token_ids = request.token_ids_slice(start, min(end, known))
        if end > known:  # at most one: the previous step's sample
            token_ids.append(0)
        sample = end == known + request.num_pending_tokens
        request_id = request.request_id
        sent = self._sent_blocks.get(request_id, _UNSENT)
        if sent is _UNSENT:
            output.new_requests.append(NewRequestData(request_id, request.prompt_token_ids, request.sampling_params,
                                                      request.want_prompt_logprobs))
            sent = None
        new_block_ids = self.kv.block_ids(request_id, start=sent or 0)
        self._sent_blocks[request_id] = (sent or 0) + len(new_block_ids)
        output.scheduled.append(
            ScheduledRequest(request_id, token_ids, start, new_block_ids, sample, len(request.prompt_token_ids),
                             end > known, sent is None)
        )
        request.num_computed_tokens = end
        request.num_pending_tokens += sample

    @staticmethod
    def _num_uncomputed(request: Request) -> int:
        """Tokens a running request still needs KV for: none once its pending
        tokens reach max_num_tokens (the host ends it when their ids arrive)."""
        total = request.num_tokens + request.num_pending_tokens
        if request.num_pending_tokens and request.max_num_tokens is not None and total >= request.max_num_tokens:
            return 0
        return total - request.num_computed_tokens

    def _cap(self, output: SchedulerOutput, request: Request) -> None:
        self.finish(request, RequestStatus.FINISHED_LENGTH)
        output.capped.append(request)

    def _preempt(self, request: Request) -> None:
        """Recompute preemption: drop the KV (cached blocks stay in the prefix
        cache, so the recomputation may hit them), requeue at the front (fcfs)
        or by priority."""
        self.running.remove(request)
        self.kv.free(request.request_id)
        self._sent_blocks[request.request_id] = None
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.prepend(request)

    def update_from_output(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Resolves the step's pending tokens; `sampled` maps request id -> new
        token for the requests that sampled and are still unfinished (one that
        ended since is left out). Returns the requests that got a token."""
        advanced = []
        for item in output.scheduled:
            token = sampled.get(item.request_id) if item.sample else None
            if token is None:
                continue
            request = self.requests[item.request_id]
            request.num_pending_tokens -= 1
            request.output_token_ids.append(token)
            advanced.append(request)
        return advanced

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Ends a request (stop, length, abort, timeout) and frees its blocks."""
        if request.is_finished:
            return
        request.status = status
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.kv.free(request.request_id)
        del self.requests[request.request_id]
        if self._sent_blocks.pop(request.request_id, False) is not False:  # the worker holds its state
            self.finished_ids_to_send.append(request.request_id)
