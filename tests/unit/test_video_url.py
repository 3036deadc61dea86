"""`video_url` without Ray: video files decoded in worker processes to exactly the frames and
metadata `transformers`' own loader gives (PyAV, the checkpoint's `sample_frames`), the faces fed
from them, and every bad file refused with a message naming the problem. Served end to end:
tests/serve/test_video_url_serve.py (Qwen2-VL, Qwen2.5-VL), tests/serve/test_family_serve.py
(Qwen3-VL, MiniCPM-V)."""

import asyncio
import dataclasses
import os
import sys
import time

import numpy as np
import pytest
import torch

from mmserve.errors import InvalidRequest
from mmserve.families import router_face
from mmserve.inputs.media import MediaItem, MediaKind
from mmserve.video.container import SEQUENTIAL, ContainerReader, DecodeOptions, FrameSampler, VideoLimits, VideoSampling
from mmserve.video.workers import DecodeWorker, VideoDecodePool
from tests.support.media_factory import (audio_only_file, h264_cropped, image_bytes, mjpeg_mkv, mkv_declaring,
                                         video_file)
from tests.support.reference import load_reference, load_video_file

pytest.importorskip("av")  # the `video` extra: scripts/setup installs it


@pytest.fixture(scope="module")
def video_models(tiny_models, qwen3_dir, minicpmv_dir, tiny_checkpoint) -> dict[str, str]:
    return {**tiny_models, "qwen3_vl": qwen3_dir, "minicpmv4_6": minicpmv_dir, "qwen3_5": tiny_checkpoint("qwen3_5")}


def decode(pool: VideoDecodePool, data: bytes):
    return asyncio.run(pool.decode(data, "test"))


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "minicpmv4_6"])
def test_decoded_frames_and_metadata_equal_transformers_loader(video_models, family):
    model_dir = video_models[family]
    data = video_file(4.3, 12, 48, 80, seed=3)  # 52 frames: every sampler picks a strict subset
    pool = VideoDecodePool(FrameSampler(model_dir), VideoLimits(max_frames=64), workers=1)
    try:
        video = decode(pool, data)
    finally:
        pool.close()
    frames, metadata = load_video_file(model_dir, data)
    assert np.array_equal(video.pixels, frames) and video.pixels.dtype == np.uint8
    assert list(video.indices) == list(metadata.frames_indices) and 1 < len(video.indices) < 52
    assert (video.fps, video.total_num_frames, video.duration) == (metadata.fps, metadata.total_num_frames,
                                                                  metadata.duration)


@pytest.mark.parametrize("sampling", [{"num_frames": 4}, {"fps": 4.0}])
def test_a_requests_fps_or_num_frames_sample_as_the_processor_does_with_them(tiny_models, sampling):
    model_dir = tiny_models["qwen2_vl"]
    data = video_file(4.3, 12, 48, 80, seed=3)
    pool = VideoDecodePool(FrameSampler(model_dir), VideoLimits(max_frames=64), workers=1)
    try:
        video = asyncio.run(pool.decode(data, "test", VideoSampling(**sampling)))
        default = asyncio.run(pool.probe(data, "test"))
    finally:
        pool.close()
    frames, metadata = load_video_file(model_dir, data, **sampling)
    assert list(video.indices) == list(metadata.frames_indices) != list(default.indices)
    assert np.array_equal(video.pixels, frames)


@pytest.mark.parametrize("sampling, field", [
    (VideoSampling(num_frames=65), "mm_processor_kwargs.num_frames must be in \\[1, 64\\]"),
    (VideoSampling(num_frames=0), "mm_processor_kwargs.num_frames"),
    (VideoSampling(fps=0.0), "mm_processor_kwargs.fps must be in"),
    (VideoSampling(fps=2.0, num_frames=8), "fps and num_frames are mutually exclusive"),
])
def test_out_of_range_sampling_is_refused_naming_the_field(tiny_models, sampling, field):
    from deployments.core.request_core import ChatRequest
    from mmserve.inputs.media import MediaSource
    from mmserve.request.prompt import Message
    from tests.support.core_fakes import make_core

    core = make_core(tiny_models["qwen2_vl"])
    parts = (MediaSource(MediaKind.VIDEO, (b"file",), container=True), "what?")
    with pytest.raises(InvalidRequest, match=field):
        core._check(ChatRequest((Message("user", parts),), None, video_sampling=sampling))


