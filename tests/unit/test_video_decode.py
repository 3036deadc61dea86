"""Threaded and skipping decodes give the sampled frames of the plain decode bit for bit
(`mmserve.video.container.DecodeOptions`), for every codec and container the installed PyAV wheel
encodes here: H.264 in mp4, mkv and mov (B-frames, closed and open GOPs), VP9 in webm (hidden
alt-ref frames), HEVC in mp4 and mkv (B-frames, open and closed GOPs), AV1 in mkv and mp4."""

import dataclasses

import numpy as np
import pytest

from mmserve.video.container import SEQUENTIAL, ContainerReader, DecodeOptions, VideoLimits
from tests.support.media_factory import video_file

av = pytest.importorskip("av")  # the `video` extra: scripts/setup installs it

X264 = "keyint=12:min-keyint=12:scenecut=0:bframes=3:b-adapt=0:b-pyramid=normal:slices=1"
X265 = "keyint=12:min-keyint=12:scenecut=0:bframes=4:b-adapt=0:log-level=error"
# name -> (container, encoder, encoder options)
CODECS = {
    "h264-mp4": ("mp4", "libx264", {"x264-params": X264}),
    "h264-mkv": ("mkv", "libx264", {"x264-params": X264}),
    "h264-mov": ("mov", "libx264", {"x264-params": X264}),
    "h264-open-gop-mp4": ("mp4", "libx264", {"x264-params": X264 + ":open-gop=1"}),
    "vp9-webm": ("webm", "libvpx-vp9", {"g": "12", "deadline": "realtime", "cpu-used": "8", "lag-in-frames": "16",
                                        "auto-alt-ref": "1"}),
    "hevc-open-gop-mp4": ("mp4", "libx265", {"preset": "ultrafast", "x265-params": X265 + ":open-gop=1"}),
    "hevc-mkv": ("mkv", "libx265", {"preset": "ultrafast", "x265-params": X265 + ":open-gop=0"}),
    "av1-mkv": ("mkv", "libsvtav1", {"preset": "12", "g": "12"}),
    "av1-mp4": ("mp4", "libsvtav1", {"preset": "12", "g": "12"}),
}
FRAMES = 48  # 2 s at 24 fps
PICKS = {"2 fps": list(range(0, FRAMES, 12)), "odd, to mid-stream": [1, 5, 6, 19, 30],
         "every frame": list(range(FRAMES)), "the last": [FRAMES - 1]}
FAST = (DecodeOptions(threads=2, skip_unsampled=False), DecodeOptions(threads=1, skip_unsampled=True),
        DecodeOptions(threads=3, skip_unsampled=True))


def _encoded(name: str) -> bytes:
    container, codec, options = CODECS[name]
    try:
        av.codec.Codec(codec, "w")
    except av.codec.codec.UnknownCodecError:
        pytest.skip(f"this PyAV wheel has no {codec} encoder")
    return video_file(FRAMES / 24, 24, 64, 96, seed=7, container=container, audio=False, codec=codec, options=options)


def _decode(data: bytes, indices: list[int], options: DecodeOptions, pts_shift: int = 0,
            fell_back: bool = False) -> tuple[np.ndarray, int]:
    reader = ContainerReader(data, VideoLimits())
    if pts_shift:  # timestamps that match no frame: the decode must notice and fall back
        reader.probe = dataclasses.replace(reader.probe, pts=tuple(p + pts_shift for p in reader.probe.pts))
    try:
        frames = np.concatenate(list(reader.decode(indices, 4, options)))
        assert reader.fell_back == fell_back
        return frames, reader.decoded
    finally:
        reader.close()


@pytest.mark.parametrize("name", CODECS)
def test_threaded_and_skipping_decodes_equal_the_plain_decode_bit_for_bit(name):
    data = _encoded(name)
    for pick, indices in PICKS.items():
        plain, decoded = _decode(data, indices, SEQUENTIAL)
        assert plain.shape == (len(indices), 64, 96, 3)
        for options in FAST:
            frames, skipping = _decode(data, indices, options)
            assert np.array_equal(frames, plain), (name, pick, options)
            assert skipping <= decoded


@pytest.mark.parametrize("name", ["h264-mp4", "hevc-mkv"])
def test_skipping_leaves_unreferenced_b_frames_undecoded(name):
    data = _encoded(name)
    _, plain = _decode(data, PICKS["2 fps"], SEQUENTIAL)
    _, skipping = _decode(data, PICKS["2 fps"], DecodeOptions(threads=2, skip_unsampled=True))
    assert skipping < 0.8 * plain


def test_frames_off_their_timestamps_fall_back_to_the_plain_decode():
    data = _encoded("h264-mp4")
    plain, decoded = _decode(data, PICKS["odd, to mid-stream"], SEQUENTIAL)
    frames, fallback = _decode(data, PICKS["odd, to mid-stream"], DecodeOptions(threads=2), pts_shift=1,
                               fell_back=True)
    assert np.array_equal(frames, plain) and fallback == decoded
