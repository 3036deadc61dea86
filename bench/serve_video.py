"""`python bench/serve.py --video [--quick] [--decode-only]` (it runs this script with its arguments):
TTFT of `video_url` requests, the default path against the one before #47, side by side.

The clips are H.264 at 720p and 30 fps, 30 s, 20 s, 10 s and 4 s long, made once with PyAV into the temp
directory with pinned encoder settings (`X264`: libx264 veryfast, a keyframe every 2 s, closed
GOPs, 3 B-frames of which the middle one is a reference (b-pyramid), no adaptive B-frames, one
slice); the tiny Qwen2-VL samples them at 2 fps (60, 40, 20 and 8 frames).

First the decode alone, in this process (`decode_speedup_30s`): a `VideoDecodePool` of one worker
decoding the 30 s clip the default way (this machine's cores as segments decoded at once, split at
keyframes, one FFmpeg thread each; unsampled unreferenced frames skipped), the same with the cores
as FFmpeg's frame threads and no segments (`decode_speedup_30s_frame_threads`: the default before
segment-parallel decoding), and `SEQUENTIAL` (one thread, every frame decoded: the decode before
#47), alternating, median of the runs. `--decode-only` stops there.

Then four apps on the same CPUs: `default` (decoded the default way, streamed from
`stream_min_frames` sampled frames), `streamed` and `unstreamed` (the same decode, every video
streamed / none: `stream_speedup_<clip>`, unstreamed TTFT p50 over streamed, is what
`stream_min_frames` is set from) and `baseline` (unstreamed, `SEQUENTIAL`: `decode_threads: 1`,
`skip_unsampled: false`), caches off (every request
decodes, encodes and prefills its video again), reading the clips as local files. Requests go one
at a time, the modes alternating; the decoder's busy seconds per request come from
`VideoDecoder.stats`. The table gives TTFT p50 / p99 per clip and mode and the share of the TTFT
spent decoding.

It also prints each TTFT's CPU floor, the CPU seconds the request took (/proc/stat, less the idle
box's own) over the core count, and `cpu_bound_speedup` (why: docs/video.md#measured).

The last line is one JSON object: `decode_speedup_30s`, `video_ttft_speedup_30s` (TTFT p50 of
baseline over default, 30 s clip), `video_ttft_over_floor_30s` (the default's TTFT p50 over its CPU
seconds / cores: 1 is no schedule better), `decode_busy_share` (decode seconds over TTFT,
baseline, 30 s clip), `cpu_bound_speedup_30s` (the baseline's TTFT p50 over its own floor).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from deployments.cli.bench_app import start_serve, stop_app
from mmserve.loadgen.client import one_request, serve_bench_args

CLIPS = {"30s": 30, "20s": 20, "10s": 10, "4s": 4}  # name -> seconds, at 1280x720 and 30 fps
WIDTH, HEIGHT, FPS = 1280, 720, 30
X264 = {"preset": "veryfast", "x264-params": "keyint=60:min-keyint=60:scenecut=0:open-gop=0:bframes=3:b-adapt=0:"
        "b-pyramid=normal:slices=1"}


def make_clip(path: Path, seconds: int) -> Path:
    """A 720p, 30 fps H.264 clip of moving gradients, encoded with `X264` (written once; reused across runs)."""
    import av
    import numpy as np

    if path.exists():
        return path
    tmp = path.with_suffix(".part.mp4")
    y, x = np.mgrid[0:HEIGHT, 0:WIDTH]
    with av.open(str(tmp), mode="w") as out:
        stream = out.add_stream("libx264", rate=FPS, options=X264)
        stream.width, stream.height, stream.pix_fmt = WIDTH, HEIGHT, "yuv420p"
        for i in range(seconds * FPS):
            frame = np.stack([(x + 4 * i) % 256, (y + 2 * i) % 256, (x + y + 3 * i) % 256], axis=-1).astype(np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(packet)
        out.mux(stream.encode())
    tmp.rename(path)
    return path


# mode -> (video_decode.stream, decode_threads (None: the default), skip_unsampled, stream_min_frames (None:
# the default)): the default; every video streamed and none, decoded the default way (what
# stream_min_frames is set from); the path before #47
MODES = {"default": (True, None, True, None), "streamed": (True, None, True, 1),
         "unstreamed": (False, None, True, None), "baseline": (False, 1, False, None)}


def decode_speedup(model: str, clip: Path, runs: int) -> dict:
    """The pool's decode of `clip` the default way, and with its threads as FFmpeg's frame threads
    only (segments off: the default before segment-parallel decoding), against `SEQUENTIAL`, in
    this process."""
    from deployments.replica_env import decode_segments, decode_threads
    from mmserve.video.container import SEQUENTIAL, DecodeOptions, FrameSampler, VideoLimits
    from mmserve.video.workers import VideoDecodePool

    data = clip.read_bytes()
    threads = decode_threads(None, 1, 1)
    fast = DecodeOptions(threads, skip_unsampled=True, segments=decode_segments(None, 1, threads))  # the default
    variants = {"default": fast, "frame_threads": DecodeOptions(threads, skip_unsampled=True, segments=1),
                "sequential": SEQUENTIAL}
    pools = {name: VideoDecodePool(FrameSampler(model), VideoLimits(max_frames=64), 1, options)
             for name, options in variants.items()}
    times: dict[str, list[float]] = {name: [] for name in pools}
    try:
        for k in range(runs + 1):
            for name, pool in pools.items():
                began = time.perf_counter()
                video = asyncio.run(pool.decode(data, "bench"))
                if k:  # the first starts each pool's worker
                    times[name].append(time.perf_counter() - began)
    finally:
        for pool in pools.values():
            pool.close()
    median = {name: statistics.median(t) for name, t in times.items()}
    segmented = pools["default"].stats.segmented
    print(f"decode of {clip.name} ({len(video.indices)} frames sampled), median of {runs}, modes alternating:")
    for name, options in variants.items():
        print(f"  {name:>13}: {options.usable_threads()} threads, {options.usable_segments()} segments at once, "
              f"{'skipping' if options.skip_unsampled else 'every frame'}: {median[name]:.3f} s "
              f"({median['sequential'] / median[name]:.2f}x sequential)  runs: "
              f"{' '.join(f'{t:.3f}' for t in times[name])}", flush=True)
    return {"decode_speedup_30s": round(median["sequential"] / median["default"], 3),
            "decode_speedup_30s_frame_threads": round(median["sequential"] / median["frame_threads"], 3),
            "decode_s_30s_default": round(median["default"], 3),
            "decode_s_30s_frame_threads": round(median["frame_threads"], 3),
            "decode_s_30s_sequential": round(median["sequential"], 3), "decode_threads": fast.threads,
            "decode_segments": fast.usable_segments(), "segmented_videos": segmented}


def start(model: str, clip_dir: Path, num_cpus: float) -> dict[str, str]:
    """Ray + Serve + one app per mode; {mode: chat completions URL}."""
    share = {"num_cpus": num_cpus / (4 * len(MODES))}  # the apps' replicas share the CPUs; one request at a time
    apps = {mode: {
        "model": model, "served_model_name": mode, "dtype": "float32",
        "router": {"num_cpus": 0}, "encoder": share, "llm": share, "video_decoder": share,
        "video_decode": {"workers": 1, "stream": stream, "decode_threads": threads,
                         "skip_unsampled": skip,
                         **({} if min_frames is None else {"stream_min_frames": min_frames})},
        "encoder_pool": {"cache_bytes": 0}, "engine": {"enable_prefix_caching": False},
        "limits": {"allow_local_media": True, "local_media_dir": str(clip_dir), "max_frames_per_video": 64},
    } for mode, (stream, threads, skip, min_frames) in MODES.items()}
    port, _ = start_serve(num_cpus, apps=apps)
    return {mode: f"http://127.0.0.1:{port}/{mode}/v1/chat/completions" for mode in MODES}


def cpu_busy_s() -> float | None:
    """Seconds all of this machine's CPUs have been busy (not idle, not waiting on I/O) since boot;
    None where there is no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


