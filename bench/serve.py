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

import argparse
import asyncio
import base64
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mmserve.loadgen.dataset import (  # noqa: E402
    DatasetConfig, RequestSpec, ResolutionBucket, arrival_times, generate_requests, prompt_text, synthesize_image,
    system_text,
)
from mmserve.loadgen.metrics import SLO, RequestRecord, compute_metrics  # noqa: E402
from deployments.cli.ingress_modes import free_loopback_port  # noqa: E402

QUICK_BUCKETS = (ResolutionBucket(112, 112, 0.3), ResolutionBucket(224, 224, 0.5), ResolutionBucket(336, 336, 0.2))


# -- the load -----------------------------------------------------------------------------------
def request_body(spec: RequestSpec, model_name: str, images: dict[int, str], system_words: int = 48) -> dict:
    content = [{"type": "image_url", "image_url": {"url": images[i.seed]}} for i in spec.images]
    content.append({"type": "text", "text": prompt_text(spec)})
    messages = [{"role": "user", "content": content}]
    if spec.system is not None:
        messages.insert(0, {"role": "system", "content": system_text(spec.system, system_words)})
    return {"model": model_name, "messages": messages, "max_tokens": spec.max_tokens,
            "ignore_eos": True, "temperature": 0, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}, "return_stage_times": True}


async def one_request(client, url: str, body: dict, send_at: float) -> RequestRecord:
    await asyncio.sleep(max(0.0, send_at - time.perf_counter()))
    sent = time.perf_counter()
    times: list[float] = []
    stages, prompt_tokens = None, 0
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
                usage = chunk.get("usage") or {}
                stages = usage.get("stage_ms", stages)
                prompt_tokens = usage.get("prompt_tokens", prompt_tokens)
    except Exception as e:  # noqa: BLE001 - a failed request is a data point, not a crash
        return RequestRecord(sent, time.perf_counter(), False, type(e).__name__, tuple(times))
    return RequestRecord(sent, time.perf_counter(), bool(times), "200", tuple(times), prompt_tokens, stages)


def grpc_request(spec: RequestSpec, model_name: str, images: dict[int, bytes], system_words: int = 48):
    """The same request as `request_body`, as a `mmserve.v1` GenerateRequest (greedy, ignore_eos)."""
    from mmserve.rpc.vlm_client import request, user
    from protos.mmserve.v1 import vlm_pb2

    messages = [user(prompt_text(spec), [images[i.seed] for i in spec.images])]
    if spec.system is not None:
        text = vlm_pb2.ContentPart(text=system_text(spec.system, system_words))
        messages.insert(0, vlm_pb2.ChatMessage(role="system", content=[text]))
    return request(messages, model=model_name, max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=True)


async def one_request_grpc(stub, message, send_at: float, metadata: tuple = ()) -> RequestRecord:
    """A GenerateStream call; a refused or failed call records its gRPC code name."""
    import grpc

    await asyncio.sleep(max(0.0, send_at - time.perf_counter()))
    sent = time.perf_counter()
    times: list[float] = []
    try:
        async for response in stub.GenerateStream(message, timeout=600.0, metadata=metadata):
            now = time.perf_counter()
            times.extend([now] * len(response.token_ids))
    except grpc.aio.AioRpcError as e:
        return RequestRecord(sent, time.perf_counter(), False, e.code().name, tuple(times))
    except Exception as e:  # noqa: BLE001 - a failed request is a data point, not a crash
        return RequestRecord(sent, time.perf_counter(), False, type(e).__name__, tuple(times))
    return RequestRecord(sent, time.perf_counter(), bool(times), "200", tuple(times))


async def run_load(target: str, model_name: str, specs: list[RequestSpec], offsets: list[float],
                   label: str = "", concurrency: int | None = None, transport: str = "http",
                   application: str | None = None) -> list[RequestRecord]:
    """Sends `specs` at `offsets` (or, with `concurrency`, that many at a time) and records each.
    `target`: the base URL (HTTP) or `host:port` of Serve's gRPC proxy (gRPC; `application` names
    the Serve app when several run behind it)."""
    from tqdm import tqdm

    pngs = {i.seed: synthesize_image(i) for s in specs for i in s.images}
    bar = tqdm(total=len(specs), desc=label or "requests", file=sys.stderr, leave=False)
    async with _sender(target, model_name, pngs, transport, application) as send:
        gate = asyncio.Semaphore(concurrency) if concurrency else None

        async def tracked(spec: RequestSpec, offset: float) -> RequestRecord:
            if gate:
                async with gate:
                    record = await send(spec, 0.0)
            else:
                record = await send(spec, start + offset)
            bar.update(1)
            return record

        start = time.perf_counter()
        records = await asyncio.gather(*(tracked(s, o) for s, o in zip(specs, offsets)))
    bar.close()
    return list(records)


