"""The scheduler with the KV cache manager and a simulated model runner (no
model): scheduling policies, preemption victims, prefix-cache hits computing
only the tail, and a randomized (hypothesis) run checking the invariants --
no block leaked or owned twice, ref counts equal owners, every cached prefix
holds the right tokens, every request finishes exactly once with the
one-request-at-a-time output, and the pool is whole at the end. The
randomized run also schedules asynchronously (each step before the previous
one's samples are read, as the GPU engine does), with stop tokens that end
requests a step after their next step was scheduled."""

import collections

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.request import Request, RequestStatus
from pagoda.core.scheduler import Scheduler
from pagoda.sampling_params import SamplingParams
from pagoda.worker.block_table import BlockTable


def next_token(tokens):
    """The simulated model: a deterministic function of the whole sequence."""
    return (sum(t * (i + 1) for i, t in enumerate(tokens)) * 31 + len(tokens)) % 97


def reference_output(prompt, max_tokens, stop_token=None):
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
        if tokens[-1] == stop_token:
            break
    return tokens[len(prompt):]


class SimulatedEngine:
    """Scheduler + KV manager + a runner that stores each position's token id
    in its KV slot and checks, before every step, that the slots of the
    already-computed positions hold exactly the request's tokens (what a
    wrong prefix-cache hit or a reused live block would break). Like the
    worker, the runner keeps each request's block table from the scheduler's
    incremental output in the worker's BlockTable (a few rows, so it grows),
    and checks it against the KV manager's."""

    def __init__(self, num_blocks, block_size, max_num_seqs=4, max_num_batched_tokens=64, policy="fcfs", caching=True,
                 async_scheduling=False):
        self.kv = KVCacheManager(num_blocks, block_size, enable_caching=caching)
        self.scheduler = Scheduler(self.kv, max_num_seqs, max_num_batched_tokens, policy)
        self.slots = [None] * (num_blocks * block_size)
        self.finished = collections.Counter()
        self.outputs = {}
        self.num_computed_tokens = 0
        self.order = []  # request ids in the order they were first scheduled
        self.async_scheduling = async_scheduling
        self.in_flight = None  # async: (output, sampled) of the step run last, not read yet
        self.device_tokens = {}  # request id -> prompt + every token sampled (read or not)
        self.stop_tokens = {}
        self.block_table = BlockTable(num_blocks, num_rows=2)
        self.rows = {}  # request id -> its row of block_table, as the worker keeps it

    def add(self, request_id, prompt, max_tokens, priority=0, arrival_time=0.0, stop_token=None):
        params = SamplingParams(max_tokens=max_tokens)
        request = Request(request_id, prompt, params, arrival_time, priority, max_num_tokens=len(prompt) + max_tokens)
        self.scheduler.add_request(request)
        self.device_tokens[request_id] = list(prompt)
        self.stop_tokens[request_id] = stop_token

    def abort(self, request_id):
        request = self.scheduler.requests.get(request_id)
        if request is not None:
            self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
            self.finished[request_id] += 1

    def step(self):
        output = self.scheduler.schedule()
        assert not output.is_empty or self.in_flight or not self.scheduler.has_unfinished_requests(), "stuck"
        ran = (output, self.run_model(output)) if not output.is_empty else None
        if self.async_scheduling:
            ran, self.in_flight = self.in_flight, ran
        if ran is not None:
            self.read_samples(*ran)
        self.check_blocks()
        return output

    def run_model(self, output):
        """The device's side: fills KV slots, samples; a pending input token
        comes from the previous step's samples, as the GPU runner copies it."""
        bs = self.kv.block_size
        previous = self.in_flight[1] if self.in_flight else {}
        sampled = {}
        for request_id in output.finished_ids:
            self.block_table.free_row(self.rows.pop(request_id))
        for new in output.new_requests:
            assert new.request_id not in self.rows, "a request's data sent twice"
            self.rows[new.request_id] = self.block_table.add_row()
        for item in output.scheduled:
            if item.request_id not in self.order:
                self.order.append(item.request_id)
            tokens = self.device_tokens[item.request_id]
            row = self.rows[item.request_id]
            self.block_table.append(row, item.new_block_ids, item.reset_blocks)
            stored = self.block_table.ids[row]
            table = stored[: self.block_table.num_blocks[row]].tolist()
            assert table == self.kv.block_ids(item.request_id), "the worker's block table went wrong"
            assert not stored[len(table):].any(), "stale block ids past the row's blocks"
            slot = lambda pos: table[pos // bs] * bs + pos % bs  # noqa: E731
            end = item.start_position + len(item.token_ids)
            assert len(table) * bs >= end
            token_ids = list(item.token_ids)
            if item.last_token_pending:
                assert self.async_scheduling
                token_ids[-1] = previous[item.request_id]
            assert token_ids == tokens[item.start_position:end]
            for pos in range(item.start_position):
                assert self.slots[slot(pos)] == tokens[pos], f"{item.request_id}: wrong KV at {pos}"
            for pos in range(item.start_position, end):
                self.slots[slot(pos)] = tokens[pos]
            self.num_computed_tokens += len(item.token_ids)
            if item.sample:
                assert end == len(tokens), "sampled twice for one position"
                sampled[item.request_id] = next_token(tokens)
                tokens.append(sampled[item.request_id])
        return sampled

    def read_samples(self, output, sampled):
        """The host's side: tokens of requests still running, stop checks."""
        live = {request_id: token for request_id, token in sampled.items() if request_id in self.scheduler.requests}
        for request in self.scheduler.update_from_output(output, live):
            stopped = request.output_token_ids[-1] == self.stop_tokens[request.request_id]
            if stopped or len(request.output_token_ids) >= request.sampling_params.max_tokens:
                self.outputs[request.request_id] = list(request.output_token_ids)
                self.scheduler.finish(request, RequestStatus.FINISHED_LENGTH)
                self.finished[request.request_id] += 1

    def run(self):
        while self.scheduler.has_unfinished_requests():
            self.step()

    def check_blocks(self):
        pool = self.kv.pool
        owners = collections.Counter()
        for request_id, blocks in self.kv._blocks.items():
            ids = [b.block_id for b in blocks]
            assert len(ids) == len(set(ids)), f"{request_id} holds a block twice"
            owners.update(ids)
        free = pool.free_queue.block_ids()
        assert len(free) == len(set(free)) == pool.num_free_blocks
        for block in pool.blocks:
            assert block.ref_cnt == owners[block.block_id], f"block {block.block_id}: ref_cnt != owners"
            assert (block.ref_cnt == 0) == (block.block_id in free)
        for block_hash, block in pool.cached_block_hash_to_block.items():
            assert block.block_hash == block_hash

    def assert_pool_whole(self):
        assert self.kv.num_free_blocks == self.kv.pool.num_blocks
        assert all(b.ref_cnt == 0 for b in self.kv.pool.blocks)


def test_second_request_computes_only_its_tail():
    engine = SimulatedEngine(num_blocks=32, block_size=4)
    prefix = list(range(1, 41))
    engine.add("a", prefix + [50, 51], max_tokens=3)
    engine.run()
    first = engine.num_computed_tokens
    engine.add("b", prefix + [60, 61, 62], max_tokens=3)
    engine.run()
    assert first == 42 + 2  # prompt, then the two sampled tokens before the last
    assert engine.num_computed_tokens - first == 3 + 2  # 40 of 43 cached: the tail, then 2 decodes
    assert engine.scheduler.requests == {}
    assert engine.outputs["b"] == reference_output(prefix + [60, 61, 62], 3)
    assert engine.kv.prefix_cache_stats.hits == 40
    engine.assert_pool_whole()


def test_priority_serves_an_important_late_request_first():
    engine = SimulatedEngine(num_blocks=32, block_size=4, max_num_seqs=1, policy="priority")
    engine.add("low1", [1, 2, 3], max_tokens=2, priority=5, arrival_time=1.0)
    engine.add("low2", [4, 5, 6], max_tokens=2, priority=5, arrival_time=2.0)
    engine.step()
    engine.add("high", [7, 8, 9], max_tokens=2, priority=0, arrival_time=3.0)
    engine.run()
    assert engine.order == ["low1", "high", "low2"]
    engine.assert_pool_whole()


def test_fcfs_ignores_priority():
    engine = SimulatedEngine(num_blocks=32, block_size=4, max_num_seqs=1)
    engine.add("low1", [1, 2, 3], max_tokens=2, priority=5, arrival_time=1.0)
    engine.add("low2", [4, 5, 6], max_tokens=2, priority=5, arrival_time=2.0)
    engine.step()
    engine.add("high", [7, 8, 9], max_tokens=2, priority=0, arrival_time=3.0)
    engine.run()
    assert engine.order == ["low1", "low2", "high"]


def test_preemption_victim_honours_priority():
    # Two requests that each grow to 3 blocks in a 5-block pool: one must be
    # preempted. Under priority it is the less important one even though it
    # arrived first; under fcfs the later arrival.
    for policy, victim in (("priority", "early_low"), ("fcfs", "late_high")):
        engine = SimulatedEngine(num_blocks=5, block_size=2, policy=policy, caching=False)
        engine.add("early_low", [1, 2, 3], max_tokens=3, priority=9, arrival_time=1.0)
        engine.add("late_high", [4, 5, 6], max_tokens=3, priority=0, arrival_time=2.0)
        preempted = []
        while engine.scheduler.has_unfinished_requests():
            preempted += engine.step().preempted_ids
        assert preempted and preempted[0] == victim, policy
        assert engine.outputs["early_low"] == reference_output([1, 2, 3], 3)
        assert engine.outputs["late_high"] == reference_output([4, 5, 6], 3)
        engine.assert_pool_whole()


PREFIXES = [list(range(1, 30)), list(range(40, 70))]

request_strategy = st.fixed_dictionaries({
    "arrival": st.integers(0, 12),
    "prefix": st.sampled_from([0, 1, None]),
    "prefix_len": st.integers(0, 29),
    "tail": st.lists(st.integers(0, 96), max_size=6),
    "max_tokens": st.integers(1, 6),
    "priority": st.integers(0, 3),
    "abort_after": st.one_of(st.none(), st.integers(0, 15)),
    "stop_token": st.one_of(st.none(), st.integers(0, 96)),
})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    block_size=st.sampled_from([1, 2, 4]),
    num_blocks=st.integers(3, 24),
    max_num_seqs=st.integers(1, 4),
    max_num_batched_tokens=st.integers(1, 16),
    policy=st.sampled_from(["fcfs", "priority"]),
    caching=st.booleans(),
    async_scheduling=st.booleans(),
    specs=st.lists(request_strategy, min_size=1, max_size=10),
)
def test_random_traffic_keeps_the_invariants(block_size, num_blocks, max_num_seqs, max_num_batched_tokens, policy, caching,
                                             async_scheduling, specs):
    engine = SimulatedEngine(num_blocks, block_size, max_num_seqs, max_num_batched_tokens, policy, caching,
                             async_scheduling)
    capacity = num_blocks * block_size
    requests = []
    for index, spec in enumerate(specs):
        prompt = (PREFIXES[spec["prefix"]][: spec["prefix_len"]] if spec["prefix"] is not None else []) + spec["tail"]
        prompt = (prompt or [0])[: capacity - 1]
        max_tokens = min(spec["max_tokens"], capacity - len(prompt))  # a lone request always fits
        requests.append((spec["arrival"], f"r{index}", prompt, max_tokens, spec))
    aborts = {}
    step = 0
    while step <= 12 or engine.scheduler.has_unfinished_requests():
        for arrival, request_id, prompt, max_tokens, spec in requests:
            if arrival == step:
                engine.add(request_id, prompt, max_tokens, spec["priority"], float(arrival), spec["stop_token"])
                if spec["abort_after"] is not None:
                    aborts[request_id] = step + spec["abort_after"]
        for request_id, when in aborts.items():
            if when == step:
                engine.abort(request_id)
        if engine.scheduler.has_unfinished_requests():
            engine.step()
        step += 1
        assert step < 10_000, "no progress"
    assert set(engine.finished) == {request_id for _, request_id, *_ in requests}
    assert all(count == 1 for count in engine.finished.values())
    for _, request_id, prompt, max_tokens, spec in requests:
        if request_id in engine.outputs:
            assert engine.outputs[request_id] == reference_output(prompt, max_tokens, spec["stop_token"])
    engine.assert_pool_whole()


