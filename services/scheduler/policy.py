"""Waiting-queue policies: which waiting request is admitted next.

* `fcfs`: arrival order.
* `priority`: lower `priority` value first, ties by arrival.
* `fair`: weighted fair share across tenants by tokens served. Each tenant has a virtual
  time that grows by `tokens / weight` for every token the scheduler computes for it
  (prefill and decode). The next admission goes to the tenant with the smallest virtual
  time, so a tenant flooding the queue cannot starve another. A tenant that becomes active
  starts at the smallest virtual time of the active tenants: idling banks no credit.

A preempted request is `requeue`d: it goes back in front of its peers (fcfs and fair put it
at the head of its queue; priority order already places it by its priority and arrival).
Removal (abort of a waiting request) is linear in the queue length; aborts are rare next to
admissions.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque

from services.scheduler.request import Request


class QueuePolicy:
    """The interface every policy implements."""

    name = "base"

    def add(self, request: Request) -> None:
        raise NotImplementedError

    def requeue(self, request: Request) -> None:
        raise NotImplementedError

    def peek(self) -> Request | None:
        raise NotImplementedError

    def pop(self) -> Request:
        raise NotImplementedError

    def remove(self, request: Request) -> None:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def charge(self, request: Request, num_tokens: int) -> None:
        """Account `num_tokens` computed for `request` (only `fair` uses it)."""


class FcfsPolicy(QueuePolicy):
    name = "fcfs"

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def requeue(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request | None:
        return self._queue[0] if self._queue else None

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)


class PriorityPolicy(QueuePolicy):
    name = "priority"

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def add(self, request: Request) -> None:
        key = (request.priority, request.arrival_time, next(self._counter), request)
        heapq.heappush(self._heap, key)

    requeue = add

    def peek(self) -> Request | None:
        return self._heap[0][3] if self._heap else None

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        self._heap = [item for item in self._heap if item[3] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)


class FairPolicy(QueuePolicy):
    name = "fair"

    def __init__(self) -> None:
        self._queues: dict[str, deque[Request]] = {}
        self.virtual_time: dict[str, float] = {}
        self._num_waiting = 0

    def add(self, request: Request) -> None:
        self._queue_for(request).append(request)
        self._num_waiting += 1

    def requeue(self, request: Request) -> None:
        self._queue_for(request).appendleft(request)
        self._num_waiting += 1

    def peek(self) -> Request | None:
        tenant = self._next_tenant()
        return self._queues[tenant][0] if tenant is not None else None

    def pop(self) -> Request:
        tenant = self._next_tenant()
        if tenant is None:
            raise IndexError("pop from an empty queue")
        return self._take(tenant, self._queues[tenant].popleft())

    def remove(self, request: Request) -> None:
        self._queues[request.tenant].remove(request)
        self._take(request.tenant, request)

    def __len__(self) -> int:
        return self._num_waiting

    def charge(self, request: Request, num_tokens: int) -> None:
        vt = self.virtual_time.get(request.tenant, 0.0)
        self.virtual_time[request.tenant] = vt + num_tokens / request.weight

    def _queue_for(self, request: Request) -> deque[Request]:
        queue = self._queues.get(request.tenant)
        if queue is None:
            floor = min((self.virtual_time[t] for t in self._queues), default=0.0)
            vt = self.virtual_time.get(request.tenant, 0.0)
            self.virtual_time[request.tenant] = max(vt, floor)
            queue = self._queues[request.tenant] = deque()
        return queue

    def _take(self, tenant: str, request: Request) -> Request:
        self._num_waiting -= 1
        if not self._queues[tenant]:
            del self._queues[tenant]
        return request

    def _next_tenant(self) -> str | None:
        # Ties go to the tenant whose head request arrived first; tenants are few.
        return min(
            self._queues,
            key=lambda t: (self.virtual_time[t], self._queues[t][0].arrival_time),
            default=None,
        )


_POLICIES = {p.name: p for p in (FcfsPolicy, PriorityPolicy, FairPolicy)}


def make_policy(name: str) -> QueuePolicy:
    """The policy named `name` (`fcfs`, `priority` or `fair`; validated by the config)."""
    return _POLICIES[name]()
