"""Serving benchmark: streaming HTTP load at a request rate, TTFT/TPOT/ITL/E2E and goodput.

    python bench/serve.py --url http://127.0.0.1:8000 --model-name tiny-qwen2_vl --request-rate 4
    python bench/serve.py --quick                        # starts its own app on a bench-sized checkpoint
    python bench/serve.py --compare colocated --quick    # disaggregated vs colocated, side by side
    python bench/serve.py --compare routing --quick      # affinity vs default routing, 2 + 2 replicas
    python bench/serve.py --compare ingress --quick      # Serve's ingress modes (bench/ingress.py)
    python bench/serve.py --video --quick                # video_url TTFT, streamed vs not (bench/serve_video.py)
    python bench/serve.py --quick --transport grpc       # the same requests as gRPC GenerateStream calls
    python bench/serve.py --compare colocated --device cuda --model DIR --dtype bfloat16  # one GPU, halves
    mmserve bench serve ...                              # the same

Requests are vLLM `random-mm`-shaped (mmserve/loadgen/dataset.py); metrics and JSON field names are
vLLM's `bench serve` ones (mmserve/loadgen/metrics.py). `--compare colocated` is fair by construction:
the same total --num-cpus in both modes (disaggregated: one encoder + one LLM replica with half
each; colocated: two LLM replicas with half each), so torch threads per replica (Ray sets
OMP_NUM_THREADS to a replica's num_cpus) are equal too, and SLOs come from an unloaded run of the
disaggregated app (printed); with `--device cuda` every replica also gets `--gpus-per-replica` of
the one GPU (0.5: encoder + LLM, or two colocated LLM replicas, share it). `--transport grpc`
sends the same requests as `mmserve.v1` GenerateStream calls (429 there is RESOURCE_EXHAUSTED).
Each rate sends its own requests (fresh images and prompts, the same in every mode), so no rate
measures another's cache hits. The summary takes each mode's best goodput over the rates and its
p99 TTFT at the lowest rate. The last line printed is one JSON object.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

from deployments.cli.bench_app import start_app, stop_app
from mmserve.loadgen.checkpoints import bench_checkpoint
from mmserve.loadgen.client import run_load, serve_bench_args
from mmserve.loadgen.dataset import (
    QUICK_BUCKETS, DatasetConfig, RequestSpec, arrival_times, generate_requests, synthesize_image,
)
from mmserve.loadgen.metrics import SLO, RequestRecord, compute_metrics, from_unloaded, plots, table


def vit_seconds(model: str, specs: list[RequestSpec], dtype: str, threads: int, device: str = "cpu") -> list[float]:
    """In-process ViT time (decode + preprocess + forward) of each request's images, one thread pool
    the size of a replica's."""
    import torch

    from encoder_service import VisionEncoder
    from mmserve.inputs.media import MediaItem, MediaKind

    torch.set_num_threads(max(1, threads))
    encoder = VisionEncoder(model, dtype=dtype, device=device)
    encoder.encode([MediaItem(MediaKind.IMAGE, (synthesize_image(i),)) for s in specs[:2] for i in s.images])  # warm-up
    out = []
    for spec in specs:
        items = [MediaItem(MediaKind.IMAGE, (synthesize_image(i),)) for i in spec.images]
        start = time.perf_counter()
        if items:
            encoder.encode(items)
        if device == "cuda":
            torch.cuda.synchronize()
        out.append(time.perf_counter() - start)
    del encoder
    if device == "cuda":
        torch.cuda.empty_cache()  # the app's replicas size their memory next
    return out


