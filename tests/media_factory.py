"""Deterministic test media: encoded image bytes, data URIs, videos as frame lists."""

from __future__ import annotations

import base64
import io

import numpy as np
from PIL import Image


def image_bytes(height: int, width: int, seed: int, fmt: str = "PNG", exif_orientation: int | None = None) -> bytes:
    rng = np.random.default_rng(seed)
    # smooth-ish content so JPEG round trips stay meaningful
    base = rng.integers(0, 255, (max(2, height // 8), max(2, width // 8), 3), dtype=np.uint8)
    img = Image.fromarray(base).resize((width, height), Image.BILINEAR)
    buf = io.BytesIO()
    if exif_orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = exif_orientation
        img.save(buf, fmt, exif=exif)
    else:
        img.save(buf, fmt)
    return buf.getvalue()


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


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
