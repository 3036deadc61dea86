"""Segment-parallel decoding (`DecodeOptions.segments`): a clip split at its closed GOPs' keyframes,
the segments decoded at once in threads, each from its keyframe, gives the sampled frames of the
sequential decode bit for bit, for the codecs and containers of tests/unit/test_video_decode.py;
open-GOP streams, and segments whose frames are not where the probe said, decode in one pass and are
counted; a clip with one keyframe is one segment, decoded as before."""

import asyncio
import dataclasses
import os
import threading

import numpy as np
import pytest

from mmserve.video import container as video_container
from mmserve.video.container import SEQUENTIAL, ContainerReader, DecodeOptions, VideoLimits, _split_points
from mmserve.video.workers import VideoDecodePool
from tests.support.media_factory import video_file
from tests.unit.test_video_decode import CODECS, FRAMES, PICKS, X264, _encoded

av = pytest.importorskip("av")  # the `video` extra: scripts/setup installs it

OPEN_GOP = ("h264-open-gop-mp4", "hevc-open-gop-mp4")
# every GOP of 12 frames sampled, and two far apart (the GOPs between them not decoded at all)
SPLIT_PICKS = {**PICKS, "two GOPs apart": [3, 40]}
SEGMENTED = (DecodeOptions(threads=1, segments=2), DecodeOptions(threads=4, segments=3),
             DecodeOptions(threads=2, skip_unsampled=False, segments=4))


@pytest.fixture(autouse=True)
def four_cores(monkeypatch):
    """Segments run at once up to the cores: 4 here, whatever this machine has."""
    monkeypatch.setattr(video_container, "_cores", lambda: 4)


def _decode(data: bytes, indices: list[int], options: DecodeOptions, probe_change: dict | None = None):
    """(frames, the reader after it), the frames in groups of 4 as the workers send them."""
    reader = ContainerReader(data, VideoLimits())
    if probe_change:
        reader.probe = dataclasses.replace(reader.probe, **probe_change)
    try:
        return np.concatenate(list(reader.decode(indices, 4, options))), reader
    finally:
        reader.close()


@pytest.mark.parametrize("name", [name for name in CODECS if name not in OPEN_GOP])
def test_segment_parallel_decode_equals_the_sequential_decode_bit_for_bit(name):
    data = _encoded(name)
    for pick, indices in SPLIT_PICKS.items():
        plain, sequential = _decode(data, indices, SEQUENTIAL)
        _, one_pass = _decode(data, indices, DecodeOptions(threads=2))
        for options in SEGMENTED:
            frames, reader = _decode(data, indices, options)
            assert np.array_equal(frames, plain), (name, pick, options)
            assert reader.probe.splits == (12, 24, 36) and not reader.probe.open_keys
            split = len({k // 12 for k in indices}) > 1  # sampled frames in more than one GOP
            assert reader.segments == (min(options.segments, len({k // 12 for k in indices})) if split else 0)
            assert not reader.segment_fell_back
            assert reader.decoded <= sequential.decoded
        if pick == "two GOPs apart":  # the GOPs between are skipped: 4 + 5 frames at most (41 in one pass)
            assert reader.decoded <= 9 < one_pass.decoded


@pytest.mark.parametrize("name", OPEN_GOP)
def test_an_open_gop_stream_is_decoded_in_one_pass_and_says_so(name):
    data = _encoded(name)
    for pick, indices in SPLIT_PICKS.items():
        plain, _ = _decode(data, indices, SEQUENTIAL)
        frames, reader = _decode(data, indices, DecodeOptions(threads=2, segments=2))
        assert np.array_equal(frames, plain), (name, pick)
        assert not reader.probe.splits and reader.probe.open_keys == (12, 24, 36)
        assert reader.segments == 0
        assert reader.segment_fell_back == (len({k // 12 for k in indices}) > 1), pick  # one GOP: nothing to split


def test_segments_whose_frames_are_not_where_the_probe_said_fall_back_to_one_pass():
    data = _encoded("h264-mp4")
    indices = PICKS["2 fps"]
    plain, _ = _decode(data, indices, SEQUENTIAL)
    reader = ContainerReader(data, VideoLimits())
    shifted = tuple(p + 1 for p in reader.probe.pts)  # timestamps that match no frame: no keyframe found
    reader.close()
    frames, reader = _decode(data, indices, DecodeOptions(threads=2, segments=2), {"pts": shifted})
    assert np.array_equal(frames, plain)
    assert reader.segment_fell_back and reader.fell_back and reader.segments == 0


def test_a_clip_with_a_single_keyframe_is_one_segment_decoded_as_before():
    data = video_file(FRAMES / 24, 24, 64, 96, seed=7, container="mp4", audio=False, codec="libx264",
                      options={"x264-params": X264.replace("keyint=12:min-keyint=12", "keyint=100:min-keyint=100")})
    for pick, indices in PICKS.items():
        plain, sequential = _decode(data, indices, SEQUENTIAL)
        before, one_pass = _decode(data, indices, DecodeOptions(threads=2))
        frames, reader = _decode(data, indices, DecodeOptions(threads=2, segments=2))
        assert reader.probe.splits == () and reader.probe.open_keys == ()
        assert np.array_equal(frames, plain) and np.array_equal(before, plain)
        assert reader.segments == 0 and not reader.segment_fell_back and reader.decoded == one_pass.decoded


def test_a_decode_left_early_stops_its_segments():
    data = _encoded("h264-mkv")
    reader = ContainerReader(data, VideoLimits())
    groups = reader.decode(list(range(FRAMES)), 2, DecodeOptions(threads=2, segments=4))
    assert next(groups).shape == (2, 64, 96, 3) and reader.segments == 4
    groups.close()
    reader.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("video-segment-")]


def test_split_points_are_the_keyframes_with_every_frame_on_its_side():
    # decode order: I0 P3 B1 B2 | I4 P7 B5 B6 (closed); then an open GOP: I10 with leading B8 B9
    pts = [0, 3, 1, 2, 4, 7, 5, 6, 10, 8, 9, 11]
    assert _split_points(pts, tuple(sorted(pts)), [0, 4, 8]) == ((4,), (10,))
    assert _split_points([0, 1, 2, 3], (0, 1, 2, 3), [0]) == ((), ())


class _FixedSampler:
    """The sampled frames, whatever the video (no checkpoint needed)."""

    def __init__(self, indices):
        self.picked = list(indices)

    def indices(self, probe, sampling=None):
        return self.picked


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="segments run at once up to the worker's cores")
@pytest.mark.parametrize("name", ["h264-mp4", "h264-open-gop-mp4"])
def test_the_pool_counts_segmented_decodes_and_their_fallbacks(name):
    data = _encoded(name)
    plain, _ = _decode(data, PICKS["2 fps"], SEQUENTIAL)
    pool = VideoDecodePool(_FixedSampler(PICKS["2 fps"]), VideoLimits(), 1, DecodeOptions(threads=2, segments=2))
    try:
        video = asyncio.run(pool.decode(data, "test"))
        streamed = asyncio.run(_streamed(pool, data))
    finally:
        pool.close()
    assert np.array_equal(video.pixels, plain) and np.array_equal(streamed, plain)
    opened = name in OPEN_GOP
    assert (pool.stats.segmented, pool.stats.segment_fallbacks) == ((0, 2) if opened else (2, 0))


async def _streamed(pool: VideoDecodePool, data: bytes) -> np.ndarray:
    return np.concatenate([group async for group in pool.frames(data, "test", 3)])
