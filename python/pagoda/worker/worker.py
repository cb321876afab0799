"""The worker: everything on the device for one rank -- the model runner, the
sampler and each request's generator -- and the state it keeps of every
request it runs (prompt, sampling parameters, block table, the ids it sampled),
so the scheduler's per-step output to it carries only what changed.

execute_model queues a step on the device and returns at once; the step's
ModelRunnerOutput is read later (StepHandle.result), so with async scheduling
the engine schedules the next step while this one computes.

A request fails alone. If work done per request (sampling inputs, sampling,
prompt logprobs) raises, the requests that make it fail are found by trying
each alone; they are reported in ModelRunnerOutput.failed, sample neutrally
from then on (their tokens are dropped by the engine), and the step goes on
for the others. Only what no single request explains (the forward pass, a
device fault) raises: the engine then dies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, TypeVar

import numpy as np
import torch

from pagoda.config import CacheConfig, ModelConfig, SchedulerConfig
from pagoda.core.scheduler import SchedulerOutput
from pagoda.logger import init_logger
from pagoda.model_executor.layers.sampler import (
    DeviceSamplerOutput,
    Sampler,
    SamplingMetadata,
    compute_token_logprobs,
    make_generator,
    to_device,
)
from pagoda.outputs import ModelRunnerOutput, TokenLogprobs
from pagoda.sampling_params import SamplingParams
from pagoda.worker import create_model_runner
from pagoda.worker.block_table import BlockTable

logger = init_logger(__name__)

# Stands in for a failed request's row: greedy, no extras, so it cannot fail
# again; the engine drops its token.
_NEUTRAL_PARAMS = SamplingParams(temperature=0.0, max_tokens=None)
T = TypeVar("T")


def is_device_fault(exc: BaseException) -> bool:
    """Faults of the device or its memory, not of one request's values: a
    CUDA error leaves the context unusable for every request."""
    return isinstance(exc, (torch.AcceleratorError, torch.OutOfMemoryError)) or "CUDA error" in str(exc)


@dataclass
class CachedRequestState:
    """What the worker keeps of a running request between steps."""

    prompt_token_ids: list[int]
    params: SamplingParams  # _NEUTRAL_PARAMS once its own work failed
    want_prompt_logprobs: bool
    row: int  # its row of the worker's BlockTable
    output_token_ids: list[int]  # sampled so far, as far as the host has read them
    num_sampled: int = 0  # rows sampled so far, those still on the device included
    num_prompt_logprobs: int = 0  # prompt positions scored so far
    generator: torch.Generator | None = None


class StepHandle:
    """A step queued on the device; result() waits for its samples."""

    def __init__(self, worker: Worker, req_ids: list[str], states: dict[str, CachedRequestState],
                 samples: DeviceSamplerOutput | None, prompt_logits: dict[str, tuple[int, torch.Tensor]],
                 failed: dict[str, str]):
        self.worker, self.req_ids, self.samples = worker, req_ids, samples
        self.states = states  # the step's own: an id may be reused once its request ends
        self.prompt_logits, self.failed = prompt_logits, failed

    def result(self) -> ModelRunnerOutput:
        worker = self.worker
        output = ModelRunnerOutput(self.req_ids, [], failed=self.failed)
        if self.samples is not None:
            host = self.samples.to_host()
            output.sampled_token_ids, output.logprobs = host.sampled_token_ids, host.logprobs
            for request_id, token in zip(self.req_ids, host.sampled_token_ids):
                self.states[request_id].output_token_ids.append(token)
        for request_id, (first_position, logits) in self.prompt_logits.items():
            state = self.states[request_id]
            if request_id in output.failed:
                continue
            try:
                worker.inject("prompt logprobs", [request_id])
                entries = worker.prompt_logprobs(state, first_position, logits)
            except Exception as exc:  # noqa: BLE001 -- this request's alone
                if is_device_fault(exc):
                    raise
                output.failed[request_id] = worker.fail(request_id, state, "prompt logprobs", exc)
                continue
            if entries:
                output.prompt_logprobs[request_id] = entries
        return output


class Worker:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, scheduler_config: SchedulerConfig,
                 eos_token_ids: Iterable[int] = ()):
        self.runner = create_model_runner(model_config, cache_config, scheduler_config)
        self.device = self.runner.device
        self.num_blocks = self.runner.num_blocks
        self.sampler = Sampler()
        self.eos_token_ids = sorted(eos_token_ids)
        self.requests: dict[str, CachedRequestState] = {}
        self.block_table = BlockTable(self.runner.input_buffers.max_blocks_per_req, scheduler_config.max_num_seqs)
        self._previous: StepHandle | None = None  # its samples feed this step's pending tokens
        # Structured outputs: this step's bitmask rows (host int32) by request id.
        self._grammar_rows: dict[str, torch.Tensor] = {}
        # A test hook: called as fault_hook(stage, request_ids) where a step
        # works on those requests ("prepare", "sample", "prompt logprobs");
        # what it raises is handled as a failure of that work would be.
        self.fault_hook: Callable[[str, list[str]], None] | None = None

    def execute_model(self, scheduled: SchedulerOutput) -> StepHandle:
        """Applies the scheduler's changes, queues the step's model and
        sampler work on the device, and returns without waiting for it."""
        self._update_states(scheduled)
        self._grammar_rows = {}
        if scheduled.grammar_request_ids:
            self._grammar_rows = dict(zip(scheduled.grammar_request_ids, torch.from_numpy(scheduled.grammar_bitmask)))
        failed: dict[str, str] = {}
        items = scheduled.scheduled
        sampling_ids = [item.request_id for item in items if item.sample]
        rows, metadata = sampling_ids, None
        if rows:
            # Built before the forward pass is queued: its host-to-device
            # copies then go ahead of the model's work on the GPU stream.
            rows, metadata = self._per_request("prepare", rows, failed, self._sampling_metadata,
                                               lambda row, request_id: self._sampling_metadata([request_id], trial=True))
        wants = frozenset(item.request_id for item in items if self._wants_prompt_logprobs(item.request_id))
        previous = None if self._previous is None else self._previous.samples
        table_rows = np.fromiter((self.requests[item.request_id].row for item in items), np.int64, len(items))
        logits, prompt_logits = self.runner.execute(
            scheduled, self.block_table.gather(table_rows), wants, None if previous is None else previous.sampled,
        )
        samples = None
        if rows:
            prepared = rows
            _, samples = self._per_request(
                "sample", rows, failed,
                lambda rows: self.sampler.sample(logits, metadata if rows is prepared else self._sampling_metadata(rows)),
                lambda row, request_id: self.sampler.sample(logits[row : row + 1],
                                                            self._sampling_metadata([request_id], trial=True)),
            )
            samples.start_copy_to_host()
            for request_id in rows:
                if request_id is not None:
                    self.requests[request_id].num_sampled += 1
        states = {item.request_id: self.requests[item.request_id] for item in items}
        handle = StepHandle(self, sampling_ids, states, samples, prompt_logits, failed)
        self._previous = handle
        return handle

    def _update_states(self, scheduled: SchedulerOutput) -> None:
        for request_id in scheduled.finished_ids:
            state = self.requests.pop(request_id, None)
            if state is not None:
                self.block_table.free_row(state.row)
        for new in scheduled.new_requests:
            params = new.sampling_params
            generator = None
            if params.seed is not None:
                generator = make_generator(params.seed % 2**64, self.device)
            self.requests[new.request_id] = CachedRequestState(
                new.prompt_token_ids, params, new.want_prompt_logprobs, self.block_table.add_row(), [],
                generator=generator,
            )
        requests, append = self.requests, self.block_table.append
        for item in scheduled.scheduled:
            if item.new_block_ids or item.reset_blocks:
                append(requests[item.request_id].row, item.new_block_ids, item.reset_blocks)

    def _wants_prompt_logprobs(self, request_id: str) -> bool:
        state = self.requests[request_id]
        return state.want_prompt_logprobs and state.num_prompt_logprobs < len(state.prompt_token_ids) - 1

    def _sampling_metadata(self, rows: list[str | None], trial: bool = False) -> SamplingMetadata:
        """The sampler's inputs for these rows (None: a failed request's
        neutral row). A trial samples with copies of the generators, so
        trying a row leaves its seeded stream where it was."""
        states = [None if r is None else self.requests[r] for r in rows]
        generators = [None if s is None else s.generator for s in states]
        if trial:
            generators = [None if g is None else g.clone_state() for g in generators]
        md = SamplingMetadata.from_requests(
            [_NEUTRAL_PARAMS if s is None else s.params for s in states],
            [() if s is None else s.output_token_ids for s in states],
            prompt_token_ids=[() if s is None else s.prompt_token_ids for s in states],
            generators=generators,
            eos_token_ids=self.eos_token_ids,
            device=self.device,
            num_output_tokens=[0 if s is None else s.num_sampled for s in states],
        )
        constrained = [i for i, r in enumerate(rows) if r in self._grammar_rows]
        if constrained:
            # One host-to-device copy for the batch; the rows of free
            # requests allow everything and are skipped by the kernel.
            first = self._grammar_rows[rows[constrained[0]]]
            bitmask = torch.full((len(rows), first.shape[0]), -1, dtype=torch.int32)
            for i in constrained:
                bitmask[i] = self._grammar_rows[rows[i]]
            md.grammar_bitmask, md.grammar_rows = to_device(bitmask, torch.int32, self.device), constrained
        return md

    def _per_request(self, stage: str, rows: list[str | None], failed: dict[str, str],
                     run: Callable[[list[str | None]], T], trial: Callable[[int, str], Any]) -> tuple[list[str | None], T]:
        """run(rows): one batched piece of a step over the sampling rows
        (None: a request failed earlier in the step). If it raises, each
        request is tried alone (trial(row, request id)); those that fail
        alone go into `failed`, and run goes again with None in their rows.
        Returns the rows and run's result. A failure that no single request
        explains, or a device fault, propagates."""
        try:
            self.inject(stage, rows)
            return rows, run(rows)
        except Exception as exc:  # noqa: BLE001 -- narrowed to single requests below, else re-raised
            if is_device_fault(exc):
                raise
            batch_error = exc
        rows = list(rows)
        any_failed = False
        for row, request_id in enumerate(rows):
            if request_id is None:
                continue
            try:
                self.inject(stage, [request_id])
                trial(row, request_id)
            except Exception as exc:  # noqa: BLE001
                if is_device_fault(exc):
                    raise
                failed[request_id] = self.fail(request_id, self.requests[request_id], stage, exc)
                rows[row], any_failed = None, True
        if not any_failed:
            raise batch_error
        return rows, run(rows)

    def inject(self, stage: str, rows: list[str | None]) -> None:
        if self.fault_hook is not None:
            self.fault_hook(stage, [r for r in rows if r is not None])

    @staticmethod
    def fail(request_id: str, state: CachedRequestState, stage: str, exc: BaseException) -> str:
        """Marks a request failed (it samples neutrally until the engine ends
        it) and returns the reason the caller sees."""
        logger.error("request %s failed in the step's %s stage; it ends alone, the engine serves on: %s: %s",
                     request_id, stage, type(exc).__name__, exc, exc_info=exc)
        state.params, state.generator, state.want_prompt_logprobs = _NEUTRAL_PARAMS, None, False
        return f"the request failed inside the engine ({stage}): {type(exc).__name__}: {exc}"

    @staticmethod
    def prompt_logprobs(state: CachedRequestState, first_position: int, logits: torch.Tensor) -> list[TokenLogprobs]:
        """Scores prompt tokens first_position+1.. not scored yet (a
        recomputation after preemption repeats positions already scored:
        those are skipped)."""
        skip = state.num_prompt_logprobs - first_position
        if skip >= logits.shape[0]:
            return []
        prompt = state.prompt_token_ids
        targets = prompt[first_position + skip + 1 : first_position + logits.shape[0] + 1]
        entries = compute_token_logprobs(logits[skip:], targets, state.params.prompt_logprobs)
        state.num_prompt_logprobs += len(entries)
        return entries