@contextlib.asynccontextmanager
async def _sender(target: str, model_name: str, pngs: dict[int, bytes], transport: str, application: str | None):
    """`send(spec, send_at) -> RequestRecord` over one shared HTTP client or gRPC channel."""
    if transport == "grpc":
        import grpc

        from protos.mmserve.v1 import vlm_pb2_grpc

        async with grpc.aio.insecure_channel(target) as channel:
            stub = vlm_pb2_grpc.VLMServiceStub(channel)
            metadata = (("application", application),) if application else ()
            yield lambda spec, at: one_request_grpc(stub, grpc_request(spec, model_name, pngs), at, metadata)
        return
    import httpx

    images = {seed: "data:image/png;base64," + base64.b64encode(png).decode() for seed, png in pngs.items()}
    url = target.rstrip("/") + "/v1/chat/completions"
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        yield lambda spec, at: one_request(client, url, request_body(spec, model_name, images), at)


# -- the app under test -------------------------------------------------------------------------
def bench_checkpoint(out: Path) -> str:
    """A random Qwen2-VL (float32) whose ViT is big enough to matter: embed 256, depth 6, ≤336² images."""
    import torch
    from transformers import AutoModelForImageTextToText, GenerationConfig, Qwen2VLImageProcessor, Qwen2VLProcessor

    from mmserve import tiny
    from mmserve.tiny import qwen2_vl, tokenizer as tiny_tokenizer

    if (out / "mmserve_tiny.json").exists():
        return str(out)
    tokenizer = tiny_tokenizer.build_tokenizer(0, vocab_size=1024)
    config = qwen2_vl.config("qwen2_vl", tokenizer)
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


def start_app(model: str, colocated: bool, num_cpus: float, dtype: str, device: str = "cpu",
              gpus: float = 0.0, replicas: tuple[int, int] | None = None, routing: str = "affinity") -> tuple[str, str]:
    """Starts Ray + Serve + the app in this process; returns its base URL and gRPC target (stop
    with `stop_app`). `replicas`: (encoder, LLM) replicas sharing their half of the CPUs (default:
    one each; colocated: two LLM replicas); `routing`: the app's routing policy."""
    import ray
    from ray import serve

    from deployments.serve.app import build_app
    from deployments.config import AppArgs
    from deployments.serve.router import grpc_options

    half = num_cpus / 2
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    port, grpc_port = free_loopback_port(), free_loopback_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, grpc_options=grpc_options(port=grpc_port))
    big = {"max_ongoing_requests": 256, "max_queued_requests": -1}
    encoders, llms = replicas or (1, 2 if colocated else 1)
    args = AppArgs(
        model=model, served_model_name="bench", dtype=dtype, device=device, colocated=colocated, router={"num_cpus": 0, **big},
        encoder={"num_cpus": half / encoders, "num_gpus": gpus, "num_replicas": encoders, **big},
        llm={"num_cpus": half / (llms if replicas else 1), "num_gpus": gpus, "num_replicas": llms, **big},
        routing={"policy": routing}, video_decoder={"num_cpus": 0},  # no videos in this workload
    )
    serve.run(build_app(args), name="bench", route_prefix="/")
    return f"http://127.0.0.1:{port}", f"127.0.0.1:{grpc_port}"


def stop_app() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