def test_long_prompt_is_chunked_without_stalling_decodes():
    """A 4k-token prompt arriving mid-generation is prefilled in chunks of the
    leftover budget while every running request keeps getting a token each step."""
    engine = SimulatedEngine(num_blocks=400, block_size=16, max_num_seqs=8, max_num_batched_tokens=64)
    for i in range(3):
        engine.add(f"short{i}", [i + 1, i + 2, i + 3], max_tokens=200)
    for _ in range(3):
        engine.step()
    engine.add("long", list(range(4096)), max_tokens=2)
    chunks = 0
    while "long" not in engine.outputs:
        before = {f"short{i}": len(engine.scheduler.requests[f"short{i}"].output_token_ids) for i in range(3)}
        output = engine.scheduler.schedule()
        scheduled = {item.request_id: len(item.token_ids) for item in output.scheduled}
        assert output.num_scheduled_tokens <= 64
        for request_id in before:
            assert scheduled.get(request_id) == 1, "a running decode was skipped this step"
        chunks += "long" in scheduled
        # Run the step as the simulated engine would.
        sampled = {item.request_id: 0 for item in output.scheduled if item.sample}
        for request in engine.scheduler.update_from_output(output, sampled):
            if len(request.output_token_ids) >= request.sampling_params.max_tokens:
                engine.outputs[request.request_id] = list(request.output_token_ids)
                engine.scheduler.finish(request, RequestStatus.FINISHED_LENGTH)
    assert chunks >= 4096 // 64  # the prompt really was split