async def idle_busy_rate(seconds: float = 2.0) -> float | None:
    """CPU seconds per second the idle box burns (Ray's processes, the proxy), to take off a request's."""
    before, began = cpu_busy_s(), time.perf_counter()
    await asyncio.sleep(seconds)
    after = cpu_busy_s()
    return None if before is None or after is None else (after - before) / (time.perf_counter() - began)


def decoder_busy_s(app: str) -> float:
    from ray import serve

    return serve.get_deployment_handle("VideoDecoder", app_name=app).stats.remote().result()["busy_s"]


async def measure(urls: dict[str, str], clip: Path, requests: int) -> dict[str, dict]:
    """{mode: figures} over `requests` per mode, the modes alternating (after one warm-up each)."""
    import httpx

    rows: dict[str, list[dict]] = {mode: [] for mode in urls}
    background = await idle_busy_rate()
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        for k in range(requests + 1):
            for mode, url in urls.items():
                body = {"model": mode, "max_tokens": 4, "stream": True, "return_token_ids": True,
                        "return_stage_times": True, "stream_options": {"include_usage": True},
                        "messages": [{"role": "user", "content": [
                            {"type": "video_url", "video_url": {"url": str(clip)}},
                            {"type": "text", "text": "What happens?"}]}]}
                busy = await asyncio.to_thread(decoder_busy_s, mode)
                cpu_before = cpu_busy_s()
                record = await one_request(client, url, body, time.perf_counter())
                cpu_after = cpu_busy_s()
                if not record.ok:
                    raise RuntimeError(f"video request failed ({mode}): {record.status}")
                decode_s = await asyncio.to_thread(decoder_busy_s, mode) - busy
                cpu_s = (None if background is None or cpu_before is None or cpu_after is None else
                         cpu_after - cpu_before - background * (record.end_time - record.send_time))
                if k:  # the first warms each app's decoder worker and replicas up
                    rows[mode].append({"ttft_s": record.ttft, "decode_s": decode_s, "cpu_s": cpu_s})
    out = {}
    for mode, got in rows.items():
        ttfts = sorted(r["ttft_s"] for r in got)
        decode = statistics.fmean(r["decode_s"] for r in got)
        cpu = None if any(r["cpu_s"] is None for r in got) else statistics.median(r["cpu_s"] for r in got)
        out[mode] = {"ttft_p50_s": statistics.median(ttfts), "ttft_p99_s": ttfts[-1] if len(ttfts) < 100 else
                     ttfts[round(0.99 * (len(ttfts) - 1))], "decode_s": decode,
                     "decode_busy_share": decode / statistics.fmean(ttfts), "cpu_s": cpu}
    return out


