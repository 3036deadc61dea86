"""The capacity planner's event engine (`mmserve.capacity.simulate` simulates the app with it): a clock of
timed callbacks, batching stations of identical servers, processor sharing for replicas that
share one box's cores, and Serve's autoscaling loop with its delays."""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable


class Simulator:
    """A clock and a heap of timed callbacks, run in time order (ties in scheduling order)."""

    def __init__(self):
        self.now = 0.0
        self._events: list = []
        self._order = itertools.count()

    def at(self, time: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._events, (time, next(self._order), action))

    def after(self, delay: float, action: Callable[[], None]) -> None:
        self.at(self.now + delay, action)

    def run(self) -> None:
        while self._events:
            self.now, _, action = heapq.heappop(self._events)
            action()


class SharedCores:
    """Processor sharing: the forwards and steps of every replica on one box progress at rate
    `min(1, capacity / jobs running)`, where a job alone runs at the speed it was measured at and
    `capacity` jobs run at full speed at once."""

    def __init__(self, sim: Simulator, capacity: float):
        self.sim, self.capacity = sim, capacity
        self._jobs: dict[int, list] = {}  # id -> [work left (seconds at full speed), done]
        self._ids = itertools.count()
        self._last = 0.0
        self._version = 0  # a completion scheduled before the last change is stale

    def _rate(self) -> float:
        return min(1.0, self.capacity / len(self._jobs)) if self._jobs else 1.0

    def _advance(self) -> None:
        elapsed, rate = self.sim.now - self._last, self._rate()
        for job in self._jobs.values():
            job[0] -= elapsed * rate
        self._last = self.sim.now

    def run(self, seconds: float, done: Callable[[], None]) -> None:
        """`done()` once `seconds` of full-speed work have been served."""
        self._advance()
        self._jobs[next(self._ids)] = [seconds, done]
        self._schedule()

    def _schedule(self) -> None:
        self._version += 1
        if self._jobs:
            version, left = self._version, min(job[0] for job in self._jobs.values())
            self.sim.after(max(left, 0.0) / self._rate(), lambda: self._complete(version))

    def _complete(self, version: int) -> None:
        if version != self._version:
            return
        self._advance()
        finished = [key for key, job in self._jobs.items() if job[0] <= 1e-12]
        callbacks = [self._jobs.pop(key)[1] for key in finished]
        self._schedule()
        for done in callbacks:
            done()


class OneAtATime:
    """A device that runs one job at a time, in the order they come: a colocated engine that runs
    the ViT inside its step (vLLM's), where a decode step waits for an encode and the reverse."""

    def __init__(self, sim: Simulator):
        self.sim = sim
        self._queue: deque[tuple[float, Callable[[], None]]] = deque()
        self._busy = False

    def run(self, seconds: float, done: Callable[[], None]) -> None:
        self._queue.append((seconds, done))
        if not self._busy:
            self._next()

    def _next(self) -> None:
        self._busy = bool(self._queue)
        if self._busy:
            seconds, done = self._queue.popleft()
            self.sim.after(seconds, lambda: (done(), self._next()))


def serving(sim: Simulator, cores: SharedCores | OneAtATime | None) -> Callable[[float, Callable[[], None]], None]:
    """How a replica spends `seconds` of service: on its own device, or on the box's shared cores."""
    return cores.run if cores is not None else sim.after


def countdown(n: int, done: Callable[[], None]) -> Callable[[], None]:
    """A callback that calls `done()` on its `n`-th call (the last of `n` parts back)."""
    left = [n]

    def part_done() -> None:
        left[0] -= 1
        if not left[0]:
            done()

    return part_done


