"""Per-tenant queues, GPU-time shares, priority classes and admission control.

Share mode is weighted fair queueing on *measured* GPU time: each tenant has a
virtual time, the GPU seconds charged to it (from the timer's event pairs)
divided by its share. A free batch slot goes to the waiting tenant whose
virtual time, plus an estimate for its requests still running, is lowest; a
tenant that comes back from idle starts level with the active tenant furthest
behind, so idleness banks no credit. Each step's cost is charged provisionally
at once (recent seconds per token) and replaced by the measurement when the
resolver delivers it, so the tens of milliseconds of measurement lag cause no
herding. A waiting request of a higher priority class may preempt a running
request of a lower class when its tenant is behind the victim's tenant (the
victim is requeued at the front and recomputed later). While a higher class
has requests running, lower classes join the batch at most every
``join_every`` iterations, all their newcomers in one prefill: each join costs
an extra prefill step, which on a launch-bound GPU (a step costs about the same
for 1 or 32 rows) would otherwise double the higher class's inter-token
latency. Lower classes are paced, never shut out: shutting them out lets the
batch drain, the higher class then pays for whole steps alone, overtakes its
share and loses its rights, which is worse for its latency. So high-priority
latency holds under a low-priority flood without letting priority override
shares. FCFS mode serves arrivals in order, for comparison.

Thread safety: the HTTP loop submits, the engine thread picks, the timer's
resolver thread charges; one lock guards everything, held for microseconds.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from .config import SchedulerMode, TenantSpec


class Schedulable(Protocol):
    tenant: str
    seq: int
    cancelled: bool
    generated: list[int]


class QueueFull(Exception):
    """The tenant's queue is at its bound; ``retry_after`` is a whole number of seconds."""

    def __init__(self, tenant: str, retry_after: int) -> None:
        super().__init__(f"queue of tenant {tenant!r} is full")
        self.tenant = tenant
        self.retry_after = retry_after


@dataclass(frozen=True)
class TenantState:
    """What metrics read about one tenant."""

    queued: int
    running: int
    gpu_seconds: float
    quota: float
    preemptions: int