def test_sampling_arrives_from_http_and_grpc_as_vllms_mm_processor_kwargs():
    from deployments.api import grpc_api, openai_api
    from deployments.api.openai_models import ChatCompletionRequest
    from mmserve.rpc.vlm_client import request, user

    body = {"messages": [{"role": "user", "content": "hi"}], "mm_processor_kwargs": {"num_frames": 8}}
    assert openai_api.chat_request(ChatCompletionRequest.model_validate(body)).video_sampling == VideoSampling(
        num_frames=8)
    req = request([user("hi")])
    assert grpc_api.chat_request(req).video_sampling is None
    req.mm_processor_kwargs.fps = 1.5
    assert grpc_api.chat_request(req).video_sampling == VideoSampling(fps=1.5)


def test_every_container_decodes_to_the_same_sampled_frames(tiny_models):
    pool = VideoDecodePool(FrameSampler(tiny_models["qwen2_vl"]), VideoLimits(), workers=2)
    try:
        videos = {c: decode(pool, video_file(3, 10, 48, 64, seed=5, container=c)) for c in ("mp4", "mov", "mkv", "webm")}
    finally:
        pool.close()
    mp4 = videos.pop("mp4")
    assert mp4.indices == (0, 5, 10, 15, 20, 25)
    for container, video in videos.items():
        assert video.indices == mp4.indices and video.pixels.shape == mp4.pixels.shape, container
        error = np.abs(video.pixels.astype(int) - mp4.pixels).mean()
        assert error < 8, (container, error)  # the same content, through lossy encoders
    assert len({v.content_hash for v in [mp4, *videos.values()]}) == 4


def test_a_whole_video_is_read_into_one_array_without_a_second_copy(tiny_models):
    """The worker's frame groups land straight in the video's array: the decode's peak memory in
    this process is that array, not the groups and their concatenation besides (twice it)."""
    import tracemalloc

    pool = VideoDecodePool(FrameSampler(tiny_models["qwen2_vl"]), VideoLimits(), workers=1)
    data = video_file(16, 4, 240, 320, seed=2)  # 32 frames sampled at 2 fps, of 230 KB: 4 transfer groups
    try:
        decode(pool, data)  # the worker started, the sampler loaded
        tracemalloc.start()
        try:
            video = decode(pool, data)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    finally:
        pool.close()
    assert video.pixels.shape == (32, 240, 320, 3) and video.pixels.flags.owndata
    assert peak < 1.25 * video.pixels.nbytes, (peak, video.pixels.nbytes)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pipe sizes are Linux's")
def test_a_workers_frame_pipe_is_grown_to_a_mebibyte():
    """bench/video_transfer.py: a 1 MiB pipe moves a 30 s clip's frames 2.0-2.5x faster than
    Linux's 64 KiB one on an idle box (fewer reader wake-ups)."""
    import fcntl

    from mmserve.video.workers import PIPE_BYTES

    worker = DecodeWorker()
    try:
        assert fcntl.fcntl(worker.proc.stdout.fileno(), getattr(fcntl, "F_GETPIPE_SZ", 1032)) == PIPE_BYTES
    finally:
        worker.kill()


