"""Goodput at p99 SLOs and the encoder:LLM split that maximises it per GPU (`mmserve plan`'s
answer), from runs of the simulation in `mmserve.capacity.simulate`."""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field, replace

from mmserve.capacity.inputs import SLO, Profile, Workload
from mmserve.capacity.simulate import Result, simulate


def meets(result: Result, slo: SLO) -> bool:
    return result.ttft_p99_s <= slo.ttft_p99_s and result.tpot_p99_s <= slo.tpot_p99_s


RUN_TTFT_SLOS = 10  # a goodput run lasts at least this many TTFT SLOs of arrivals
MAX_RUN_REQUESTS = 20_000


def goodput(profile: Profile, workload: Workload, slo: SLO, num_encoders: int, num_llms: int,
            num_requests: int = 1000, seed: int = 0, iterations: int = 12, transport: str = "object_store") -> float:
    """The highest request rate at which p99 TTFT and p99 TPOT stay within `slo` (as the vLLM EPD
    blog's "goodput at P99 SLOs") and the app keeps up (completions >= 0.95 x the offered rate: a
    finite run past saturation can still meet a loose TTFT SLO), by bisection; 0 when even a
    trickle misses them."""
    def ok(rate: float) -> bool:
        # long enough for a queue past saturation to outgrow the TTFT SLO, and for the drain after
        # the last arrival to weigh little in the throughput
        arrivals = min(max(num_requests, math.ceil(rate * RUN_TTFT_SLOS * slo.ttft_p99_s)), MAX_RUN_REQUESTS)
        result = simulate(profile, replace(workload, rate=rate), num_encoders, num_llms, arrivals, seed,
                          transport=transport)
        return meets(result, slo) and result.throughput >= 0.95 * rate

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


@dataclass(frozen=True)
class Split:
    num_encoders: int
    num_llms: int
    goodput: float  # requests per second within the SLOs

    @property
    def per_gpu(self) -> float:
        return self.goodput / (self.num_encoders + self.num_llms)


@dataclass
class Recommendation:
    gpus: int
    disaggregated: Split
    colocated: Split
    candidates: list[Split] = field(default_factory=list)

    @property
    def margin(self) -> float:
        """Disaggregated over colocated goodput per GPU (inf when colocated meets no SLO)."""
        return self.disaggregated.per_gpu / self.colocated.per_gpu if self.colocated.per_gpu else math.inf

    def as_dict(self) -> dict:
        return {"gpus": self.gpus, "disaggregated": asdict(self.disaggregated), "colocated": asdict(self.colocated),
                "margin": round(self.margin, 3) if math.isfinite(self.margin) else None,
                "candidates": [asdict(c) for c in self.candidates]}


def recommend(profile: Profile, workload: Workload, slo: SLO, gpus: int, unit: int = 8, num_requests: int = 1000,
              seed: int = 0, transport: str = "object_store") -> Recommendation:
    """The encoder:LLM split of `gpus` that maximises goodput per GPU, against all-colocated.

    Every split of a `unit`-GPU cell is simulated (a cluster of `gpus` is gpus/unit such cells,
    requests spread evenly over them, so goodput per GPU is the cell's); a cluster smaller than
    one cell is simulated whole."""
    cell = min(gpus, unit)
    splits, colocated = _cell_goodput(profile, workload, slo, cell, num_requests, seed, transport)
    scale = gpus / cell

    def scaled(e: int, rate: float) -> Split:
        return Split(round(e * scale), gpus - round(e * scale), rate * scale)

    candidates = [scaled(e, rate) for e, rate in splits]
    best = max(candidates, key=lambda s: (s.per_gpu, -s.num_encoders)) if candidates else scaled(0, colocated)
    return Recommendation(gpus, best, scaled(0, colocated), candidates)


@functools.lru_cache(maxsize=64)
def _cell_goodput(profile: Profile, workload: Workload, slo: SLO, cell: int, num_requests: int,
                  seed: int, transport: str) -> tuple[tuple[tuple[int, float], ...], float]:
    """((encoders, goodput) for each disaggregated split of `cell` GPUs, colocated goodput)."""
    splits = tuple((e, goodput(profile, workload, slo, e, cell - e, num_requests, seed, transport=transport))
                   for e in range(1, cell))
    return splits, goodput(profile, workload, slo, 0, cell, num_requests, seed)
