"""Serving benchmark: streaming HTTP load at a request rate, TTFT/TPOT/ITL/E2E and goodput.

    python bench/serve.py --url http://127.0.0.1:8000 --model-name tiny-qwen2_vl --request-rate 4
    python bench/serve.py --quick                        # starts its own app on a bench-sized checkpoint
    python bench/serve.py --compare colocated --quick    # disaggregated vs colocated, side by side
    mmserve bench serve ...                              # the same

Requests are vLLM `random-mm`-shaped (bench/serve_dataset.py); metrics and JSON field names are
vLLM's `bench serve` ones (bench/serve_metrics.py). `--compare colocated` is fair by construction:
the same total --num-cpus in both modes (disaggregated: one encoder + one LLM replica with half
each; colocated: two LLM replicas with half each), so torch threads per replica (Ray sets
OMP_NUM_THREADS to a replica's num_cpus) are equal too, and SLOs come from an unloaded run of the
disaggregated app (printed). HTTP only: gRPC load is not implemented yet. The last line printed
is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.serve_dataset import (  # noqa: E402
    DatasetConfig, RequestSpec, ResolutionBucket, arrival_times, generate_requests, prompt_text, synthesize_image,
)
from bench.serve_metrics import SLO, RequestRecord, compute_metrics  # noqa: E402

QUICK_BUCKETS = (ResolutionBucket(112, 112, 0.3), ResolutionBucket(224, 224, 0.5), ResolutionBucket(336, 336, 0.2))


# -- the load -----------------------------------------------------------------------------------
def request_body(spec: RequestSpec, model_name: str, images: dict[int, str]) -> dict:
    content = [{"type": "image_url", "image_url": {"url": images[i.seed]}} for i in spec.images]
    content.append({"type": "text", "text": prompt_text(spec)})
    return {"model": model_name, "messages": [{"role": "user", "content": content}], "max_tokens": spec.max_tokens,
            "ignore_eos": True, "temperature": 0, "stream": True, "return_token_ids": True}


async def one_request(client, url: str, body: dict, send_at: float) -> RequestRecord:
    await asyncio.sleep(max(0.0, send_at - time.perf_counter()))
    sent = time.perf_counter()
    times: list[float] = []
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return RequestRecord(sent, time.perf_counter(), False, str(response.status_code))
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return RequestRecord(sent, time.perf_counter(), False, "stream_error", tuple(times))
                now = time.perf_counter()
                for choice in chunk.get("choices", []):
                    times.extend([now] * len(choice.get("token_ids") or []))
    except Exception as e:  # noqa: BLE001 - a failed request is a data point, not a crash
        return RequestRecord(sent, time.perf_counter(), False, type(e).__name__, tuple(times))
    return RequestRecord(sent, time.perf_counter(), bool(times), "200", tuple(times))


async def run_load(base_url: str, model_name: str, specs: list[RequestSpec], offsets: list[float],
                   label: str = "", concurrency: int | None = None) -> list[RequestRecord]:
    """Sends `specs` at `offsets` (or, with `concurrency`, that many at a time) and records each."""
    import httpx
    from tqdm import tqdm

    images = {i.seed: None for s in specs for i in s.images}
    for seed, spec in {i.seed: i for s in specs for i in s.images}.items():
        images[seed] = "data:image/png;base64," + base64.b64encode(synthesize_image(spec)).decode()
    url = base_url.rstrip("/") + "/v1/chat/completions"
    bar = tqdm(total=len(specs), desc=label or "requests", file=sys.stderr, leave=False)
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        gate = asyncio.Semaphore(concurrency) if concurrency else None

        async def tracked(spec: RequestSpec, offset: float) -> RequestRecord:
            if gate:
                async with gate:
                    record = await one_request(client, url, request_body(spec, model_name, images), 0.0)
            else:
                record = await one_request(client, url, request_body(spec, model_name, images), start + offset)
            bar.update(1)
            return record

        start = time.perf_counter()
        records = await asyncio.gather(*(tracked(s, o) for s, o in zip(specs, offsets)))
    bar.close()
    return list(records)


# -- the app under test -------------------------------------------------------------------------
def bench_checkpoint(out: Path) -> str:
    """A random Qwen2-VL (float32) whose ViT is big enough to matter: embed 256, depth 6, ≤336² images."""
    import torch
    from transformers import AutoModelForImageTextToText, GenerationConfig, Qwen2VLImageProcessor, Qwen2VLProcessor

    from mmserve import tiny

    if (out / "mmserve_tiny.json").exists():
        return str(out)
    tokenizer = tiny._build_tokenizer(0, vocab_size=1024)
    config = tiny._configs("qwen2_vl", tokenizer)
    for key, value in dict(depth=6, embed_dim=256, num_heads=4, mlp_ratio=4).items():
        setattr(config.vision_config, key, value)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()
    model.generation_config = GenerationConfig(eos_token_id=[config.text_config.eos_token_id],
                                               pad_token_id=config.text_config.pad_token_id, do_sample=False)
    from transformers import Qwen2VLVideoProcessor

    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(min_pixels=tiny.MIN_PIXELS, max_pixels=336 * 336),
        tokenizer=tokenizer, chat_template=tiny.CHAT_TEMPLATE,
        video_processor=Qwen2VLVideoProcessor(min_pixels=tiny.VIDEO_MIN_PIXELS, max_pixels=tiny.VIDEO_MAX_PIXELS,
                                              cap_pixels_per_frame=False),
    )
    model.save_pretrained(out, safe_serialization=True)
    processor.save_pretrained(out)
    (out / "mmserve_tiny.json").write_text(json.dumps({"family": "qwen2_vl", "seed": 0, "bench": True}) + "\n")
    return str(out)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_app(model: str, colocated: bool, num_cpus: float, dtype: str) -> str:
    """Starts Ray + Serve + the app in this process; returns its base URL (stop with `stop_app`)."""
    import ray
    from ray import serve

    from deployments.app import build_app
    from deployments.config import AppArgs

    half = num_cpus / 2
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    big = {"max_ongoing_requests": 256, "max_queued_requests": -1}
    args = AppArgs(
        model=model, served_model_name="bench", dtype=dtype, device="cpu", colocated=colocated, router={"num_cpus": 0, **big},
        encoder={"num_cpus": half, **big}, llm={"num_cpus": half, "num_replicas": 2 if colocated else 1, **big},
    )
    serve.run(build_app(args), name="bench", route_prefix="/")
    return f"http://127.0.0.1:{port}"


def stop_app() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


def vit_seconds(model: str, specs: list[RequestSpec], dtype: str, threads: int) -> list[float]:
    """In-process ViT time (decode + preprocess + forward) of each request's images, one thread pool
    the size of a replica's."""
    import torch

    from encoder_service import VisionEncoder
    from mmserve.media import MediaItem, MediaKind

    torch.set_num_threads(max(1, threads))
    encoder = VisionEncoder(model, dtype=dtype, device="cpu")
    encoder.encode([MediaItem(MediaKind.IMAGE, (synthesize_image(i),)) for s in specs[:2] for i in s.images])  # warm-up
    out = []
    for spec in specs:
        items = [MediaItem(MediaKind.IMAGE, (synthesize_image(i),)) for i in spec.images]
        start = time.perf_counter()
        if items:
            encoder.encode(items)
        out.append(time.perf_counter() - start)
    return out