class BatchStation:
    """`servers` identical servers sharing one FIFO queue. A free server takes the longest queue
    prefix whose summed cost fits `max_cost` (one job at least) and holds it for
    `service(cost, jobs)` seconds (of `cores`, when the servers share a box). With `max_jobs=1`
    and exponential service it is an M/M/c queue (tests/unit/test_capacity.py checks it against Erlang C)."""

    def __init__(self, sim: Simulator, servers: int, service: Callable[[float, int], float],
                 max_cost: float = math.inf, max_jobs: int | float = math.inf,
                 cores: SharedCores | OneAtATime | None = None):
        self.sim, self.service = sim, service
        self._serve = serving(sim, cores)
        self.max_cost, self.max_jobs = max_cost, max_jobs
        self.free = servers
        self.queue: deque[tuple[float, Callable[[], None]]] = deque()
        self.busy_seconds = 0.0
        self.in_service = 0.0  # summed cost of the batches being served
        self._retiring = 0  # servers to take away as they finish their batch

    @property
    def queued(self) -> float:
        """Cost waiting or in service (what the encoder pool's autoscaling policy reads)."""
        return self.in_service + sum(cost for cost, _ in self.queue)

    def add_server(self) -> None:
        self._server_back()
        self._start()

    def _server_back(self) -> None:
        if self._retiring:
            self._retiring -= 1
        else:
            self.free += 1

    def retire_server(self) -> None:
        """One server fewer: an idle one now, else the next to finish its batch."""
        if self.free:
            self.free -= 1
        else:
            self._retiring += 1

    def submit(self, cost: float, done: Callable[[], None]) -> None:
        self.queue.append((cost, done))
        self._start()

    def _start(self) -> None:
        while self.free and self.queue:
            batch = [self.queue.popleft()]
            total = batch[0][0]
            while self.queue and len(batch) < self.max_jobs and total + self.queue[0][0] <= self.max_cost:
                total += self.queue[0][0]
                batch.append(self.queue.popleft())
            seconds = self.service(total, len(batch))
            self.free -= 1
            self.busy_seconds += seconds
            self.in_service += total
            self._serve(seconds, lambda batch=batch, total=total: self._finish(batch, total))

    def _finish(self, batch, total: float) -> None:
        self.in_service -= total
        self._server_back()
        for _, done in batch:
            done()
        self._start()


class Autoscaler:
    """Serve's autoscaling loop over one pool: every `interval_s` the policy asks for
    ceil(load / target per replica) replicas within [min, max]; an ask above (below) the current
    count is acted on once it has held for `upscale_delay_s` (`downscale_delay_s`); an added
    replica serves `start_s` later (`grow` is called then), a removed one at once (`shrink`)."""

    def __init__(self, sim: Simulator, scaling, replicas: int, load: Callable[[], float],
                 grow: Callable[[], None], shrink: Callable[[], None], active: Callable[[], bool]):
        self.sim, self.scaling = sim, scaling
        self.replicas = replicas  # serving or starting
        self.load, self.grow, self.shrink, self.active = load, grow, shrink, active
        self._since: float | None = None  # when the current ask (up or down) began
        self._direction = 0
        self.replica_seconds, self._last = 0.0, 0.0
        self.peak = replicas
        sim.after(scaling.interval_s, self._tick)

    def _count(self, delta: int) -> None:
        now = self.sim.now
        self.replica_seconds += self.replicas * (now - self._last)
        self._last, self.replicas = now, self.replicas + delta
        self.peak = max(self.peak, self.replicas)

    def _tick(self) -> None:
        s, now = self.scaling, self.sim.now
        desired = max(s.min_replicas, min(s.max_replicas, math.ceil(self.load() / s.target_per_replica)))
        direction = (desired > self.replicas) - (desired < self.replicas)
        if direction != self._direction:
            self._direction, self._since = direction, now
        delay = s.upscale_delay_s if direction > 0 else s.downscale_delay_s
        if direction and now - self._since >= delay:
            for _ in range(abs(desired - self.replicas)):
                self._count(direction)
                if direction > 0:
                    self.sim.after(s.start_s, self.grow)
                else:
                    self.shrink()
            self._direction, self._since = 0, None
        if self.active():
            self.sim.after(s.interval_s, self._tick)

    def mean_replicas(self, end: float) -> float:
        seconds = self.replica_seconds + self.replicas * (end - self._last)
        return seconds / end if end > 0 else float(self.replicas)