def _run_instead(script: str, argv: list[str]) -> None:
    """Runs bench/`script` in this process's place (one bench imports no other)."""
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, str(Path(__file__).resolve().parent / script), *argv])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = serve_bench_args(__doc__, argv)
    if args.compare == "ingress":
        _run_instead("ingress.py", ["--quick"] if args.quick else [])
    if args.video or args.compare == "routing":  # experiments of their own, with the same arguments
        _run_instead("serve_video.py" if args.video else "serve_routing.py", argv)
    began = time.perf_counter()
    num_prompts = args.num_prompts or (120 if args.quick else 200)
    dataset = DatasetConfig(buckets=QUICK_BUCKETS if args.quick else DatasetConfig().buckets, max_images=args.max_images,
                            text_only_share=args.text_only_share, repeat_share=args.repeat_share,
                            input_len=args.input_len, output_len=args.output_len)
    unloaded_specs = generate_requests(dataset, args.unloaded_requests, args.seed + 1)
    warm_specs = generate_requests(dataset, 8, args.seed + 2)  # other images: the unloaded run misses the cache
    modes = ["disaggregated", "colocated"] if args.compare else ["colocated" if args.colocated else "disaggregated"]
    model = None if args.url or args.grpc_target else args.model or bench_checkpoint()
    slo = SLO.parse(args.goodput)
    rates = args.request_rate
    runs: dict[str, list[tuple[float, dict, list[RequestRecord]]]] = {}
    summary: dict = {}
    for mode in modes:
        if args.url or args.grpc_target:
            url, grpc_target = args.url, args.grpc_target
        else:
            url, grpc_target = start_app(model, mode == "colocated", args.num_cpus, args.dtype, args.device,
                                         args.gpus_per_replica if args.device == "cuda" else 0.0,
                                         cpu_threads=args.cpu_threads)
            print(f"{mode} app up ({time.perf_counter() - began:.0f} s)")
        target = grpc_target if args.transport == "grpc" else url
        try:
            asyncio.run(run_load(target, args.model_name, warm_specs, [0.0] * len(warm_specs), "warm-up", concurrency=2,
                                 transport=args.transport))
            if mode == modes[0]:
                unloaded = asyncio.run(run_load(target, args.model_name, unloaded_specs, [0.0] * len(unloaded_specs),
                                                "unloaded", concurrency=1, transport=args.transport))
                base = compute_metrics(unloaded)
                print(f"unloaded ({len(unloaded)} requests one at a time): median TTFT {base['median_ttft_ms']:.1f} ms, "
                      f"median TPOT {base['median_tpot_ms']:.1f} ms, mean E2E {base['mean_e2el_ms']:.1f} ms")
                # rates below and above one request at a time
                slo, rates = from_unloaded(base, args.goodput and slo, rates, (0.75, 1.5))
            for k, rate in enumerate(rates):
                # each rate gets its own requests (the same in every mode): a rate that replayed an earlier
                # rate's images and prompts would measure the encoder and prefix caches, not the load
                specs = generate_requests(dataset, num_prompts, args.seed + 10 + k)
                offsets = arrival_times(len(specs), rate, args.seed, args.burstiness)
                records = asyncio.run(run_load(target, args.model_name, specs, offsets, f"{mode} @{rate}/s",
                                               transport=args.transport))
                runs.setdefault(mode, []).append((rate, compute_metrics(records, slo), records))
        finally:
            if not (args.url or args.grpc_target):
                stop_app()
    if model:
        # the ViT's share of each unloaded image request, median over them (one request slowed by a
        # noisy neighbour would swing a ratio of sums); timed in this process once the apps are down,
        # so that the apps' replicas have the device to themselves
        vit = vit_seconds(model, unloaded_specs, args.dtype, int(args.num_cpus / 2), args.device)
        shares = [v / r.e2el for r, s, v in zip(unloaded, unloaded_specs, vit) if s.images and r.ok]
        summary["vit_share"] = statistics.median(shares) if shares else None
        print(f"vit_share {summary['vit_share'] if summary['vit_share'] is None else round(summary['vit_share'], 3)}")
    results = {f"{mode}@{rate:g}": metrics for mode, points in runs.items() for rate, metrics, _ in points}
    print(table(results))
    for path in plots(runs, args.plot_dir):
        print(f"plot: {path}")
    # goodput: the best over the swept rates (what the peers publish: the most QPS within the SLOs);
    # p99 TTFT: at the lowest rate, the same load in every mode
    for mode in modes:
        short = "disagg" if mode == "disaggregated" else "colocated"
        best = max(runs[mode], key=lambda point: point[1]["request_goodput"])
        summary[f"{short}_goodput_rps"] = round(best[1]["request_goodput"], 4)
        summary[f"{short}_goodput_at_rate"] = best[0]
        summary[f"{short}_p99_ttft_ms"] = round(runs[mode][0][1]["p99_ttft_ms"], 1)
        summary[f"{short}_request_throughput"] = round(max(p[1]["request_throughput"] for p in runs[mode]), 4)
    summary["p99_ttft_at_rate"] = rates[0]
    if args.compare:
        c, d = summary["colocated_goodput_rps"], summary["disagg_goodput_rps"]
        summary["goodput_ratio_disagg_over_colocated"] = round(d / c, 3) if c else None
        summary["p99_ttft_ratio_colocated_over_disagg"] = round(
            summary["colocated_p99_ttft_ms"] / summary["disagg_p99_ttft_ms"], 3) if summary["disagg_p99_ttft_ms"] else None
        print(f"disaggregated / colocated goodput (best over the rates): {summary['goodput_ratio_disagg_over_colocated']}; "
              f"colocated / disaggregated p99 TTFT at {rates[0]}/s: {summary['p99_ttft_ratio_colocated_over_disagg']}")
    summary.update(slo={k: v for k, v in slo.as_dict().items()}, request_rates=rates, num_prompts=num_prompts,
                   transport=args.transport, device=args.device,
                   num_cpus=args.num_cpus, seconds=round(time.perf_counter() - began, 1))
    if args.result_json:
        # each request: its times as the client saw them, and the server's stage times (HTTP)
        requests = {f"{mode}@{rate:g}": [r.as_json(began) for r in records]
                    for mode, points in runs.items() for rate, _, records in points}
        args.result_json.write_text(json.dumps({"summary": summary, "results": results, "requests": requests},
                                               indent=2))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