# -- reporting ----------------------------------------------------------------------------------
ROWS = (
    ("completed", "completed", "{:.0f}"), ("failed (429 {rejected_429})", "failed", "{:.0f}"),
    ("request throughput (req/s)", "request_throughput", "{:.3f}"), ("goodput (req/s)", "request_goodput", "{:.3f}"),
    ("output throughput (tok/s)", "output_throughput", "{:.1f}"),
    ("mean TTFT (ms)", "mean_ttft_ms", "{:.1f}"), ("median TTFT (ms)", "median_ttft_ms", "{:.1f}"),
    ("p99 TTFT (ms)", "p99_ttft_ms", "{:.1f}"), ("mean TPOT (ms)", "mean_tpot_ms", "{:.1f}"),
    ("p99 TPOT (ms)", "p99_tpot_ms", "{:.1f}"), ("mean ITL (ms)", "mean_itl_ms", "{:.1f}"),
    ("p99 ITL (ms)", "p99_itl_ms", "{:.1f}"), ("mean E2E (ms)", "mean_e2el_ms", "{:.1f}"),
    ("p99 E2E (ms)", "p99_e2el_ms", "{:.1f}"),
)


def table(results: dict[str, dict]) -> str:
    names = list(results)
    lines = [f"{'':30}" + "".join(f"{n:>24}" for n in names)]
    for label, key, fmt in ROWS:
        label = label.format(rejected_429="/".join(str(results[n]["rejected_429"]) for n in names))
        lines.append(f"{label:30}" + "".join(f"{fmt.format(results[n][key]):>24}" for n in names))
    return "\n".join(lines)