def _processor(model_dir, frames, metadata, text_token):
    processor, _ = load_reference(model_dir)
    return processor(text=[text_token], videos=[frames], video_metadata=[metadata], do_sample_frames=False,
                     return_tensors="pt")


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "minicpmv4_6"])
def test_faces_expand_and_preprocess_a_decoded_video_like_the_processor(video_models, family):
    """The router face's tokens and the encoder face's pixels for a decoded video equal the
    processor's for the frames and metadata of `transformers`' loader."""
    from encoder_service import VisionEncoder

    model_dir = video_models[family]
    data = video_file(3.1, 10, 56, 84, seed=9)
    pool = VideoDecodePool(FrameSampler(model_dir), VideoLimits(), workers=1)
    try:
        item = MediaItem(MediaKind.VIDEO, (), decoded=decode(pool, data))
    finally:
        pool.close()
    frames, metadata = load_video_file(model_dir, data)
    processor, _ = load_reference(model_dir)
    face = router_face(model_dir)
    placeholder = face.placeholder(MediaKind.VIDEO)
    expected = _processor(model_dir, frames, metadata, placeholder)
    [expansion] = face.expand_all([item], 1 << 24)
    assert list(expansion.token_ids) == expected["input_ids"][0].tolist()
    face = VisionEncoder(model_dir, dtype="float64").face
    got = face.pixel_values([face.preprocess(item, expansion.layout)], torch.device("cpu"))
    want = expected["pixel_values_videos"]
    want = want[:1] if family == "minicpmv4_6" else want  # MiniCPM-V packs a video's views in one row
    assert torch.equal(got, want.to(got.dtype))


