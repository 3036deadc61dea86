"""Media items as the router, encoder and LLM share them.

The router reads only image headers (size, EXIF orientation): never pixels. A `MediaItem` carries
the raw bytes to the encoder; `PlaceholderRange` says where its embedding goes in the prompt.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import io
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

import numpy as np
from PIL import Image, UnidentifiedImageError

from mmserve.errors import InvalidRequest

# EXIF orientations 5-8 rotate by 90 degrees: width and height swap.
_TRANSPOSING_ORIENTATIONS = {5, 6, 7, 8}
_EXIF_ORIENTATION_TAG = 0x0112


class MediaKind(str, Enum):
    IMAGE = "image"
    VIDEO = "video"


class PlaceholderRange(NamedTuple):
    """The `length` prompt tokens of one media item starting at prompt index `offset`.

    `is_embed` says which of them take the item's encoder rows, in order (None: all of them);
    the others are structure tokens the family's expansion interleaves (newlines, `<slice>`).
    """

    offset: int
    length: int
    is_embed: tuple[bool, ...] | None = None

    @property
    def num_embeds(self) -> int:
        return self.length if self.is_embed is None else sum(self.is_embed)

    def embed_slots(self) -> list[int]:
        """Offsets (from `offset`) of the tokens that take encoder rows, ascending."""
        return list(range(self.length)) if self.is_embed is None else [i for i, e in enumerate(self.is_embed) if e]


@dataclass(frozen=True)
class AdapterRef:
    """A LoRA adapter by name and directory (`path`): the one an item is encoded under, when it
    targets the vision tower (`mmserve.lora.tower_media`)."""

    name: str
    path: str


@dataclass(frozen=True)
class EncodeItem:
    """A media item on its way to the encoder with what the router face computed from its header:
    the family's `layout` (the encoder face never re-reads headers) and its encoder `cost`."""

    item: MediaItem
    layout: object
    cost: int


@dataclass(frozen=True)
class MediaSource:
    """A media part as the client sent it, not loaded yet: each frame is a URL (`data:`,
    http(s), a local path) or already the encoded bytes (gRPC's `image`, `video.frames`).
    `container`: `frames` is one video file (mp4, webm, mkv, mov), decoded and sampled on the server."""

    kind: MediaKind
    frames: tuple[str | bytes, ...]
    fps: float = 2.0
    container: bool = False


@dataclass(frozen=True, eq=False)
class DecodedVideo:
    """A video file decoded on the server: the frames the model's own sampler picked, in order.

    `indices` are the sampled frame numbers and `fps`, `total_num_frames` the stream's, as
    `transformers`' `VideoMetadata` holds them; `shape` is (frames, height, width) of the frames
    kept; `content_hash` is of the file's bytes and the sampled indices (hashing the decoded
    pixels would cost more than decoding them). `pixels` is None in a video's header, whose
    frames are streamed group by group (`group`) once the request is planned."""

    shape: tuple[int, int, int]
    fps: float
    total_num_frames: int
    indices: tuple[int, ...]
    content_hash: str
    pixels: np.ndarray | None = None  # (frames, height, width, 3) uint8, RGB

    @property
    def duration(self) -> float:
        return self.total_num_frames / self.fps

    def with_pixels(self, pixels: np.ndarray) -> DecodedVideo:
        if tuple(pixels.shape[:3]) != self.shape:
            raise ValueError(f"frames of shape {pixels.shape} for a video of {self.shape}")
        return dataclasses.replace(self, pixels=pixels)

    def group(self, first: int, pixels: np.ndarray) -> DecodedVideo:
        """Frames `first..first + len(pixels)` of this video as a video of their own (what the
        encoder gets of a streamed video: its layout says the whole video's frame size)."""
        kept = sorted(set(self.indices))[first:first + len(pixels)]
        return DecodedVideo(tuple(pixels.shape[:3]), self.fps, self.total_num_frames, tuple(kept),
                            f"{self.content_hash}#{first}", pixels)

    def metadata(self) -> dict:
        """The `video_metadata` entry `transformers`' processors take for these frames."""
        _, height, width = self.shape
        return {"total_num_frames": self.total_num_frames, "fps": self.fps, "width": width, "height": height,
                "duration": self.duration, "video_backend": "pyav", "frames_indices": list(self.indices)}


@dataclass(frozen=True)
class MediaItem:
    """One image (one frame) or video as raw encoded bytes (frames in order, all used), or a
    video decoded on the server (`decoded`, no `frames`), or one streamed through the pipeline
    (`decoded` its header, without pixels; `frames` its file). `tower_adapter`: the LoRA adapter
    the vision tower applies to it (None: the base tower), folded into its content hash."""

    kind: MediaKind
    frames: tuple[bytes, ...]
    fps: float = 2.0
    decoded: DecodedVideo | None = None
    tower_adapter: AdapterRef | None = None

    @property
    def num_frames(self) -> int:
        return self.decoded.shape[0] if self.decoded is not None else len(self.frames)

    @property
    def sampled_fps(self) -> float:
        """Frames per second of the frames the model sees (`VideoMetadata.sampled_fps`)."""
        decoded = self.decoded
        return self.fps if decoded is None else len(decoded.indices) / decoded.total_num_frames * decoded.fps

    @property
    def frame_seconds(self) -> list[float]:
        """The time of each frame in the video, as the processors compute it (`VideoMetadata.timestamps`)."""
        if self.decoded is None:
            return [i / self.fps for i in range(len(self.frames))]
        return [i / self.decoded.fps for i in self.decoded.indices]

    def frame_size(self, max_pixels: int) -> tuple[int, int]:
        """(height, width) every frame shares, from headers only; InvalidRequest when unreadable,
        over `max_pixels` (a decoded video was checked by its decoder) or of mixed sizes."""
        if self.decoded is not None:
            return self.decoded.shape[1:]
        sizes = {read_image_size(frame, max_pixels) for frame in self.frames}
        if len(sizes) != 1:
            raise InvalidRequest(f"all frames of a video must have the same size, got {sorted(sizes)}")
        return sizes.pop()

    @property
    def content_hash(self) -> str:
        """The media's hash, with the tower adapter's name and path folded in when it has one."""
        media = self._media_hash()
        if self.tower_adapter is None:
            return media
        h = hashlib.sha256(media.encode())
        for part in ("lora", self.tower_adapter.name, self.tower_adapter.path):
            h.update(b"\0" + part.encode())
        return h.hexdigest()

    def _media_hash(self) -> str:
        if self.decoded is not None:
            return self.decoded.content_hash
        h = hashlib.sha256(self.kind.value.encode())
        h.update(repr(self.fps if self.kind is MediaKind.VIDEO else 0.0).encode())
        for frame in self.frames:
            h.update(len(frame).to_bytes(8, "little"))
            h.update(frame)
        return h.hexdigest()

    @property
    def num_bytes(self) -> int:
        if self.decoded is not None and self.decoded.pixels is not None:
            return self.decoded.pixels.nbytes
        return sum(len(f) for f in self.frames)


