"""The load: `bench serve`'s requests to a running app over HTTP (streaming chat completions) or gRPC
(`mmserve.v1` GenerateStream), each recorded as a `RequestRecord` (no Ray; httpx, grpcio and tqdm
imported when a load runs); and bench/serve.py's command line, which its experiments share."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from pathlib import Path

from mmserve.loadgen.dataset import RequestSpec, data_uri, prompt_text, synthesize_image, system_text
from mmserve.loadgen.metrics import RequestRecord


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
    message = request(messages, model=model_name, max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=True)
    message.return_stage_times = True
    return message


async def one_request_grpc(stub, message, send_at: float, metadata: tuple = ()) -> RequestRecord:
    """A GenerateStream call; a refused or failed call records its gRPC code name."""
    import grpc

    await asyncio.sleep(max(0.0, send_at - time.perf_counter()))
    sent = time.perf_counter()
    times: list[float] = []
    stages, prompt_tokens = None, 0
    try:
        async for response in stub.GenerateStream(message, timeout=600.0, metadata=metadata):
            times.extend([time.perf_counter()] * len(response.token_ids))
            if response.HasField("usage"):
                stages = dict(response.usage.stage_ms) or stages
                prompt_tokens = response.usage.prompt_tokens or prompt_tokens
    except grpc.aio.AioRpcError as e:
        return RequestRecord(sent, time.perf_counter(), False, e.code().name, tuple(times))
    except Exception as e:  # noqa: BLE001 - a failed request is a data point, not a crash
        return RequestRecord(sent, time.perf_counter(), False, type(e).__name__, tuple(times))
    return RequestRecord(sent, time.perf_counter(), bool(times), "200", tuple(times), prompt_tokens, stages)


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
            async with gate or contextlib.nullcontext():
                record = await send(spec, 0.0 if gate else start + offset)
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

    images = {seed: data_uri(png) for seed, png in pngs.items()}
    url = target.rstrip("/") + "/v1/chat/completions"
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        yield lambda spec, at: one_request(client, url, request_body(spec, model_name, images), at)


def serve_bench_args(description: str, argv: list[str] | None) -> argparse.Namespace:
    """bench/serve.py's arguments (its experiments take the same)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    p.add_argument("--decode-only", action="store_true", help="with --video: the decode pool alone, no app")
    p.add_argument("--colocated", action="store_true", help="start the app here in colocated mode")
    p.add_argument("--num-cpus", type=float, default=2.0, help="total CPUs of the app started here")
    p.add_argument("--cpu-threads", type=int, help="torch threads of the model replicas started here (default: the "
                   "app's policy)")
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
