"""VideoDecoder deployment: `video_url` files decoded to the frames the model samples, on CPU replicas.

Each replica holds a `VideoDecodePool` (worker processes with a deadline per video) and the
checkpoint's frame sampler; GPU encoder nodes spend no host cores on decoding. The router awaits
`decode` for each video file of a request and sends the frames on to the encoder as uint8 (through
the object store, or gRPC to a standalone encoder). Replicas report the decode seconds queued on
them to Serve's autoscaler (`deployments.serve.autoscaling`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import numpy as np
from ray import serve
from ray.serve.metrics import Counter, Gauge, Histogram

from deployments.serve.autoscaling import QUEUED_DECODE_S, scaled
from deployments.replica_env import decode_segments, decode_threads, resolve_model_dir
from mmserve.errors import InvalidRequest
from mmserve.inputs.media import DecodedVideo
from mmserve.video.container import DecodeOptions, FrameSampler, VideoLimits, VideoSampling, pyav_available
from mmserve.video.workers import VideoDecodePool

if TYPE_CHECKING:
    from deployments.config import DeploymentArgs, VideoDecodeArgs

logger = logging.getLogger("ray.serve")


def video_decoder_options(deployment: DeploymentArgs, decode: VideoDecodeArgs) -> dict:
    """Serve options of the VideoDecoder: fixed replicas, or autoscaling on queued decode seconds."""
    return scaled(decode, deployment.options("VideoDecoder"),
                  target_decode_s_per_replica=decode.target_queued_seconds_per_replica)


_LATENCY_MS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 30000]


class VideoMetrics:
    """Defined here, not in `deployments.serve.metrics`: a VideoDecoder replica imports neither torch nor
    `transformers` until it sees its first video (its start stays cheap)."""

    def __init__(self):
        self.videos = Counter("mmserve_video_decoded", "Video files decoded to their sampled frames")
        self.frames = Counter("mmserve_video_frames", "Frames sampled from decoded videos")
        self.refused = Counter("mmserve_video_refused", "Video files refused (bad, over a limit, past the deadline)")
        self.skip_fallbacks = Counter("mmserve_video_skip_fallbacks", "Videos whose frames did not follow their "
                                      "timestamps, decoded again with nothing skipped")
        self.segment_fallbacks = Counter("mmserve_video_segment_fallbacks", "Videos that were to be decoded in "
                                         "segments at once but were decoded in one pass (open GOPs, or frames "
                                         "not where the probe put them)")
        self.decode_ms = Histogram("mmserve_video_decode_ms", "Probe + sample + decode time per video (queue included)",
                                   boundaries=_LATENCY_MS)
        self.queued_s = Gauge("mmserve_video_queued_decode_s", "Decode seconds running or waiting on this replica")


@serve.deployment
class VideoDecoder:
    def __init__(self, model_dir: str | None, limits: VideoLimits, workers: int, threads: int | None = None,
                 skip_unsampled: bool = True, replicas: int = 1, segments: int | None = None):
        """`limits`: `LimitArgs.video_limits()`; `workers`, `threads`, `skip_unsampled`, `segments`:
        `video_decode`'s (`decode_threads` resolved here, on the replica's node, with `replicas` at start;
        `segment_workers` likewise). The checkpoint's sampler loads with the first video."""
        threads = decode_threads(threads, replicas, workers)
        options = DecodeOptions(threads, skip_unsampled, decode_segments(segments, replicas, threads))
        self.pool = VideoDecodePool(FrameSampler(resolve_model_dir(model_dir)), limits, workers, options)
        self.metrics = VideoMetrics()
        self._fallbacks_reported = dict.fromkeys(("skip_fallbacks", "segment_fallbacks"), 0)
        if not pyav_available():
            logger.warning("PyAV is not installed: video_url requests get 400 (install mmserve[video])")

    async def decode(self, data: bytes, request_id: str = "-", sampling: VideoSampling | None = None) -> DecodedVideo:
        start = time.perf_counter()
        with self._refusals():
            video = await self.pool.decode(data, request_id, sampling)
        self._count(len(video.indices), start)
        return video

    async def probe(self, data: bytes, request_id: str = "-", sampling: VideoSampling | None = None,
                    decode_below: int = 0) -> DecodedVideo:
        """The video's header (what the router plans with), nothing decoded; decoded whole when it
        samples to fewer than `decode_below` frames (`VideoDecodePool.probe`)."""
        start = time.perf_counter()
        with self._refusals():
            video = await self.pool.probe(data, request_id, sampling, decode_below)
        if video.pixels is not None:
            self._count(len(video.indices), start)
        return video

    async def frames(self, data: bytes, request_id: str = "-", group_size: int = 1,
                     indices: tuple[int, ...] | None = None) -> AsyncIterator[np.ndarray]:
        """The sampled frames (`indices`: the header's) in groups of `group_size`, each as soon as it
        is decoded (a streaming call: `handle.options(stream=True).frames.remote(...)`)."""
        start, count = time.perf_counter(), 0
        with self._refusals():
            async for group in self.pool.frames(data, request_id, group_size, indices):
                count += len(group)
                yield group
        self._count(count, start)

    @contextlib.contextmanager
    def _refusals(self):
        try:
            yield
        except InvalidRequest:  # a bad video, over a limit, past the deadline
            self.metrics.refused.inc()
            raise

    def _count(self, frames: int, start: float) -> None:
        self.metrics.videos.inc()
        self.metrics.frames.inc(frames)
        self.metrics.decode_ms.observe((time.perf_counter() - start) * 1000)
        for name, reported in self._fallbacks_reported.items():
            if fallbacks := getattr(self.pool.stats, name) - reported:
                getattr(self.metrics, name).inc(fallbacks)
                self._fallbacks_reported[name] += fallbacks

    def stats(self) -> dict:
        """The pool's counters and which replica answered (tests, benches, debugging)."""
        return {**dataclasses.asdict(self.pool.stats), "running": self.pool.num_running,
                "replica": serve.get_replica_context().replica_id.unique_id}

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics hook (see `deployments.serve.autoscaling`)."""
        queued = self.pool.queued_seconds
        self.metrics.queued_s.set(queued)
        return {QUEUED_DECODE_S: queued}

    def __del__(self):
        self.pool.close()


class ServeVideoClient:
    """The cores' video decoding over the VideoDecoder deployment's handle: the router's
    (`RequestCore`'s `VideoDecoding`) and the LLM replica's (`LLMReplica`'s `frames`)."""

    def __init__(self, handle):
        self.handle = handle

    async def decode(self, data: bytes, request_id: str, sampling: VideoSampling | None = None) -> DecodedVideo:
        return await self.handle.decode.remote(data, request_id, sampling)

    async def probe(self, data: bytes, request_id: str, sampling: VideoSampling | None = None,
                    decode_below: int = 0) -> DecodedVideo:
        return await self.handle.probe.remote(data, request_id, sampling, decode_below)

    async def frames(self, data: bytes, request_id: str, group_size: int,
                     indices: tuple[int, ...]) -> AsyncIterator[np.ndarray]:
        """A streamed video's frame groups from the VideoDecoder, as it decodes them."""
        groups = self.handle.options(stream=True).frames.remote(data, request_id, group_size, indices)
        try:
            async for group in groups:
                yield group
        finally:
            groups.cancel()  # stopped early (a failure, the client gone): the decoder stops too