def _header_orientation(img: Image.Image) -> int:
    """EXIF orientation from metadata parsed with the header (never triggers a pixel decode).

    `Image.getexif()` would decode a whole PNG to look for an eXIf chunk after the pixel data;
    such (rare) files are treated as unrotated.
    """
    if not (raw := img.info.get("exif")):
        return 1
    exif = Image.Exif()
    exif.load(raw)
    return int(exif.get(_EXIF_ORIENTATION_TAG, 1) or 1)


def read_image_size(data: bytes, max_pixels: int) -> tuple[int, int]:
    """(height, width) as the processor will see it (EXIF orientation applied), from the header only.

    Raises `InvalidRequest` for bytes that are not an image and for images declaring more than
    `max_pixels` pixels: checked before anything is decoded (no decompression bombs).
    """
    try:
        with Image.open(io.BytesIO(data)) as img:
            width, height = img.size
            if width * height > max_pixels:
                raise InvalidRequest(f"image of {width}x{height} pixels exceeds the limit of {max_pixels} pixels")
            orientation = _header_orientation(img)
    except (InvalidRequest, MemoryError):
        raise
    except Image.DecompressionBombError as e:
        raise InvalidRequest(f"image exceeds the limit of {max_pixels} pixels: {e}") from None
    except UnidentifiedImageError:
        raise InvalidRequest("cannot read image: not a recognised image format") from None
    except Exception as e:  # Pillow's parsers raise many types (struct.error, EOFError, ...) on bad bytes
        raise InvalidRequest(f"cannot read image: {type(e).__name__}: {e}") from None
    if width < 1 or height < 1:
        raise InvalidRequest("image has zero width or height")
    if orientation in _TRANSPOSING_ORIENTATIONS:
        width, height = height, width
    return height, width


def decode_image(data: bytes) -> Image.Image:
    """Decode to RGB with the EXIF orientation applied, as `transformers.image_utils.load_image` does."""
    from PIL import ImageOps

    try:
        img = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
        img.load()
        return img.convert("RGB")
    except UnidentifiedImageError:
        raise InvalidRequest("cannot decode image: not a recognised image format") from None
    except MemoryError:
        raise
    except Exception as e:  # any parser error on untrusted bytes is the client's (see read_image_size)
        raise InvalidRequest(f"cannot decode image: {type(e).__name__}: {e}") from None


def decode_data_uri(url: str, max_bytes: int) -> bytes:
    """Bytes of a base64 `data:` URI (other URLs are the router's `deployments.media.fetch`)."""
    header, sep, payload = url.partition(",")
    header = header.lower()
    if not header.startswith("data:") or not sep:
        raise InvalidRequest("malformed data URI: expected data:<mime>;base64,<payload>")
    if not header.endswith(";base64"):
        raise InvalidRequest("data URI must be base64-encoded (data:<mime>;base64,...)")
    if len(payload) * 3 // 4 > max_bytes:
        raise InvalidRequest(f"media item larger than the limit of {max_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise InvalidRequest(f"invalid base64 in data URI: {e}") from None


def video_frames(item: MediaItem) -> np.ndarray | list[Image.Image]:
    """A video's frames as its processor takes them: the decoded array, or the frames decoded to
    RGB images (InvalidRequest when their sizes differ)."""
    if item.decoded is not None:
        return item.decoded.pixels
    frames = [decode_image(data) for data in item.frames]
    if len({f.size for f in frames}) != 1:
        raise InvalidRequest("all frames of a video must have the same size")
    return frames


def video_metadata(item: MediaItem) -> dict:
    """The `video_metadata` of a video item: a list of frames is frames 0..n-1 at `fps`."""
    if item.decoded is not None:
        return item.decoded.metadata()
    n = len(item.frames)
    return {"total_num_frames": n, "fps": item.fps, "frames_indices": list(range(n))}


def warm_up_image(size: int = 224) -> MediaItem:
    """A small synthetic image (a JPEG gradient) that the replicas and the router run through their
    real path before they say ready, so that a first request finds image decoding, the processor
    and the vision tower warm."""
    ramp = np.linspace(0, 255, size).astype(np.uint16)
    pixels = np.stack([np.add.outer(ramp, ramp) // 2, np.tile(ramp, (size, 1)), np.tile(ramp[:, None], (1, size))], -1)
    buf = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8), "RGB").save(buf, format="JPEG", quality=90)
    return MediaItem(MediaKind.IMAGE, (buf.getvalue(),))
