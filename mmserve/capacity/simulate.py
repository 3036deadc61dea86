"""Capacity planning (`mmserve plan`): how many encoder replicas per LLM replica a workload needs.

A discrete-event simulation of the app, one request at a time through its stages (router, encoder
pool, transfer, LLM replicas; colocated: each LLM replica encodes beside or inside its steps), from
a `Profile` labelled with its source: docs/capacity.md#the-model says what it models and leaves out.
Named apart from `mmserve.request.prompt_plan`, the router's per-request planner.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from mmserve.capacity.events import Autoscaler, BatchStation, OneAtATime, SharedCores, Simulator, countdown, serving
from mmserve.capacity.inputs import SLO, Autoscaling, Profile, Workload
from mmserve.capacity.replicas import EncoderPool, LLMReplica, Request


@dataclass(frozen=True)
class Result:
    num_encoders: int
    num_llms: int
    rate: float
    throughput: float  # completed requests per second
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p99_s: float
    slo_attainment: float  # share of requests within both SLOs (1.0 without SLOs)
    encoder_utilisation: float
    llm_utilisation: float
    refused_share: float = 0.0  # requests refused at admission (429s), of all that arrived
    preemptions: int = 0  # sequences preempted for KV room (recomputed later)
    # replicas over the run, time-averaged and at most (the fixed counts without autoscaling)
    mean_encoders: float = 0.0
    mean_llms: float = 0.0
    peak_encoders: int = 0
    peak_llms: int = 0

    @property
    def gpus(self) -> int:
        return self.num_encoders + self.num_llms


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank percentile (q in 0..100); nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def simulate(profile: Profile, workload: Workload, num_encoders: int, num_llms: int, num_requests: int = 2000,
             seed: int = 0, slo: SLO | None = None, arrivals: list[tuple[float, int]] | None = None,
             encoder_scaling: Autoscaling | None = None, llm_scaling: Autoscaling | None = None,
             transport: str = "object_store") -> Result:
    """One run of `num_requests` arrivals at the workload's rate, or of the (time, images)
    `arrivals` of a real run, replayed. `num_encoders=0` is the colocated mode; embeddings reach
    the LLM replicas over `transport` ("object_store" or "grpc"). With `encoder_scaling` /
    `llm_scaling` the pools start at those counts and autoscale."""
    profile.transfer_seconds(0, transport)  # a transport it knows
    rng = random.Random(seed)
    sim = Simulator()
    pending: set[int] = set()  # admitted requests without a first token (by index), for admission
    cores = SharedCores(sim, profile.shared_capacity) if profile.shared_capacity else None
    requests: list[Request] = []
    route = serving(sim, cores)  # on a shared box the router's work takes its cores too

    encoders = EncoderPool(sim, profile, num_encoders, cores, rng) if num_encoders else None

    def new_llm() -> LLMReplica:
        if encoders:
            return LLMReplica(sim, profile, cores)
        # colocated: its own encoder shares its device, beside its steps or inside them
        device = cores or (OneAtATime(sim) if profile.colocated_encoder == "in_step" else SharedCores(sim, 1.0))
        encoder = BatchStation(sim, 1, profile.encode_seconds, max_cost=profile.max_batch_tokens, cores=device)
        return LLMReplica(sim, profile, device, encoder=encoder)

    llms = [new_llm() for _ in range(num_llms)]

    def least_loaded() -> LLMReplica:
        return min((r for r in llms if not r.draining), key=lambda r: r.in_flight)  # ties: the first

    open_from = [0]  # requests before this index are finished or refused

    def active() -> bool:
        while open_from[0] < len(requests) and (requests[open_from[0]].finish is not None
                                                or requests[open_from[0]].refused):
            open_from[0] += 1
        return open_from[0] < len(requests)

    scalers = {}
    if encoders and encoder_scaling:
        if encoder_scaling.min_replicas < 1:
            raise ValueError("the encoder pool autoscales from one replica at least")
        scalers["encoders"] = Autoscaler(sim, encoder_scaling, num_encoders, lambda: encoders.queued,
                                         encoders.add_server, encoders.retire_server, active)
    if llm_scaling:
        if llm_scaling.min_replicas < 1:
            raise ValueError("the LLM pool autoscales from one replica at least")
        scalers["llms"] = Autoscaler(sim, llm_scaling, num_llms,
                                     lambda: sum(r.in_flight for r in llms if not r.draining),
                                     lambda: llms.append(new_llm()),
                                     lambda: setattr(least_loaded(), "draining", True), active)

    def encode_locally(request: Request, misses: tuple[int, ...]) -> None:
        llm = least_loaded()
        llm.encoding += 1

        def encoded() -> None:
            llm.encoding -= 1
            llm.add(request)

        item_done = countdown(len(misses), encoded)
        for tokens in misses:
            llm.encoder.submit(tokens, item_done)

    def arrive(request: Request) -> None:
        if profile.kv_tokens is not None and request.prompt_tokens + request.output_tokens > profile.kv_tokens:
            request.refused = True  # it could never run: the app refuses it too (400)
            return
        if profile.max_pending_requests is not None:
            pending.difference_update([i for i in pending if requests[i].first_token is not None])
            if len(pending) >= profile.max_pending_requests:
                request.refused = True
                if profile.refuse_s:
                    route(profile.refuse_s, lambda: None)
                return
            pending.add(request.index)
        misses = tuple(tokens for tokens in request.image_sizes if rng.random() >= workload.repeat_share)
        if not misses:
            route(profile.router_s, lambda: least_loaded().add(request))
        elif encoders is None:
            route(profile.router_s, lambda: encode_locally(request, misses))
        else:
            def encoded() -> None:  # every call back: ship the embeddings, then prefill
                sim.after(profile.transfer_seconds(sum(misses), transport), lambda: least_loaded().add(request))

            route(profile.router_s, lambda: encoders.submit(misses, encoded))

    if arrivals is None:
        arrivals, t = [], 0.0
        for _ in range(num_requests):
            t += rng.gammavariate(workload.burstiness, 1 / (workload.rate * workload.burstiness))
            arrivals.append((t, rng.randint(*workload.images)))
    for at, images in arrivals:
        sizes = workload.image_sizes(images, rng)
        request = Request(at, sizes, workload.length(workload.text_tokens, rng) + sum(sizes),
                           workload.length(workload.output_tokens, rng), index=len(requests))
        requests.append(request)
        sim.at(at, lambda request=request: arrive(request))
    sim.run()

    served = [r for r in requests if not r.refused]
    ttft = [r.first_token - r.arrival for r in served]
    tpot = [(r.finish - r.first_token) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0 for r in served]
    within = sum(1 for a, b in zip(ttft, tpot) if slo is None or (a <= slo.ttft_p99_s and b <= slo.tpot_p99_s))
    span = max((r.finish for r in served), default=requests[0].arrival) - requests[0].arrival
    elapsed = max(sim.now, 1e-12)  # every request refused: nothing ran

    def replicas(pool: str, fixed: int) -> tuple[float, int]:
        scaler = scalers.get(pool)
        return (scaler.mean_replicas(elapsed), scaler.peak) if scaler else (float(fixed), fixed)

    (mean_encoders, peak_encoders), (mean_llms, peak_llms) = replicas("encoders", num_encoders), replicas("llms", num_llms)
    return Result(
        num_encoders, num_llms, workload.rate, throughput=len(served) / span if served else 0.0,
        ttft_p50_s=percentile(ttft, 50), ttft_p99_s=percentile(ttft, 99), tpot_p99_s=percentile(tpot, 99),
        slo_attainment=within / len(requests), refused_share=1 - len(served) / len(requests),
        encoder_utilisation=encoders.busy_seconds / (mean_encoders * elapsed) if encoders else 0.0,
        llm_utilisation=sum(r.busy_seconds for r in llms) / (mean_llms * elapsed),
        preemptions=sum(r.preemptions for r in requests), mean_encoders=mean_encoders, mean_llms=mean_llms,
        peak_encoders=peak_encoders, peak_llms=peak_llms)
