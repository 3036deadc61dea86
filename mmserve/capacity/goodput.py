"""Goodput at p99 SLOs and the encoder:LLM split that maximises it per GPU (`mmserve plan`'s
answer), from runs of the simulation in `mmserve.capacity.simulate`."""

from __future__ import annotations

import bisect
import functools
import math
import os
import statistics
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace

from mmserve.capacity.estimate import capacity
from mmserve.capacity.inputs import SLO, Profile, Workload
from mmserve.capacity.simulate import Result, simulate


def meets(result: Result, slo: SLO) -> bool:
    return result.ttft_p99_s <= slo.ttft_p99_s and result.tpot_p99_s <= slo.tpot_p99_s


GROWTH = 0.05  # a sustainable rate's backlog grows by less than this share of the rate a second
FILL_LATENCIES = 2  # the backlog is judged from this many median latencies after the first arrival,
WINDOW_LATENCIES = 4  # over at least this many (a shorter run cannot tell a filling queue from a growing one)


@dataclass(frozen=True)
class Stability:
    """Whether a run's arrival rate is sustainable, judged by its backlog (requests arrived and not
    yet finished) over the arrival phase: a queue past its capacity grows without bound, at the
    rate minus the capacity; a stable one fills for about one latency, then stays level."""

    growth: float  # the backlog's least-squares slope over the window, as a share of the arrival rate a second
    window_s: float  # the window judged: from the later of `start` and the fill to the last arrival
    latency_s: float  # the median time in system of the requests arriving in the window
    judged: bool  # the window lasts WINDOW_LATENCIES median latencies (else: too short to tell)

    @property
    def keeps_up(self) -> bool:
        return self.growth < GROWTH


def stability(arrivals: Sequence[float], finishes: Sequence[float], start: float | None = None,
              points: int = 256) -> Stability:
    """The backlog's growth over the arrival phase, from `start` (default: the first arrival) but
    no sooner than FILL_LATENCIES median latencies in, to the last arrival (why the backlog:
    docs/capacity.md#routing-at-cluster-scale---routing-scale)."""
    a = sorted(arrivals)
    f = sorted(x for x in finishes if x is not None and math.isfinite(x))
    first, last = a[0], a[-1]
    latencies = [y - x for x, y in zip(arrivals, finishes)
                 if y is not None and math.isfinite(y) and (start is None or x >= start)]
    latency = statistics.median(latencies) if latencies else math.inf
    begin = max(first if start is None else start, first + FILL_LATENCIES * latency)
    judged = last - begin >= WINDOW_LATENCIES * latency
    if not last - begin > 0:  # no window after the fill: judge the arrival phase's second half
        begin = (first + last) / 2
    arrived_in = bisect.bisect_right(a, last) - bisect.bisect_left(a, begin)
    rate = (arrived_in - 1) / (last - begin) if last > begin and arrived_in > 1 else 0.0
    ts = [begin + (last - begin) * k / (points - 1) for k in range(points)]
    backlog = [bisect.bisect_right(a, t) - bisect.bisect_right(f, t) for t in ts]
    return Stability(_slope(ts, backlog) / rate if rate else math.inf, last - begin, latency, judged)


def _slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0


RUN_TTFT_SLOS = 10  # a goodput run lasts at least this many TTFT SLOs of arrivals
MAX_RUN_REQUESTS = 20_000
START = 0.95  # the search from an estimate starts at this share of it (goodput came to 0.91-1.04x it)
TOLERANCE = 0.025  # ...and stops when the bracket's high end is within this share above its low end


def goodput(profile: Profile, workload: Workload, slo: SLO, num_encoders: int, num_llms: int,
            num_requests: int = 1000, seed: int = 0, iterations: int = 12, transport: str = "object_store",
            estimate: float | None = None) -> float:
    """The highest request rate at which p99 TTFT and p99 TPOT stay within `slo` (as the vLLM EPD
    blog's "goodput at P99 SLOs") and the app keeps up (completions >= 0.95 x the offered rate: a
    finite run past saturation can still meet a loose TTFT SLO); 0 when even a trickle misses them.
    Without `estimate`: doubling from 1 req/s until the SLOs break, then `iterations` bisections.
    With one (`mmserve.capacity.estimate.capacity`): from START x it (`_around`), to TOLERANCE."""
    def ok(rate: float) -> bool:
        # long enough for a queue past saturation to outgrow the TTFT SLO, and for the drain after
        # the last arrival to weigh little in the throughput
        arrivals = min(max(num_requests, math.ceil(rate * RUN_TTFT_SLOS * slo.ttft_p99_s)), MAX_RUN_REQUESTS)
        result = simulate(profile, replace(workload, rate=rate), num_encoders, num_llms, arrivals, seed,
                          transport=transport)
        return meets(result, slo) and result.throughput >= 0.95 * rate

    if estimate is not None:
        return _around(ok, START * estimate)
    low, high = 0.0, 1.0
    while ok(high):  # bracket: double until the SLOs break
        low, high = high, high * 2
        if high > 1e6:
            return high
    if low == 0.0 and not ok(high / 1024):
        return 0.0
    for _ in range(iterations):
        mid = (low + high) / 2
        low, high = (mid, high) if ok(mid) else (low, mid)
    return low


