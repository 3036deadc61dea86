"""`mmserve plan --validate` (= `python bench/plan_validate.py`): the capacity planner against real runs.

For each mode (disaggregated: 1 encoder + 1 LLM replica; colocated: 2 LLM replicas), on the bench
checkpoint and this machine's CPUs, it runs `bench serve`'s load:
- two fit runs: one request at a time, then `FIT_LOADED_CONCURRENCY` at a time;
- a flood, `SATURATING_CONCURRENCY` at a time: its throughput (the app's capacity on this box)
  places the held-out rates, and the model's shared capacity is fitted on it;
- Poisson arrivals at `REFUSING_FACTOR` x that capacity, most refused at the admission bound:
  what a 429 costs the box;
- three held-out Poisson rates (`RATE_FACTORS` x that capacity), the last past saturation;
- the middle held-out rate once more, with fresh requests of the same shape and the same arrival
  times (the noise floor; the same requests again would hit the embedding and prefix caches);
- the flood once more, with fresh requests (`capacity_drift`: how far the box's own speed moved
  across the held-out runs; the fitted capacity is the mean of the two floods').
`mmserve.capacity.fit.validate` fits a profile on the fit runs only, simulates the held-out rates and
reports the relative errors. The last line is one JSON object with `max_rel_error`,
`max_rel_error_p99_ttft`, `saturated_point_rel_error`, `real_run_spread` and `capacity_drift`.
`--record FILE` keeps the run set; `--runs FILE` validates a kept one (seconds, no Ray).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mmserve.capacity.fit import FIT_LOADED_CONCURRENCY, observed, print_validation, validate  # noqa: E402

MODES = {"disaggregated": (1, 1), "colocated": (0, 2)}  # (encoder, LLM) replicas: two of them either way
SATURATING_CONCURRENCY = 12
REFUSING_FACTOR = 3.0  # x the flood's capacity, Poisson: most requests refused (429) at the admission bound
# requests per fit run (alone, loaded, flood, flood past admission): the profile's noise is the fit runs'
FIT_REQUESTS = {"fit-unloaded": 64, "fit-loaded": 96, "fit-saturated": 192, "fit-refused": 320}
RATE_FACTORS = (0.4, 0.8, 2.0)  # x the capacity the saturated fit run measured


def collect(num_prompts: int, seed: int = 0, num_cpus: float = 2.0) -> dict:
    from bench.serve import bench_checkpoint, run_load, start_app, stop_app
    from mmserve.loadgen.dataset import DatasetConfig, ResolutionBucket, arrival_times, generate_requests

    model = bench_checkpoint(Path(tempfile.gettempdir()) / "mmserve-bench-serve-qwen2_vl-v1")
    # one resolution (a fixed token count per image), 1-2 images, no repeats: the workload the model is told
    dataset = DatasetConfig(buckets=(ResolutionBucket(224, 224, 1.0),), max_images=2, text_only_share=0.0,
                            repeat_share=0.0, input_len=24, output_len=16)
    fit_alone, fit_loaded, fit_flood, flood_after, fit_refused = (
        generate_requests(dataset, FIT_REQUESTS[label], seed + k)
        for label, k in (("fit-unloaded", 1), ("fit-loaded", 2), ("fit-saturated", 4), ("fit-saturated", 5),
                         ("fit-refused", 6)))
    held_out = [generate_requests(dataset, num_prompts, seed + 10 + k) for k in range(len(RATE_FACTORS))]
    twin = generate_requests(dataset, num_prompts, seed + 20)  # the repeat: as the middle rate's, other images
    from deployments.config import AppArgs

    # one Router replica: its admission bound is the app's (the model refuses past it, as the app does)
    pending = AppArgs.model_fields["max_pending_requests"].default
    run_set: dict = {"machine": f"{num_cpus:g} CPUs", "max_pending_requests": pending, "modes": {}}

    def records(specs, label: str, url: str, **load) -> list[dict]:
        began = time.perf_counter()
        out = asyncio.run(run_load(url, "bench", specs, load.pop("offsets", [0.0] * len(specs)), label, **load))
        return [{**r.as_json(began), "images": len(spec.images)} for r, spec in zip(out, specs)]

    for mode, (encoders, llms) in MODES.items():
        url, _ = start_app(model, mode == "colocated", num_cpus, "float32", replicas=(max(encoders, 1), llms))
        try:
            records(generate_requests(dataset, 8, seed + 3), "warm-up", url, concurrency=2)
            runs = [{"label": "fit-unloaded", "rate": None, "concurrency": 1,
                     "requests": records(fit_alone, f"{mode} fit 1", url, concurrency=1)},
                    {"label": "fit-loaded", "rate": None, "concurrency": FIT_LOADED_CONCURRENCY,
                     "requests": records(fit_loaded, f"{mode} fit {FIT_LOADED_CONCURRENCY}", url,
                                         concurrency=FIT_LOADED_CONCURRENCY)}]
            runs.append({"label": "fit-saturated", "rate": None, "concurrency": SATURATING_CONCURRENCY,
                         "requests": records(fit_flood, f"{mode} fit {SATURATING_CONCURRENCY}", url,
                                             concurrency=SATURATING_CONCURRENCY)})
            capacity = observed(runs[-1]["requests"])["throughput"]
            refusing = round(REFUSING_FACTOR * capacity, 3)
            runs.append({"label": "fit-refused", "rate": refusing, "concurrency": None,
                         "requests": records(fit_refused, f"{mode} fit @{refusing}/s", url,
                                             offsets=arrival_times(len(fit_refused), refusing, seed + 7))})
            rates = [round(k * capacity, 3) for k in RATE_FACTORS]
            for rate, specs in zip(rates, held_out):
                offsets = arrival_times(len(specs), rate, seed)
                runs.append({"label": "held-out", "rate": rate, "concurrency": None,
                             "requests": records(specs, f"{mode} @{rate}/s", url, offsets=offsets)})
            middle = 1
            runs.append({"label": "repeat", "rate": rates[middle], "concurrency": None,
                         "requests": records(twin, f"{mode} @{rates[middle]}/s again", url,
                                             offsets=arrival_times(len(twin), rates[middle], seed))})
            runs.append({"label": "fit-saturated-after", "rate": None, "concurrency": SATURATING_CONCURRENCY,
                         "requests": records(flood_after, f"{mode} fit {SATURATING_CONCURRENCY} again", url,
                                             concurrency=SATURATING_CONCURRENCY)})
        finally:
            stop_app()
        run_set["modes"][mode] = {"encoders": encoders, "llms": llms, "runs": runs}
    return run_set


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=Path, help="validate this kept run set instead of running the app")
    p.add_argument("--record", type=Path, help="keep the run set here (JSON)")
    p.add_argument("--num-prompts", type=int, default=None, help="requests per held-out rate (default 200; --quick 60)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    ns = p.parse_args(argv)
    began = time.perf_counter()
    if ns.runs:
        run_set = json.loads(ns.runs.read_text())
    else:
        run_set = collect(ns.num_prompts or (60 if ns.quick else 200), ns.seed)
        if ns.record:
            ns.record.write_text(json.dumps(run_set))
    report = validate(run_set)
    print_validation(report)
    for mode, profile in report["profiles"].items():
        print(f"fitted {mode}: " + ", ".join(f"{k} {v:.3g}" for k, v in profile.items() if isinstance(v, float)))
    summary = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in report.items()
               if k not in ("rows", "profiles")}
    summary["seconds"] = round(time.perf_counter() - began, 1)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