def vit_seconds(model: str, specs: list[RequestSpec], dtype: str, threads: int, device: str = "cpu") -> list[float]:
    """In-process ViT time (decode + preprocess + forward) of each request's images, one thread pool
    the size of a replica's."""
    import torch

    from encoder_service import VisionEncoder
    from mmserve.request.media import MediaItem, MediaKind

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
    p.add_argument("--grpc-target", help="host:port of a running app's gRPC proxy (with --transport grpc)")
    p.add_argument("--transport", choices=("http", "grpc"), default="http",
                   help="http: streaming /v1/chat/completions; grpc: mmserve.v1 GenerateStream")
    p.add_argument("--model-name", default="bench", help="served model name at --url / --grpc-target")
    p.add_argument("--model", help="checkpoint for the app started here (default: the bench checkpoint)")
    p.add_argument("--quick", action="store_true", help="bench checkpoint, 120 requests, images 112²..336²")
    p.add_argument("--compare", choices=("colocated", "routing", "ingress"),
                   help="colocated: disaggregated, then colocated, side by side; routing: affinity vs Serve's default "
                   "routing on 2 encoder + 2 LLM replicas, workloads A (popular images, shared system prompts) and "
                   "B (one hot image) (bench/serve_routing.py); ingress: Serve's ingress modes, small requests and the 256 "
                   "burst (bench/ingress.py)")
    p.add_argument("--video", action="store_true", help="video_url TTFT on 720p clips (bench/serve_video.py)")
    p.add_argument("--colocated", action="store_true", help="start the app here in colocated mode")
    p.add_argument("--num-cpus", type=float, default=2.0, help="total CPUs of the app started here")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="of the app started here")
    p.add_argument("--gpus-per-replica", type=float, default=0.5, help="with --device cuda: num_gpus of each replica")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--request-rate", type=float, nargs="+", default=None,
                   help="requests/s (several: a sweep; the summary takes the best goodput); default: 0.75 and 1.5 / the "
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
    args = p.parse_args(argv)
    if args.transport == "grpc" and args.url and not args.grpc_target:
        p.error("--transport grpc with a running app needs --grpc-target host:port")
    if args.transport == "http" and args.grpc_target and not args.url:
        p.error("--grpc-target is for --transport grpc (or give --url)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.compare == "ingress":
        from bench.ingress import main as compare_ingress

        compare_ingress(["--quick"] if args.quick else [])
        return 0
    if args.video:
        from bench.serve_video import run as video

        video(args)
        return 0
    if args.compare == "routing":
        import tempfile

        from bench.serve_routing import run as compare_routing

        compare_routing(args, args.model or bench_checkpoint(Path(tempfile.gettempdir()) / "mmserve-bench-serve-qwen2_vl-v1"))
        return 0
    began = time.perf_counter()
    num_prompts = args.num_prompts or (120 if args.quick else 200)
    dataset = DatasetConfig(buckets=QUICK_BUCKETS if args.quick else DatasetConfig().buckets, max_images=args.max_images,
                            text_only_share=args.text_only_share, repeat_share=args.repeat_share,
                            input_len=args.input_len, output_len=args.output_len)
    # each rate gets its own requests (the same in every mode): a rate that replayed an earlier
    # rate's images and prompts would measure the encoder and prefix caches, not the load
    def rate_specs(k: int) -> list[RequestSpec]:
        return generate_requests(dataset, num_prompts, args.seed + 10 + k)
    unloaded_specs = generate_requests(dataset, args.unloaded_requests, args.seed + 1)
    warm_specs = generate_requests(dataset, 8, args.seed + 2)  # other images: the unloaded run misses the cache
    modes = ["disaggregated", "colocated"] if args.compare else ["colocated" if args.colocated else "disaggregated"]
    model = None
    vit: list[float] = []
    if not (args.url or args.grpc_target):
        import tempfile

        model = args.model or bench_checkpoint(Path(tempfile.gettempdir()) / "mmserve-bench-serve-qwen2_vl-v1")
        vit = vit_seconds(model, unloaded_specs, args.dtype, int(args.num_cpus / 2), args.device)
    slo = SLO.parse(args.goodput)
    rates = args.request_rate
    runs: dict[str, list[tuple[float, dict, list[RequestRecord]]]] = {}
    summary: dict = {}
    for mode in modes:
        if args.url or args.grpc_target:
            url, grpc_target = args.url, args.grpc_target
        else:
            url, grpc_target = start_app(model, mode == "colocated", args.num_cpus, args.dtype, args.device,
                                         args.gpus_per_replica if args.device == "cuda" else 0.0)
        target = grpc_target if args.transport == "grpc" else url
        try:
            asyncio.run(run_load(target, args.model_name, warm_specs, [0.0] * len(warm_specs), "warm-up", concurrency=2,
                                 transport=args.transport))
            if mode == modes[0]:
                unloaded = asyncio.run(run_load(target, args.model_name, unloaded_specs, [0.0] * len(unloaded_specs),
                                                "unloaded", concurrency=1, transport=args.transport))
                base = compute_metrics(unloaded)
                # the ViT's share of each unloaded image request, median over them (one request slowed
                # by a noisy neighbour would swing a ratio of sums)
                shares = [v / r.e2el for r, s, v in zip(unloaded, unloaded_specs, vit) if s.images and r.ok]
                summary["vit_share"] = statistics.median(shares) if shares else None
                if args.goodput is None:
                    slo = SLO(ttft_ms=round(3 * base["median_ttft_ms"], 1), tpot_ms=round(3 * base["median_tpot_ms"], 1))
                if rates is None:  # below and above one request at a time
                    rates = [round(k * 1000 / base["mean_e2el_ms"], 3) for k in (0.75, 1.5)]
                print(f"unloaded ({len(unloaded)} requests one at a time): median TTFT {base['median_ttft_ms']:.1f} ms, "
                      f"median TPOT {base['median_tpot_ms']:.1f} ms, mean E2E {base['mean_e2el_ms']:.1f} ms; "
                      f"vit_share {summary['vit_share'] if summary['vit_share'] is None else round(summary['vit_share'], 3)}")
                print(f"SLOs: {' '.join(f'{k}:{v:g}ms' for k, v in slo.as_dict().items())}; request rates {rates}/s")
            for k, rate in enumerate(rates):
                specs = rate_specs(k)
                offsets = arrival_times(len(specs), rate, args.seed, args.burstiness)
                records = asyncio.run(run_load(target, args.model_name, specs, offsets, f"{mode} @{rate}/s",
                                               transport=args.transport))
                runs.setdefault(mode, []).append((rate, compute_metrics(records, slo), records))
        finally:
            if not (args.url or args.grpc_target):
                stop_app()
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