def _around(ok, start: float) -> float:
    """The bracket's low end, once high <= low x (1 + TOLERANCE): bracketed from `start`, widening
    by 10%, then 21%, 46%, ... (each step the last one squared) until the SLOs hold at its low end and
    break at its high end, then bisected geometrically; 0 when they break at start / 1024."""
    step = 1.1
    if ok(start):
        low = start
        while ok(high := low * step):
            low, step = high, step * step
            if high > 1e6:
                return high
    else:
        high = start
        while not ok(low := high / step):
            if low < start / 1024:
                return 0.0
            high, step = low, step * step
    while high > low * (1 + TOLERANCE):
        mid = math.sqrt(low * high)
        low, high = (mid, high) if ok(mid) else (low, mid)
    return low


@dataclass(frozen=True)
class Split:
    num_encoders: int
    num_llms: int
    goodput: float  # requests per second within the SLOs

    @property
    def per_gpu(self) -> float:
        return self.goodput / (self.num_encoders + self.num_llms)


@dataclass(frozen=True)
class RuledOut:
    """A split the default search left unsimulated: its analytic capacity x HEADROOM is below the
    best goodput simulated."""

    num_encoders: int
    num_llms: int
    capacity: float  # requests per second (`mmserve.capacity.estimate.capacity`)


@dataclass
class Recommendation:
    gpus: int
    disaggregated: Split
    colocated: Split
    candidates: list[Split] = field(default_factory=list)  # the splits simulated
    ruled_out: list[RuledOut] = field(default_factory=list)

    @property
    def margin(self) -> float:
        """Disaggregated over colocated goodput per GPU (inf when colocated meets no SLO)."""
        return self.disaggregated.per_gpu / self.colocated.per_gpu if self.colocated.per_gpu else math.inf

    def as_dict(self) -> dict:
        return {"gpus": self.gpus, "disaggregated": asdict(self.disaggregated), "colocated": asdict(self.colocated),
                "margin": round(self.margin, 3) if math.isfinite(self.margin) else None,
                "candidates": [asdict(c) for c in self.candidates], "ruled_out": [asdict(r) for r in self.ruled_out]}


# a split is simulated while its capacity x this can reach the best goodput: a goodput can pass the
# capacity a little (1.04x at most on the bundled profile; a finite run keeps 95% of a rate past it)
HEADROOM = 1.15


def recommend(profile: Profile, workload: Workload, slo: SLO, gpus: int, unit: int = 8, num_requests: int = 1000,
              seed: int = 0, transport: str = "object_store", full: bool = False) -> Recommendation:
    """The encoder:LLM split of `gpus` that maximises goodput per GPU, against all-colocated. A
    cluster is gpus/unit cells of `unit` GPUs (a smaller one is simulated whole); the search and
    `full`: docs/capacity.md#the-search-seconds-by-default---full-for-every-split."""
    cell = min(gpus, unit)
    splits, colocated, ruled_out = _cell_goodput(profile, workload, slo, cell, num_requests, seed, transport, full)
    scale = gpus / cell

    def scaled(e: int, rate: float) -> tuple[int, int, float]:
        return round(e * scale), gpus - round(e * scale), rate * scale

    candidates = [Split(*scaled(e, rate)) for e, rate in splits]
    best = max(candidates, key=lambda s: (s.per_gpu, -s.num_encoders)) if candidates else Split(*scaled(0, colocated))
    return Recommendation(gpus, best, Split(*scaled(0, colocated)), candidates,
                          [RuledOut(*scaled(e, cap)) for e, cap in ruled_out])


@functools.lru_cache(maxsize=64)
def _cell_goodput(profile: Profile, workload: Workload, slo: SLO, cell: int, num_requests: int, seed: int,
                  transport: str, full: bool) -> tuple[tuple[tuple[int, float], ...], float, tuple[tuple[int, float], ...]]:
    """((encoders, goodput) for each disaggregated split of `cell` GPUs simulated, colocated goodput,
    (encoders, capacity) for each split ruled out)."""
    caps = {e: capacity(profile, workload, e, cell - e) for e in range(cell)}

    def search(e: int) -> functools.partial:
        return functools.partial(goodput, profile, workload, slo, e, cell - e, num_requests, seed,
                                 transport=transport, estimate=None if full else caps[e])

    splits = range(1, cell)
    if full:
        colocated, *rates = _run_all([search(e) for e in (0, *splits)])
        return tuple(zip(splits, rates)), colocated, ()
    first = [e for e in splits if caps[e] * HEADROOM >= max(caps[e] for e in splits)]
    colocated, *rates = _run_all([search(e) for e in (0, *first)])
    found = dict(zip(first, rates))
    then = [e for e in splits if e not in found and caps[e] * HEADROOM >= max(found.values())]
    found.update(zip(then, _run_all([search(e) for e in then])))
    return (tuple(sorted(found.items())), colocated,
            tuple((e, caps[e]) for e in splits if e not in found))


def _run_all(calls: list[Callable[[], float]]) -> list[float]:
    """Each call's result, the calls spread over a process per core (the searches are independent)."""
    workers = min(len(calls), os.cpu_count() or 1)
    if workers < 2:
        return [call() for call in calls]
    with ProcessPoolExecutor(workers) as pool:
        return list(pool.map(_call, calls))


def _call(call: Callable[[], float]) -> float:
    return call()