def _bad_files() -> dict[str, tuple[bytes, str]]:
    good_mkv = video_file(3, 10, 32, 32, seed=1, container="mkv")
    long_mkv = video_file(30, 10, 16, 16, seed=2, container="mkv", audio=False)
    mp4 = video_file(3, 10, 32, 32, seed=1)
    return {
        "zero-length": (b"", "empty"),
        "not a video": (image_bytes(32, 32, 0), "unsupported video container|not a recognised"),
        "truncated mp4": (mp4[: len(mp4) // 2], "not a recognised or complete|truncated"),
        "truncated mkv": (good_mkv[: len(good_mkv) * 2 // 3], "truncated"),
        "unknown codec": (mkv_declaring(good_mkv, codec_id=b"V_NOTACODEC_XYZ"), "codec .* not supported"),
        "10-hour file": (mkv_declaring(good_mkv, seconds=36000), "36000.0 s long; the limit is 20 s"),
        "header lies about its duration": (mkv_declaring(long_mkv, seconds=1), "longer than the limit of 20 s"),
        "16k-wide frame": (video_file(0.2, 10, 64, 16384, seed=3, container="mkv"), "16384x64 pixels exceed"),
        "audio-only": (audio_only_file(), "no video stream .*audio-only"),
        "too many sampled frames": (video_file(10, 10, 16, 16, seed=4), "samples to 20 frames .* limit is 8"),
    }


BAD_LIMITS = VideoLimits(max_seconds=20, max_frames=8, max_pixels_per_frame=1_000_000, decode_timeout_s=30)


def test_bad_files_are_refused_by_name_and_the_pool_keeps_decoding(tiny_models):
    pool = VideoDecodePool(FrameSampler(tiny_models["qwen2_vl"]), BAD_LIMITS, workers=1)
    good = video_file(3, 10, 32, 32, seed=7)
    try:
        for name, (data, message) in _bad_files().items():
            with pytest.raises(InvalidRequest, match=message):
                decode(pool, data)
            assert len(decode(pool, good).indices) == 6, f"after {name}"
        assert pool.stats.killed == 0 and pool.stats.refused == len(_bad_files())
    finally:
        pool.close()


def test_unsampled_frames_are_size_checked_too_and_decoding_stops_at_the_first_over(tiny_models):
    """A file whose frames between the sampled ones are 4000x4000 (16x the per-frame limit here)
    while its stream declares 32x32: refused at the first such frame, whether sampled or not."""
    sampler = FrameSampler(tiny_models["qwen2_vl"])
    small = mjpeg_mkv([(32, 32)] * 20)
    pool = VideoDecodePool(sampler, BAD_LIMITS, workers=1)
    try:
        indices = decode(pool, small).indices
        skipped = next(i for i in range(max(indices)) if i not in indices)  # decoded, not sampled
        sizes = [(32, 32)] * 20
        sizes[skipped] = (4000, 4000)
        with pytest.raises(InvalidRequest, match=f"video frame {skipped} is 4000x4000; the stream declares 32x32"):
            decode(pool, mjpeg_mkv(sizes))
        assert pool.stats.refused == 1 and len(decode(pool, small).indices) == len(indices)
    finally:
        pool.close()


@pytest.mark.parametrize("options", [SEQUENTIAL, DecodeOptions(), DecodeOptions(threads=4, segments=2)],
                         ids=["sequential", "default", "threads-segments"])
def test_a_streams_coded_size_is_checked_not_only_the_size_it_shows(options):
    """An H.264 stream whose SPS codes every frame at 1200x1200 (1.44x the per-frame limit here) and
    crops it to 32x32: the header, the stream and every frame say 32x32 while the decoder allocates
    1200x1200 a frame. The coded size is known only once the decoder has read the stream's parameters
    (PyAV's codec context says 0 before): refused at the first frame out, nothing more decoded."""
    data = h264_cropped((1200, 1200), (32, 32), frames=20)
    reader = ContainerReader(data, BAD_LIMITS)
    try:
        assert (reader.probe.width, reader.probe.height) == (32, 32)
        with pytest.raises(InvalidRequest, match="video frame 0 is coded at 1200x1200 pixels .*shown at 32x32.*"
                                                 "over the limit of 1000000 pixels per frame"):
            list(reader.decode(list(range(0, 20, 3)), options=options))
        assert reader.decoded <= 2  # the first frame out (a segment's thread may have put out its own)
    finally:
        reader.close()
    within = dataclasses.replace(BAD_LIMITS, max_pixels_per_frame=1200 * 1200)
    reader = ContainerReader(data, within)
    try:
        assert [g.shape for g in reader.decode([0, 19])] == [(2, 32, 32, 3)]
    finally:
        reader.close()
    # a frame at the limit that its codec pads to whole blocks (50x30 coded at 64x32) is not refused for it
    at_limit = dataclasses.replace(BAD_LIMITS, max_pixels_per_frame=50 * 30)
    reader = ContainerReader(video_file(0.5, 10, 30, 50, seed=6, container="mkv"), at_limit)
    try:
        assert [g.shape for g in reader.decode([0, 4], options=options)] == [(2, 30, 50, 3)]
    finally:
        reader.close()


def test_a_videos_sampled_pixels_are_bounded_before_decoding(tiny_models):
    data = video_file(3, 10, 32, 48, seed=5)  # samples to 6 frames of 48x32
    limits = dataclasses.replace(BAD_LIMITS, max_decoded_pixels=6 * 32 * 48 - 1)
    pool = VideoDecodePool(FrameSampler(tiny_models["qwen2_vl"]), limits, workers=1)
    try:
        with pytest.raises(InvalidRequest, match="6 frames of 48x32: 9216 decoded pixels, over the limit of 9215"):
            decode(pool, data)
    finally:
        pool.close()
    pool = VideoDecodePool(FrameSampler(tiny_models["qwen2_vl"]), dataclasses.replace(limits, max_decoded_pixels=9216),
                           workers=1)
    try:
        assert decode(pool, data).pixels.shape == (6, 32, 48, 3)
    finally:
        pool.close()


def test_a_decode_past_its_deadline_is_killed_and_the_next_gets_a_fresh_worker(tiny_models):
    pool = VideoDecodePool(FrameSampler(tiny_models["qwen2_vl"]), dataclasses.replace(BAD_LIMITS, decode_timeout_s=0.001),
                           workers=1)
    data = video_file(3, 10, 32, 32, seed=7)
    try:
        with pytest.raises(InvalidRequest, match="took longer than 0.001 s"):
            decode(pool, data)
        assert pool.stats.killed == 1 and not pool._idle
        pool.limits = BAD_LIMITS
        assert len(decode(pool, data).indices) == 6
    finally:
        pool.close()


def test_a_worker_that_dies_fails_only_its_request(tiny_models):
    pool = VideoDecodePool(FrameSampler(tiny_models["qwen2_vl"]), BAD_LIMITS, workers=1)
    worker = DecodeWorker()
    try:
        worker.proc.kill()
        worker.proc.wait()
        with pytest.raises(InvalidRequest, match=r"the decoder exited with code -9"):
            asyncio.run(pool._call(worker, ("probe", b"x", BAD_LIMITS), deadline=time.monotonic() + 60))
        assert pool.stats.killed == 1
        data = video_file(3, 10, 32, 32, seed=7)
        assert len(decode(pool, data).indices) == 6
        [idle] = pool._idle
        os.kill(idle.proc.pid, 9)  # a worker found dead between requests is replaced
        idle.proc.wait()
        assert len(decode(pool, data).indices) == 6
    finally:
        pool.close()


def test_without_pyav_a_video_file_gets_a_400_saying_how_to_enable_it(tiny_models, monkeypatch):
    import sys

    data = video_file(1, 10, 16, 16, seed=1)
    monkeypatch.setitem(sys.modules, "av", None)  # as if the `video` extra were not installed
    pool = VideoDecodePool(FrameSampler(tiny_models["qwen2_vl"]), BAD_LIMITS, workers=1)
    with pytest.raises(InvalidRequest, match=r"needs PyAV .* install mmserve\[video\]"):
        decode(pool, data)
    assert not pool._idle  # no worker was started


def test_a_cancelled_decode_kills_its_worker_and_the_pool_keeps_decoding(tiny_models):
    """A request that goes away mid-decode (client cancel) takes its busy worker with it, so no
    later video shares that worker's pipe with the abandoned call."""
    pool = VideoDecodePool(FrameSampler(tiny_models["qwen2_vl"]), BAD_LIMITS, workers=1)
    data = video_file(3, 10, 32, 32, seed=7)

    async def cancel_mid_decode():
        await pool.decode(data, "warm-up")
        [busy] = pool._idle
        task = asyncio.ensure_future(pool.decode(data, "cancelled"))
        while not pool._running:
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not busy.alive
        return await pool.decode(data, "next")

    try:
        assert len(asyncio.run(cancel_mid_decode()).indices) == 6
        assert not pool._running and pool.waiting == 0 and len(pool._idle) == 1
    finally:
        pool.close()


class _CountingPool:
    """A VideoDecodePool that counts the videos it decodes to pixels."""

    def __init__(self, pool: VideoDecodePool):
        self.pool, self.decoded = pool, 0

    async def probe(self, data: bytes, request_id: str, sampling=None, decode_below: int = 0):
        video = await self.pool.probe(data, request_id, sampling, decode_below)
        self.decoded += video.pixels is not None
        return video

    async def decode(self, data: bytes, request_id: str, sampling=None):
        self.decoded += 1
        return await self.pool.decode(data, request_id, sampling)


@pytest.mark.parametrize("stream", [False, True])
def test_a_requests_videos_are_bounded_together_before_any_is_decoded(tiny_models, stream):
    from deployments.config import LimitArgs
    from deployments.core.request_core import ChatRequest
    from mmserve.inputs.media import MediaSource
    from mmserve.request.prompt import Message
    from tests.support.core_fakes import make_core

    video = video_file(3, 10, 32, 48, seed=5)  # samples to 6 frames of 48x32: 9216 pixels
    per_video = 6 * 32 * 48
    limits = LimitArgs(max_decoded_pixels_per_video=per_video, max_decoded_pixels_per_request=2 * per_video + 1)
    pool = _CountingPool(VideoDecodePool(FrameSampler(tiny_models["qwen2_vl"]), limits.video_limits(), workers=2))
    core = make_core(tiny_models["qwen2_vl"], limits=limits, video_decode={"stream": stream})
    core.videos = pool

    def load(videos: int):
        parts = tuple(MediaSource(MediaKind.VIDEO, (video,), container=True) for _ in range(videos)) + ("what?",)
        return asyncio.run(core._load_media(ChatRequest((Message("user", parts),), None), "t"))

    try:
        assert len(load(2)[0].parts) == 3
        decoded = pool.decoded
        with pytest.raises(InvalidRequest, match=f"3 videos sample to {3 * per_video} decoded pixels together, "
                                                 f"over the limit of {2 * per_video + 1}"):
            load(3)
        assert pool.decoded == decoded  # refused from the headers, nothing decoded
    finally:
        pool.pool.close()
    with pytest.raises(ValueError, match="max_decoded_pixels_per_request .* < max_decoded_pixels_per_video"):
        LimitArgs(max_decoded_pixels_per_video=10, max_decoded_pixels_per_request=9)


def test_a_video_streams_only_from_stream_min_frames_and_plans_the_same_either_way(tiny_models):
    """`video_decode.stream_min_frames`, per request: a video sampling to fewer frames is decoded
    whole after its header (frames, no file: the router dispatches it as unstreamed), one sampling to
    as many or more goes on as a header (file, no frames: the LLM replica streams it); the prompt
    planned is the same token for token and position for position either way."""
    from deployments.config import LimitArgs
    from deployments.core.request_core import ChatRequest, StreamedVideo
    from mmserve.inputs.media import MediaSource
    from mmserve.request.prompt import Message
    from tests.support.core_fakes import make_core

    short, long = video_file(3, 10, 32, 48, seed=5), video_file(5, 10, 32, 48, seed=6)  # 6 and 10 sampled frames
    limits = LimitArgs()
    pool = _CountingPool(VideoDecodePool(FrameSampler(tiny_models["qwen2_vl"]), limits.video_limits(), workers=2))
    cores = {n: make_core(tiny_models["qwen2_vl"], limits=limits, video_decode={"stream_min_frames": n})
             for n in (1, 8, 100)}
    for core in cores.values():
        core.videos = pool

    def load(core, *videos):
        parts = tuple(MediaSource(MediaKind.VIDEO, (v,), container=True) for v in videos) + ("what?",)
        return [p for p in asyncio.run(core._load_media(ChatRequest((Message("user", parts),), None), "t"))[0].parts
                if isinstance(p, MediaItem)]

    def streamed(items) -> list[bool]:
        out = []
        for item, data in zip(items, (short, long)):
            assert (item.frames == (data,)) == (item.decoded.pixels is None)  # a file, or its frames
            out.append(item.decoded.pixels is None)
        return out

    try:
        assert cores[8].args.stream_video and cores[8].planner.face.streams_video
        decoded = pool.decoded
        assert streamed(load(cores[8], short, long)) == [False, True]  # 6 < 8 <= 10
        assert pool.decoded == decoded + 1  # only the short one decoded here
        assert streamed(load(cores[1], short, long)) == [True, True]
        assert streamed(load(cores[100], short, long)) == [False, False]
        assert pool.decoded == decoded + 3
        # a lone video: a short one decoded in the call that reads its header (one worker session)
        sessions = pool.pool.stats.decoded
        [item] = load(cores[8], short)
        assert item.frames == () and pool.pool.stats.decoded == sessions + 1
        assert np.array_equal(item.decoded.pixels, asyncio.run(pool.pool.decode(short, "whole")).pixels)
        sessions += 1
        [item] = load(cores[8], long)
        assert item.decoded.pixels is None and item.frames == (long,) and pool.pool.stats.decoded == sessions + 2
        plans = {n: cores[n].planner.plan([Message("user", (*load(core, short, long), "what?"))])
                 for n, core in cores.items()}
        for n in (8, 100):
            assert plans[n].token_ids == plans[1].token_ids and plans[n].ranges == plans[1].ranges
            length = len(plans[1].token_ids)
            assert torch.equal(plans[n].positions.positions(0, length), plans[1].positions.positions(0, length))
        # dispatched: the header-only item as a StreamedVideo, the decoded one to the encoders
        handles = asyncio.run(cores[8]._dispatch(plans[8].media))
        assert [isinstance(h, StreamedVideo) for h in handles] == [False, True]
    finally:
        pool.pool.close()
