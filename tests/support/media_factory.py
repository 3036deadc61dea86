"""Deterministic test media: encoded image bytes, data URIs, videos as frame lists."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from mmserve.loadgen.dataset import data_uri, image_bytes  # noqa: F401 - the benches send the same images


def video_frames(num_frames: int, height: int, width: int, seed: int) -> list[bytes]:
    return [image_bytes(height, width, seed * 1000 + i) for i in range(num_frames)]


def png_claiming(width: int, height: int) -> bytes:
    """A small PNG whose header claims `width` x `height` pixels (pixel data: a few bytes)."""
    import struct
    import zlib

    def chunk(kind: bytes, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")


VIDEO_FORMATS = {  # container -> (PyAV format, video codec, audio codec, file suffix)
    "mp4": ("mp4", "libx264", "aac", ".mp4"),
    "mov": ("mov", "libx264", "aac", ".mov"),
    "mkv": ("matroska", "libx264", "aac", ".mkv"),
    "webm": ("webm", "libvpx-vp9", "libopus", ".webm"),
}


def video_file(seconds: float, fps: int, height: int, width: int, seed: int, container: str = "mp4",
               audio: bool = True, codec: str | None = None, options: dict[str, str] | None = None) -> bytes:
    """A video file made with PyAV: smooth moving colours (so frames differ), optionally a silent
    audio track; `seconds * fps` frames. `codec` and its encoder `options` replace the container's
    usual video encoder."""
    import av

    fmt, usual, audio_codec, _ = VIDEO_FORMATS[container]
    codec = codec or usual
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 255, (max(2, height // 8), max(2, width // 8), 3), dtype=np.uint8)
    start = np.asarray(Image.fromarray(base).resize((width, height), Image.BILINEAR), dtype=np.int16)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=fmt) as out:
        stream = out.add_stream(codec, rate=fps, options=options or {})
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        sound = out.add_stream(audio_codec, rate=48000) if audio else None
        for i in range(round(seconds * fps)):
            pixels = ((start + 7 * i) % 256).astype(np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                out.mux(packet)
        out.mux(stream.encode())
        if sound is not None:
            _silent_audio(out, sound, seconds)
    return buf.getvalue()


def audio_only_file(seconds: float = 1.0) -> bytes:
    """An mp4 holding one silent AAC track and no video."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        _silent_audio(out, out.add_stream("aac", rate=48000), seconds)
    return buf.getvalue()


def _silent_audio(out, stream, seconds: float) -> None:
    import av

    step = 960  # 20 ms: a frame size every audio encoder here takes
    for start in range(0, int(seconds * 48000), step):
        frame = av.AudioFrame.from_ndarray(np.zeros((1, step), dtype=np.float32), format="fltp", layout="mono")
        frame.sample_rate, frame.pts = 48000, start
        for packet in stream.encode(frame):
            out.mux(packet)
    out.mux(stream.encode())


def mjpeg_mkv(sizes: list[tuple[int, int]], fps: int = 10) -> bytes:
    """A Matroska file of Motion-JPEG frames, frame i of `sizes[i]` (height, width) pixels: each
    packet is a JPEG of its own size, while the stream declares the first frame's."""
    from fractions import Fraction

    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="matroska") as out:
        stream = out.add_stream("mjpeg", rate=fps)
        stream.height, stream.width = sizes[0]
        stream.pix_fmt = "yuvj420p"
        for i, (h, w) in enumerate(sizes):
            jpeg = io.BytesIO()
            Image.fromarray(np.full((h, w, 3), (40 * i) % 256, np.uint8)).save(jpeg, format="JPEG")
            packet = av.Packet(jpeg.getvalue())
            packet.stream, packet.pts, packet.dts, packet.time_base = stream, i, i, Fraction(1, fps)
            packet.is_keyframe = True
            out.mux(packet)
    return buf.getvalue()


def h264_cropped(coded: tuple[int, int], shown: tuple[int, int], frames: int = 20, fps: int = 10,
                 keyint: int = 5) -> bytes:
    """A Matroska file of H.264 frames coded at `coded` (height, width) pixels whose SPS crops each
    to `shown` (x264's crop-rect): the container, the stream and every decoded frame say `shown`,
    while the decoder allocates `coded` for each. A keyframe every `keyint` frames (closed GOPs)."""
    import av

    (h, w), (sh, sw) = coded, shown
    params = f"crop-rect=0,0,{w - sw},{h - sh}:keyint={keyint}:min-keyint={keyint}:scenecut=0"
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="matroska") as out:
        stream = out.add_stream("libx264", rate=fps, options={"x264-params": params, "preset": "ultrafast"})
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        for i in range(frames):
            pixels = np.full((h, w, 3), (40 * i) % 256, np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                out.mux(packet)
        out.mux(stream.encode())
    return buf.getvalue()


def mkv_declaring(data: bytes, seconds: float | None = None, codec_id: bytes | None = None) -> bytes:
    """A Matroska file from `video_file(..., container="mkv")` whose header declares another
    duration (the Segment Info's Duration, in ms) or another video CodecID (same length)."""
    import struct

    if seconds is not None:
        at = data.index(b"\x44\x89\x88") + 3  # Duration: 8-byte float
        data = data[:at] + struct.pack(">d", seconds * 1000.0) + data[at + 8:]
    if codec_id is not None:
        old = b"V_MPEG4/ISO/AVC"
        assert len(codec_id) == len(old)
        data = data.replace(old, codec_id, 1)
    return data
