"""The scheduler's waiting queue, ordered by scheduling policy (vLLM's names):
fcfs -- arrival order, preempted requests back at the front; priority -- lowest
`priority` value first, ties by arrival time."""

from __future__ import annotations

import collections
import heapq
import itertools

from pagoda.config import SCHEDULING_POLICIES
from pagoda.core.request import Request


class FCFSRequestQueue:
    def __init__(self):
        self._queue: collections.deque[Request] = collections.deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        """A preempted request resumes before everyone who arrived after it."""
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> bool:
        try:
            self._queue.remove(request)
            return True
        except ValueError:
            return False

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self):
        return iter(self._queue)


class PriorityRequestQueue:
    def __init__(self):
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()  # keeps equal keys in insertion order; never compares Requests

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time, next(self._counter), request))

    prepend = add  # a preempted request goes back by its own priority and arrival

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> bool:
        for index, entry in enumerate(self._heap):
            if entry[3] is request:
                self._heap[index] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return True
        return False

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self):
        return (entry[3] for entry in sorted(self._heap, key=lambda e: e[:3]))


def create_request_queue(policy: str) -> FCFSRequestQueue | PriorityRequestQueue:
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {policy!r}")