class Scheduler:
    def __init__(self, tenants: Iterable[TenantSpec], mode: SchedulerMode = SchedulerMode.SHARE,
                 max_queue: int = 64, clock=time.monotonic, join_every: int = 8) -> None:
        self.mode = mode
        self.max_queue = max_queue
        self.join_every = max(1, join_every)
        self._clock = clock
        self._specs = {t.name: t for t in tenants}
        self._lock = threading.Lock()
        self._queues: dict[str, deque] = {n: deque() for n in self._specs}
        self._vt = dict.fromkeys(self._specs, 0.0)
        self._used = dict.fromkeys(self._specs, 0.0)
        self._running = dict.fromkeys(self._specs, 0)
        self._preemptions = dict.fromkeys(self._specs, 0)
        self._finished = 0
        self._finish_times: deque[float] = deque(maxlen=256)
        self._seq = itertools.count()
        self._starved: set[str] = set()
        self._per_token: dict[str, float] = {}  # recent measured seconds per token, by step op
        self._iteration = 0  # engine iterations (one pick() each); paces lower-class joins
        # the last iteration in which each tenant joined while a higher class was running
        self._lower_joined = dict.fromkeys(self._specs, -(1 << 30))
        self._started = dict.fromkeys(self._specs, 0)
        self._steps = 0  # provisional charges made (one per timed step)
        self._charges = 0  # measurements received

    # --- HTTP side ---------------------------------------------------------------
    def submit(self, req: Schedulable) -> None:
        """Queue a request, or raise ``QueueFull`` when its tenant's queue is at the bound."""
        with self._lock:
            queue = self._queues[req.tenant]
            if len(queue) >= self.max_queue:
                raise QueueFull(req.tenant, self._retry_after(req.tenant, len(queue)))
            if not queue and not self._running[req.tenant]:
                self._reactivate(req.tenant)
            req.seq = next(self._seq)
            queue.append(req)

    # --- engine side -------------------------------------------------------------
    def waiting(self) -> int:
        with self._lock:
            return sum(len(q) for q in self._queues.values())

    def oldest_seq_age(self) -> tuple[int, float | None]:
        """(waiting requests, arrival time of the oldest head) for the max-wait batching rule."""
        with self._lock:
            heads = [q[0] for q in self._queues.values() if q]
            count = sum(len(q) for q in self._queues.values())
        if not heads:
            return 0, None
        return count, min(getattr(h, "arrival", 0.0) for h in heads)

    def pick(self, n: int) -> list:
        """Up to ``n`` waiting requests to start now, in the order the policy gives."""
        picked = []
        with self._lock:
            self._iteration += 1
            for _ in range(n):
                name = self._next_tenant()
                if name is None:
                    break
                req = self._queues[name].popleft()
                if not req.cancelled:
                    self._running[name] += 1
                    self._started[name] += 1
                    if self._higher_running(name):
                        self._lower_joined[name] = self._iteration
                picked.append(req)
        return picked

    def preempt(self, running: list) -> tuple[Schedulable, Schedulable] | None:
        """(victim, request to start in its slot), or None; the victim goes back to the queue front."""
        if self.mode != SchedulerMode.SHARE:
            return None
        with self._lock:
            waiting = [n for n, q in self._queues.items() if q and n not in self._starved]
            if not waiting:
                return None
            name = min(waiting, key=lambda n: (self._specs[n].rank, self._key(n)))
            rank, key = self._specs[name].rank, self._key(name)
            victims = [r for r in running if self._specs[r.tenant].rank > rank
                       and self._key(r.tenant) >= key and not r.cancelled]
            if not victims:
                return None
            victim = max(victims, key=lambda r: (self._specs[r.tenant].rank, -len(r.generated), r.seq))
            req = self._queues[name].popleft()
            self._running[victim.tenant] -= 1
            self._preemptions[victim.tenant] += 1
            self._queues[victim.tenant].appendleft(victim)
            if not req.cancelled:
                self._running[name] += 1
                self._started[name] += 1
            return victim, req

    def take_all(self) -> list:
        """Every waiting request out of the queues, a starved tenant's too, none of them started
        (the server is shutting down and ends them)."""
        with self._lock:
            taken = [req for queue in self._queues.values() for req in queue]
            for queue in self._queues.values():
                queue.clear()
        return taken

    def finished(self, req: Schedulable) -> None:
        """A started request left the batch (done, aborted or failed)."""
        with self._lock:
            self._running[req.tenant] = max(0, self._running[req.tenant] - 1)
            self._finished += 1
            self._finish_times.append(self._clock())

    def provisional(self, op: str, tokens: dict[str, int]) -> float:
        """Charge a step's estimated cost now; ``charge`` replaces it with the measurement.

        Measurements arrive a resolver interval later (tens of ms, many steps); without
        an estimate meanwhile, every slot freed in that time would go to the same tenant.
        """
        total = sum(tokens.values())
        with self._lock:
            self._steps += 1
            estimate = self._per_token.get(op, 0.0) * total
            if estimate > 0:
                for name, count in tokens.items():
                    self._vt[name] += estimate * count / total / self._specs[name].share
        return estimate

    # --- resolver side -----------------------------------------------------------
    def charge(self, tokens: dict[str, int], seconds: float, op: str = "", estimate: float = 0.0) -> None:
        """Split one step's measured GPU seconds among tenants in proportion to their tokens."""
        total = sum(tokens.values())
        if total <= 0 or seconds < 0 or not math.isfinite(seconds):
            return
        with self._lock:
            self._charges += 1
            if op:
                rate = seconds / total
                old = self._per_token.get(op)
                self._per_token[op] = rate if old is None else 0.8 * old + 0.2 * rate
            for name, count in tokens.items():
                part = seconds * count / total
                self._used[name] += part
                self._vt[name] += (part - estimate * count / total) / self._specs[name].share

    # --- faults and metrics ------------------------------------------------------
    def set_starved(self, tenant: str | None) -> None:
        """Stop serving ``tenant``'s queue (the starvation fault); None serves everyone again."""
        with self._lock:
            self._starved = {tenant} if tenant else set()

    def state(self) -> dict[str, TenantState]:
        with self._lock:
            return {n: TenantState(len(self._queues[n]), self._running[n], self._used[n],
                                   self._specs[n].share if self.mode == SchedulerMode.SHARE else 0.0,
                                   self._preemptions[n]) for n in self._specs}

    def gpu_seconds(self) -> dict[str, float]:
        with self._lock:
            return dict(self._used)

    def diagnostics(self) -> dict:
        """Accounting internals for benchmarks and debugging (not exported as metrics)."""
        with self._lock:
            return {"virtual_time_s": dict(self._vt), "gpu_seconds": dict(self._used),
                    "started": dict(self._started), "preemptions": dict(self._preemptions),
                    "finished": self._finished, "cost_per_request_s": self._cost_per_request(),
                    "steps_charged_provisionally": self._steps, "measurements_received": self._charges,
                    "iterations": self._iteration}

    # --- policy (lock held) ------------------------------------------------------
    def _cost_per_request(self) -> float:
        # Before anything finished, a unit cost makes running counts split slots by share.
        return sum(self._used.values()) / self._finished if self._finished else 1e-3

    def _key(self, name: str) -> float:
        return self._vt[name] + self._running[name] * self._cost_per_request() / self._specs[name].share

    def _next_tenant(self) -> str | None:
        waiting = [n for n, q in self._queues.items() if q and n not in self._starved]
        if not waiting:
            return None
        if self.mode == SchedulerMode.FCFS:
            return min(waiting, key=lambda n: self._queues[n][0].seq)
        # While a higher class has requests running, a lower class joins (its prefill is an extra
        # step every running request waits for) only every join_every iterations, all the slots
        # it gets in that iteration sharing one prefill step; its running requests keep decoding.
        waiting = [n for n in waiting if self._may_join(n)]
        if not waiting:
            return None
        return min(waiting, key=lambda n: (self._key(n), self._specs[n].rank))

    def _higher_running(self, name: str) -> list[str]:
        rank = self._specs[name].rank
        return [h for h, count in self._running.items() if count and self._specs[h].rank < rank]

    def _may_join(self, name: str) -> bool:
        if not self._higher_running(name):
            return True
        last = self._lower_joined[name]
        return last == self._iteration or self._iteration - last >= self.join_every

    def _reactivate(self, name: str) -> None:
        active = [self._vt[n] for n in self._specs
                  if n != name and (self._queues[n] or self._running[n])]
        if active:
            self._vt[name] = max(self._vt[name], min(active))

    def _retry_after(self, name: str, depth: int) -> int:
        now = self._clock()
        times = self._finish_times
        rate = len(times) / (now - times[0]) if len(times) > 1 and now > times[0] else 1.0
        share = self._specs[name].share if self.mode == SchedulerMode.SHARE else 1.0
        return max(1, min(60, math.ceil(depth / max(rate * share, 0.1))))
