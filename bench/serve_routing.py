"""`python bench/serve.py --compare routing [--quick]` (it runs this script with its arguments):
affinity routing against Serve's default routing, on 2 encoder + 2 LLM replicas, the same requests
on the same CPUs, in one run.

Workload A: 30% of the images are one of 20 popular images, half the requests open with one of 5
system prompts; two rates below saturation and one above. Workload B: 90% of the images are one
hot image (the llm-d failure case, which the load bound must prevent). SLOs and rates come from an
unloaded run of the default app on workload A. Cluster-wide embedding hits (cache + in-flight
dedupe, summed over the encoder replicas) are set against the single-replica ideal: every image
item but the first sight of each distinct image. Each rate runs `REPEATS` times, on fresh request
sets, the rates interleaved; every figure of a rate is the median over its repeats (one run of 80
requests past saturation moved goodput by 25% between two runs of the same policy). The last line
is one JSON object with `hit_ratio_vs_ideal`, `ttft_p50_ratio_default_over_affinity` (moderate
rate, A), `goodput_ratio_min` (affinity over default, the lowest over A's rates) and
`hot_key_goodput_ratio` (B, the lowest over its rates).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time

from deployments.cli.bench_app import start_app, stop_app
from mmserve.loadgen.checkpoints import bench_checkpoint
from mmserve.loadgen.client import run_load, serve_bench_args
from mmserve.loadgen.dataset import QUICK_BUCKETS, DatasetConfig, RequestSpec, arrival_times, generate_requests
from mmserve.loadgen.metrics import SLO, compute_metrics, from_unloaded, table

WORKLOADS = {
    "A": dict(image_pool=20, repeat_share=0.3, system_prompts=5, system_share=0.5),
    "B": dict(image_pool=1, repeat_share=0.9),
}
POLICIES = ("default", "affinity")  # default first: its unloaded run sets the SLOs and rates
RATE_FACTORS = (0.5, 1.0, 2.5)  # x one request at a time: two below saturation, one above
REPLICAS = (2, 2)
REPEATS = 3


def median_metrics(runs: list[dict]) -> dict:
    """Each numeric figure's median over `runs` (the first run's for the rest)."""
    return {k: statistics.median(r[k] for r in runs) if isinstance(v, (int, float)) else v for k, v in runs[0].items()}


def ideal_hits(specs: list[RequestSpec]) -> tuple[int, int]:
    """(image items, items a single replica with an unbounded cache would not encode again)."""
    seeds = [image.seed for spec in specs for image in spec.images]
    return len(seeds), len(seeds) - len(set(seeds))


def cluster_hits() -> int:
    from ray import serve

    from deployments.serve.encoder import encoder_stats

    stats = encoder_stats(serve.get_deployment_handle("Encoder", app_name="bench"), REPLICAS[0])
    return sum(s["cache_hits"] + s["dedup_hits"] for s in stats.values())


def run(args) -> dict:
    from ray import serve

    model = args.model or bench_checkpoint()
    began = time.perf_counter()
    num_prompts = args.num_prompts or (80 if args.quick else 200)
    slo, rates = SLO.parse(args.goodput), args.request_rate
    results, runs = {}, {}
    for workload, knobs in WORKLOADS.items():
        dataset = DatasetConfig(buckets=QUICK_BUCKETS, max_images=args.max_images, text_only_share=args.text_only_share,
                                input_len=args.input_len, output_len=args.output_len, **knobs)
        warm = generate_requests(dataset, 8, args.seed + 2)
        per_rate = [[generate_requests(dataset, num_prompts, args.seed + 10 + k + 100 * r) for r in range(REPEATS)]
                    for k in range(len(RATE_FACTORS))]
        for policy in POLICIES:
            url, _ = start_app(model, False, args.num_cpus, args.dtype, replicas=REPLICAS, routing=policy)
            seen = list(warm)
            try:
                asyncio.run(run_load(url, args.model_name, warm, [0.0] * len(warm), "warm-up", concurrency=2))
                if rates is None:
                    unloaded = generate_requests(dataset, args.unloaded_requests, args.seed + 1)
                    seen += unloaded
                    base = compute_metrics(asyncio.run(run_load(url, args.model_name, unloaded, [0.0] * len(unloaded),
                                                                "unloaded", concurrency=1)))
                    slo, rates = from_unloaded(base, args.goodput and slo, None, RATE_FACTORS)
                repeats: dict[float, list[dict]] = {rate: [] for rate in rates}
                for r in range(REPEATS):  # rates interleaved, so slow drift hits every rate alike
                    for rate, sets in zip(rates, per_rate):
                        specs = sets[r]
                        offsets = arrival_times(len(specs), rate, args.seed + r, args.burstiness)
                        records = asyncio.run(run_load(url, args.model_name, specs, offsets,
                                                       f"{workload} {policy} @{rate}/s ({r + 1}/{REPEATS})"))
                        repeats[rate].append(compute_metrics(records, slo))
                        seen += specs
                for rate in rates:
                    results[f"{workload}:{policy}@{rate:g}"] = median_metrics(repeats[rate])
                items, ideal = ideal_hits(seen)
                routed = serve.get_deployment_handle("Router", app_name="bench").routing_stats.remote().result()
                runs[(workload, policy)] = {"hits": cluster_hits(), "ideal_hits": ideal, "items": items, "routed": routed}
            finally:
                stop_app()
    print(table(results))
    summary = _summary(results, runs, rates)
    summary.update(slo=slo.as_dict(), request_rates=rates, num_prompts=num_prompts, repeats=REPEATS,
                   num_cpus=args.num_cpus, seconds=round(time.perf_counter() - began, 1))
    if args.result_json:
        args.result_json.write_text(json.dumps({"summary": summary, "results": results}, indent=2))
    print(json.dumps(summary))
    return summary


def _summary(results: dict, runs: dict, rates: list[float]) -> dict:
    def metric(workload: str, policy: str, rate: float, key: str) -> float:
        return results[f"{workload}:{policy}@{rate:g}"][key]

    def ratio(a: float, b: float) -> float | None:
        return round(a / b, 3) if b else None

    summary = {}
    for (workload, policy), run in runs.items():
        summary[f"{workload}_{policy}_hit_ratio_vs_ideal"] = ratio(run["hits"], run["ideal_hits"])
        print(f"workload {workload}, {policy}: {run['hits']} embedding hits of {run['items']} image items "
              f"(single-replica ideal {run['ideal_hits']}); routed {run['routed']}")
    moderate = rates[1]
    summary["hit_ratio_vs_ideal"] = summary["A_affinity_hit_ratio_vs_ideal"]
    summary["ttft_p50_ratio_default_over_affinity"] = ratio(metric("A", "default", moderate, "median_ttft_ms"),
                                                            metric("A", "affinity", moderate, "median_ttft_ms"))
    goodput = {w: [ratio(metric(w, "affinity", r, "request_goodput"), metric(w, "default", r, "request_goodput"))
                   for r in rates] for w in WORKLOADS}
    summary["goodput_ratio_min"] = min((g for g in goodput["A"] if g is not None), default=None)
    summary["hot_key_goodput_ratio"] = min((g for g in goodput["B"] if g is not None), default=None)
    summary["goodput_ratios"] = goodput
    return summary


if __name__ == "__main__":
    run(serve_bench_args(__doc__, None))