def plots(runs: dict[str, list[tuple[float, dict, list[RequestRecord]]]], out_dir: Path) -> list[str]:
    """Latency CDFs (TTFT, E2E) per run and goodput vs rate per mode; [] when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots (pip install 'mmserve[bench]')", file=sys.stderr)
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for mode, points in runs.items():
        for rate, _, records in points:
            done = [r for r in records if r.ok and r.output_tokens]
            for ax, values in ((axes[0], [r.ttft * 1000 for r in done]), (axes[1], [r.e2el * 1000 for r in done])):
                values = sorted(values)
                ax.step(values, [(i + 1) / len(values) for i in range(len(values))], label=f"{mode} @{rate:.2f}/s")
        axes[2].plot([p[0] for p in points], [p[1]["request_goodput"] for p in points], marker="o", label=mode)
    for ax, title in zip(axes, ("TTFT CDF (ms)", "E2E latency CDF (ms)", "goodput (req/s) vs request rate")):
        ax.set_title(title)
        ax.legend()
    path = out_dir / "serve_bench.png"
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return [str(path)]


# -- main -------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="an mmserve app already running (default: start one here)")
    p.add_argument("--model-name", default="bench", help="served model name at --url")
    p.add_argument("--model", help="checkpoint for the app started here (default: the bench checkpoint)")
    p.add_argument("--quick", action="store_true", help="bench checkpoint, 120 requests, images 112²..336²")
    p.add_argument("--compare", choices=("colocated",), help="run disaggregated, then colocated, side by side")
    p.add_argument("--colocated", action="store_true", help="start the app here in colocated mode")
    p.add_argument("--num-cpus", type=float, default=2.0, help="total CPUs of the app started here")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--request-rate", type=float, nargs="+", default=None,
                   help="requests/s (several: a sweep; the summary is the last); default: 0.75 and 1.5 / the "
                   "unloaded mean E2E")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1: Poisson")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-images", type=int, default=2)
    p.add_argument("--text-only-share", type=float, default=0.2)
    p.add_argument("--repeat-share", type=float, default=0.1)
    p.add_argument("--input-len", type=int, default=24)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--goodput", nargs="+", default=None, help="SLOs, e.g. ttft:500 tpot:50 (default: from an unloaded run)")
    p.add_argument("--unloaded-requests", type=int, default=8)
    p.add_argument("--result-json", type=Path, default=None)
    p.add_argument("--plot-dir", type=Path, default=Path("bench_results"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    began = time.perf_counter()
    num_prompts = args.num_prompts or (120 if args.quick else 200)
    dataset = DatasetConfig(buckets=QUICK_BUCKETS if args.quick else DatasetConfig().buckets, max_images=args.max_images,
                            text_only_share=args.text_only_share, repeat_share=args.repeat_share,
                            input_len=args.input_len, output_len=args.output_len)
    specs = generate_requests(dataset, num_prompts, args.seed)
    unloaded_specs = generate_requests(dataset, args.unloaded_requests, args.seed + 1)
    warm_specs = generate_requests(dataset, 8, args.seed + 2)  # other images: the unloaded run misses the cache
    modes = ["disaggregated", "colocated"] if args.compare else ["colocated" if args.colocated else "disaggregated"]
    model = None
    vit: list[float] = []
    if not args.url:
        import tempfile

        model = args.model or bench_checkpoint(Path(tempfile.gettempdir()) / "mmserve-bench-serve-qwen2_vl-v1")
        vit = vit_seconds(model, unloaded_specs, args.dtype, int(args.num_cpus / 2))
    slo = SLO.parse(args.goodput)
    rates = args.request_rate
    runs: dict[str, list[tuple[float, dict, list[RequestRecord]]]] = {}
    summary: dict = {}
    for mode in modes:
        url = args.url or start_app(model, mode == "colocated", args.num_cpus, args.dtype)
        try:
            asyncio.run(run_load(url, args.model_name, warm_specs, [0.0] * len(warm_specs), "warm-up", concurrency=2))
            if mode == modes[0]:
                unloaded = asyncio.run(run_load(url, args.model_name, unloaded_specs, [0.0] * len(unloaded_specs),
                                                "unloaded", concurrency=1))
                base = compute_metrics(unloaded)
                image_e2e = [r.e2el for r, s in zip(unloaded, unloaded_specs) if s.images and r.ok]
                image_vit = [v for v, s in zip(vit, unloaded_specs) if s.images]
                summary["vit_share"] = (sum(image_vit) / sum(image_e2e)) if vit and image_e2e else None
                if args.goodput is None:
                    slo = SLO(ttft_ms=round(3 * base["median_ttft_ms"], 1), tpot_ms=round(3 * base["median_tpot_ms"], 1))
                if rates is None:  # below and above one request at a time; the summary is the last
                    rates = [round(k * 1000 / base["mean_e2el_ms"], 3) for k in (0.75, 1.5)]
                print(f"unloaded ({len(unloaded)} requests one at a time): median TTFT {base['median_ttft_ms']:.1f} ms, "
                      f"median TPOT {base['median_tpot_ms']:.1f} ms, mean E2E {base['mean_e2el_ms']:.1f} ms; "
                      f"vit_share {summary['vit_share'] if summary['vit_share'] is None else round(summary['vit_share'], 3)}")
                print(f"SLOs: {' '.join(f'{k}:{v:g}ms' for k, v in slo.as_dict().items())}; request rates {rates}/s")
            for rate in rates:
                offsets = arrival_times(len(specs), rate, args.seed, args.burstiness)
                records = asyncio.run(run_load(url, args.model_name, specs, offsets, f"{mode} @{rate}/s"))
                runs.setdefault(mode, []).append((rate, compute_metrics(records, slo), records))
        finally:
            if not args.url:
                stop_app()
    results = {f"{mode}@{rate:g}": metrics for mode, points in runs.items() for rate, metrics, _ in points}
    print(table(results))
    for path in plots(runs, args.plot_dir):
        print(f"plot: {path}")
    for mode in modes:
        short = "disagg" if mode == "disaggregated" else "colocated"
        last = runs[mode][-1][1]
        summary[f"{short}_goodput_rps"] = round(last["request_goodput"], 4)
        summary[f"{short}_p99_ttft_ms"] = round(last["p99_ttft_ms"], 1)
        summary[f"{short}_request_throughput"] = round(last["request_throughput"], 4)
    if args.compare:
        c, d = summary["colocated_goodput_rps"], summary["disagg_goodput_rps"]
        summary["goodput_ratio_disagg_over_colocated"] = round(d / c, 3) if c else None
        summary["p99_ttft_ratio_colocated_over_disagg"] = round(
            summary["colocated_p99_ttft_ms"] / summary["disagg_p99_ttft_ms"], 3) if summary["disagg_p99_ttft_ms"] else None
        print(f"disaggregated / colocated goodput: {summary['goodput_ratio_disagg_over_colocated']}; "
              f"colocated / disaggregated p99 TTFT: {summary['p99_ttft_ratio_colocated_over_disagg']}")
    summary.update(slo={k: v for k, v in slo.as_dict().items()}, request_rates=rates, num_prompts=num_prompts,
                   num_cpus=args.num_cpus, seconds=round(time.perf_counter() - began, 1))
    if args.result_json:
        args.result_json.write_text(json.dumps({"summary": summary, "results": results}, indent=2))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
