"""`python bench/serve.py --video [--quick]`: TTFT of `video_url` requests, and how much of it is decoding.

The clips are H.264 at 720p and 30 fps, 30 s and 10 s long (made once with PyAV into the temp
directory); the tiny Qwen2-VL samples them at 2 fps (60 and 20 frames). The app runs here with its
caches off (every request decodes, encodes and prefills its video again), reading the clips as
local files. Requests go one at a time, streamed, each asking for `usage.stage_ms`; the decoder's
busy seconds per request come from `VideoDecoder.stats`. The table gives TTFT p50 / p99 per clip
and the share of TTFT spent decoding (`decode_busy_share`, the 30 s clip's).

Streaming frames through the pipeline (issue 28) is not built yet: `video_streaming_ttft_speedup_30s`
is null until it is, and this run is its unstreamed baseline. The last line is one JSON object.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from bench.serve import one_request
from deployments.ingress import free_loopback_port

CLIPS = {"30s": 30, "10s": 10}  # name -> seconds, at 1280x720 and 30 fps
WIDTH, HEIGHT, FPS = 1280, 720, 30


def make_clip(path: Path, seconds: int) -> Path:
    """A 720p, 30 fps H.264 clip of moving gradients (written once; reused across runs)."""
    import av
    import numpy as np

    if path.exists():
        return path
    tmp = path.with_suffix(".part.mp4")
    y, x = np.mgrid[0:HEIGHT, 0:WIDTH]
    with av.open(str(tmp), mode="w") as out:
        stream = out.add_stream("libx264", rate=FPS, options={"preset": "veryfast"})
        stream.width, stream.height, stream.pix_fmt = WIDTH, HEIGHT, "yuv420p"
        for i in range(seconds * FPS):
            frame = np.stack([(x + 4 * i) % 256, (y + 2 * i) % 256, (x + y + 3 * i) % 256], axis=-1).astype(np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(packet)
        out.mux(stream.encode())
    tmp.rename(path)
    return path


def start(model: str, clip_dir: Path, num_cpus: float) -> str:
    import ray
    from ray import serve

    from deployments.app import build_app

    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    port = free_loopback_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    quarter = num_cpus / 4
    args = {
        "model": model, "served_model_name": "bench", "dtype": "float32",
        "router": {"num_cpus": 0}, "encoder": {"num_cpus": quarter}, "llm": {"num_cpus": quarter},
        "video_decoder": {"num_cpus": 2 * quarter}, "video_decode": {"workers": 1},
        "encoder_pool": {"cache_bytes": 0}, "engine": {"enable_prefix_caching": False},
        "limits": {"allow_local_media": True, "local_media_dir": str(clip_dir), "max_frames_per_video": 64},
    }
    serve.run(build_app(args), name="bench", route_prefix="/")
    return f"http://127.0.0.1:{port}/v1/chat/completions"


def decoder_busy_s() -> float:
    from ray import serve

    return serve.get_deployment_handle("VideoDecoder", app_name="bench").stats.remote().result()["busy_s"]


async def measure(url: str, clip: Path, requests: int) -> dict:
    import httpx

    body = {"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": str(clip)}},
                                                      {"type": "text", "text": "What happens?"}]}],
            "max_tokens": 4, "stream": True, "return_token_ids": True, "return_stage_times": True,
            "stream_options": {"include_usage": True}}
    rows = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        for k in range(requests + 1):  # the first warms the decoder worker and the replicas up
            busy = await asyncio.to_thread(decoder_busy_s)
            record = await one_request(client, url, body, time.perf_counter())
            if not record.ok:
                raise RuntimeError(f"video request failed: {record.status}")
            decode_s = await asyncio.to_thread(decoder_busy_s) - busy
            if k:
                rows.append({"ttft_s": record.ttft, "decode_s": decode_s, **(record.stage_ms or {})})
    ttfts = sorted(r["ttft_s"] for r in rows)
    mean = lambda key: statistics.fmean(r.get(key, 0.0) for r in rows)  # noqa: E731
    return {"ttft_p50_s": statistics.median(ttfts), "ttft_p99_s": ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))],
            "decode_s": mean("decode_s"), "decode_busy_share": mean("decode_s") / statistics.fmean(ttfts),
            "router_ms": mean("router_ms"), "embeddings_ms": mean("embeddings_ms"), "prefill_ms": mean("prefill_ms")}


def run(args) -> dict:
    from bench.serve import stop_app
    from mmserve.tiny import ensure_tiny_model

    clip_dir = Path(tempfile.gettempdir()) / "mmserve-bench-video-v1"
    clip_dir.mkdir(exist_ok=True)
    began = time.perf_counter()
    clips = {name: make_clip(clip_dir / f"{name}-720p30.mp4", seconds) for name, seconds in CLIPS.items()}
    print(f"clips ready in {time.perf_counter() - began:.1f} s: {', '.join(str(c) for c in clips.values())}", flush=True)
    model = args.model or str(ensure_tiny_model("qwen2_vl", clip_dir / "tiny-qwen2_vl"))
    url = start(model, clip_dir, args.num_cpus)
    try:
        results = {name: asyncio.run(measure(url, clip, 3 if args.quick else 8)) for name, clip in clips.items()}
    finally:
        stop_app()
    print(f"{'clip':>5} {'TTFT p50 s':>11} {'p99 s':>7} {'decode s':>9} {'decode share':>13} "
          f"{'router ms':>10} {'embed ms':>9} {'prefill ms':>11}")
    for name, r in results.items():
        print(f"{name:>5} {r['ttft_p50_s']:>11.3f} {r['ttft_p99_s']:>7.3f} {r['decode_s']:>9.3f} "
              f"{r['decode_busy_share']:>13.2f} {r['router_ms']:>10.0f} {r['embeddings_ms']:>9.0f} {r['prefill_ms']:>11.0f}")
    summary = {"bench": "serve_video", "streaming": False, "video_streaming_ttft_speedup_30s": None,
               "decode_busy_share": round(results["30s"]["decode_busy_share"], 3),
               **{f"ttft_{q}_s_{name}": round(r[f"ttft_{q}_s"], 3) for name, r in results.items() for q in ("p50", "p99")},
               "note": "frames are not streamed through the pipeline yet (issue 28): the unstreamed baseline"}
    print(json.dumps(summary))
    return summary
