"""`mmserve plan --validate`'s runs: the app, in this process, under `bench serve`'s load
(`collect`, injected into `mmserve.capacity.cli` by the `mmserve` command line).

Per mode (disaggregated: 1 encoder + 1 LLM replica; colocated: 2 LLM replicas), on the bench checkpoint
and this machine's CPUs: two fit runs (one at a time, `FIT_LOADED_CONCURRENCY` at a time), a flood
(`SATURATING_CONCURRENCY`), Poisson arrivals at `REFUSING_FACTOR` x its capacity, the held-out rates
(`RATE_FACTORS` x it), the middle one again on fresh requests, the flood again; what each is for:
docs/capacity.md#--validate. `mmserve.capacity.fit.validate` fits on the fit runs and simulates the rest.
"""

from __future__ import annotations

import asyncio
import time

from deployments.cli.bench_app import start_app, stop_app
from mmserve.capacity.fit import FIT_LOADED_CONCURRENCY, observed
from mmserve.loadgen.checkpoints import bench_checkpoint
from mmserve.loadgen.client import run_load
from mmserve.loadgen.dataset import DatasetConfig, ResolutionBucket, arrival_times, generate_requests

MODES = {"disaggregated": (1, 1), "colocated": (0, 2)}  # (encoder, LLM) replicas: two of them either way
SATURATING_CONCURRENCY = 12
REFUSING_FACTOR = 3.0  # x the flood's capacity, Poisson: most requests refused (429) at the admission bound
# requests per fit run (alone, loaded, flood, flood past admission): the profile's noise is the fit runs'
FIT_REQUESTS = {"fit-unloaded": 64, "fit-loaded": 96, "fit-saturated": 192, "fit-refused": 320}
RATE_FACTORS = (0.4, 0.8, 2.0)  # x the capacity the saturated fit run measured


def collect(num_prompts: int, seed: int = 0, num_cpus: float = 2.0) -> dict:
    """Runs the app in each mode (Ray + Serve here) and records every run's requests: a run set."""
    from deployments.config import AppArgs

    model = bench_checkpoint()
    # one resolution (a fixed token count per image), 1-2 images, no repeats: the workload the model is told
    dataset = DatasetConfig(buckets=(ResolutionBucket(224, 224, 1.0),), max_images=2, text_only_share=0.0,
                            repeat_share=0.0, input_len=24, output_len=16)
    fit_alone, fit_loaded, fit_flood, flood_after, fit_refused = (
        generate_requests(dataset, FIT_REQUESTS[label], seed + k)
        for label, k in (("fit-unloaded", 1), ("fit-loaded", 2), ("fit-saturated", 4), ("fit-saturated", 5),
                         ("fit-refused", 6)))
    held_out = [generate_requests(dataset, num_prompts, seed + 10 + k) for k in range(len(RATE_FACTORS))]
    twin = generate_requests(dataset, num_prompts, seed + 20)  # the repeat: as the middle rate's, other images
    # one Router replica: its admission bound is the app's (the model refuses past it, as the app does)
    pending = AppArgs.model_fields["max_pending_requests"].default
    run_set: dict = {"machine": f"{num_cpus:g} CPUs", "max_pending_requests": pending, "modes": {}}

    for mode, (encoders, llms) in MODES.items():
        url, _ = start_app(model, mode == "colocated", num_cpus, "float32", replicas=(max(encoders, 1), llms))
        runs = []

        def record(label: str, specs, name: str, rate=None, concurrency=None, seed_offset: int = 0) -> list[dict]:
            """One run's requests, sent `concurrency` at a time or at `rate` (Poisson, from `seed + seed_offset`)."""
            began = time.perf_counter()
            offsets = arrival_times(len(specs), rate, seed + seed_offset) if rate else [0.0] * len(specs)
            out = asyncio.run(run_load(url, "bench", specs, offsets, f"{mode} {name}", concurrency=concurrency))
            requests = [{**r.as_json(began), "images": len(spec.images)} for r, spec in zip(out, specs)]
            if label:
                runs.append({"label": label, "rate": rate, "concurrency": concurrency, "requests": requests})
            return requests

        try:
            record("", generate_requests(dataset, 8, seed + 3), "warm-up", concurrency=2)
            record("fit-unloaded", fit_alone, "fit 1", concurrency=1)
            record("fit-loaded", fit_loaded, f"fit {FIT_LOADED_CONCURRENCY}", concurrency=FIT_LOADED_CONCURRENCY)
            flood = record("fit-saturated", fit_flood, f"fit {SATURATING_CONCURRENCY}",
                           concurrency=SATURATING_CONCURRENCY)
            capacity = observed(flood)["throughput"]
            refusing = round(REFUSING_FACTOR * capacity, 3)
            record("fit-refused", fit_refused, f"fit @{refusing}/s", rate=refusing, seed_offset=7)
            rates = [round(k * capacity, 3) for k in RATE_FACTORS]
            for rate, specs in zip(rates, held_out):
                record("held-out", specs, f"@{rate}/s", rate=rate)
            record("repeat", twin, f"@{rates[1]}/s again", rate=rates[1])  # the middle rate
            record("fit-saturated-after", flood_after, f"fit {SATURATING_CONCURRENCY} again",
                   concurrency=SATURATING_CONCURRENCY)
        finally:
            stop_app()
        run_set["modes"][mode] = {"encoders": encoders, "llms": llms, "runs": runs}
    return run_set