def run(args) -> dict:
    from mmserve.tiny import ensure_tiny_model

    clip_dir = Path(tempfile.gettempdir()) / "mmserve-bench-video-v2"  # v2: the pinned X264 settings
    clip_dir.mkdir(exist_ok=True)
    began = time.perf_counter()
    clips = {name: make_clip(clip_dir / f"{name}-720p30.mp4", seconds) for name, seconds in CLIPS.items()}
    print(f"clips ready in {time.perf_counter() - began:.1f} s: {', '.join(str(c) for c in clips.values())}", flush=True)
    model = args.model or str(ensure_tiny_model("qwen2_vl", clip_dir / "tiny-qwen2_vl"))
    summary = {"bench": "serve_video", **decode_speedup(model, clips["30s"], 3 if args.quick else 5)}
    if args.decode_only:
        print(json.dumps(summary))
        return summary
    urls = start(model, clip_dir, args.num_cpus)
    try:
        results = {name: asyncio.run(measure(urls, clip, 3 if args.quick else 8)) for name, clip in clips.items()}
    finally:
        stop_app()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"{'clip':>5} {'mode':>9} {'TTFT p50 s':>11} {'p99 s':>7} {'decode s':>9} {'decode share':>13} "
          f"{'CPU s':>6} {'CPU floor s':>12}")
    for name, modes in results.items():
        for mode, r in modes.items():
            cpu = ("-", "-") if r["cpu_s"] is None else (f"{r['cpu_s']:.3f}", f"{r['cpu_s'] / cores:.3f}")
            print(f"{name:>5} {mode:>9} {r['ttft_p50_s']:>11.3f} {r['ttft_p99_s']:>7.3f} {r['decode_s']:>9.3f} "
                  f"{r['decode_busy_share']:>13.2f} {cpu[0]:>6} {cpu[1]:>12}")
    speedup = {name: modes["baseline"]["ttft_p50_s"] / modes["default"]["ttft_p50_s"]
               for name, modes in results.items()}
    # no schedule of a request's work on these cores gets a TTFT below its CPU seconds over the cores
    floor = {name: {mode: None if r["cpu_s"] is None else r["ttft_p50_s"] / (r["cpu_s"] / cores)
                    for mode, r in modes.items()} for name, modes in results.items()}
    print(" ".join(f"speedup {name} (p50 baseline / default): {x:.2f}x" for name, x in speedup.items()))
    # what streaming alone does to a clip of this length (the same decode): what stream_min_frames is set from
    streaming = {name: modes["unstreamed"]["ttft_p50_s"] / modes["streamed"]["ttft_p50_s"]
                 for name, modes in results.items()}
    print(" ".join(f"streaming {name} (p50 unstreamed / streamed): {x:.2f}x" for name, x in streaming.items()))
    print(" ".join(f"{name} {mode}: TTFT {x:.2f}x its CPU floor" for name, modes in floor.items()
                   for mode, x in modes.items() if x))
    summary.update({"video_ttft_speedup_30s": round(speedup["30s"], 3),
                    "video_ttft_speedup_10s": round(speedup["10s"], 3),
                    **{f"stream_speedup_{name}": round(x, 3) for name, x in streaming.items()},
                    "decode_busy_share": round(results["30s"]["baseline"]["decode_busy_share"], 3),
                    **{f"video_ttft_over_floor_{name}": round(x["default"], 3)
                       for name, x in floor.items() if x["default"]},
                    **{f"cpu_bound_speedup_{name}": round(x["baseline"], 3)
                       for name, x in floor.items() if x["baseline"]},
                    **{f"cpu_s_{name}_{mode}": round(r["cpu_s"], 3) for name, modes in results.items()
                       for mode, r in modes.items() if r["cpu_s"] is not None},
                    **{f"ttft_{q}_s_{name}_{mode}": round(r[f"ttft_{q}_s"], 3) for name, modes in results.items()
                       for mode, r in modes.items() for q in ("p50", "p99")}})
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    run(serve_bench_args(__doc__, None))