def test_decodes_come_first_when_an_important_prompt_is_chunked():
    """Under the priority policy a prompt being chunked can outrank running
    decodes; its step still lists the one-token decodes first (the GPU's
    attention splits a batch at its first longer sequence)."""
    engine = SimulatedEngine(num_blocks=400, block_size=16, max_num_seqs=8, max_num_batched_tokens=64,
                             policy="priority")
    for i in range(3):
        engine.add(f"short{i}", [i + 1, i + 2, i + 3], max_tokens=50, priority=5)
    for _ in range(2):
        engine.step()
    engine.add("long", list(range(300)), max_tokens=2, priority=0)
    mixed = 0
    for _ in range(8):
        lengths = [len(item.token_ids) for item in engine.step().scheduled]
        assert lengths == sorted(lengths, key=lambda n: n > 1)
        mixed += 1 in lengths and max(lengths) > 1
    assert mixed >= 1


def test_a_lone_request_the_whole_cache_cannot_grow_is_capped():
    """Two blocks of 4 tokens: a request alone at 8 tokens cannot get a slot
    for its next one. It ends (FINISHED_LENGTH, in SchedulerOutput.capped)
    with its blocks freed, instead of being preempted and readmitted forever."""
    kv = KVCacheManager(num_blocks=2, block_size=4)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    request = Request("a", [1, 2, 3, 4, 5, 6, 7], SamplingParams(max_tokens=None))
    scheduler.add_request(request)
    step = scheduler.schedule()
    assert [s.request_id for s in step.scheduled] == ["a"] and not step.capped
    scheduler.update_from_output(step, {"a": 9})
    step = scheduler.schedule()  # the 8th token's KV fills the second block
    scheduler.update_from_output(step, {"a": 10})
    step = scheduler.schedule()
    assert step.is_empty and step.capped == [request] and not step.preempted_ids
    assert request.status is RequestStatus.FINISHED_LENGTH and request.output_token_ids == [9, 10]
    assert kv.num_free_blocks == 2 and not scheduler.has_unfinished_requests()


def test_a_waiting_request_larger_than_the_whole_cache_is_capped():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    big, small = Request("big", list(range(1, 12)), SamplingParams()), Request("small", [1, 2], SamplingParams())
    scheduler.add_request(big)
    scheduler.add_request(small)
    step = scheduler.schedule()
    assert step.capped == [big] and [s.request_id for s in step.scheduled] == ["small"]
    assert big.status is RequestStatus.FINISHED_LENGTH
