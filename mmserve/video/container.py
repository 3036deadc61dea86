"""Video files -> the frames a model samples, decoded with PyAV (the `mmserve[video]` extra).

`ContainerReader` does what `transformers.video_utils.read_video_pyav` does for one file, with
every limit checked before the work it bounds:

1. open the container (mp4, mov, webm, mkv only) and its first video stream; check the frame
   size and the duration the header declares (a 10-hour file is refused here, nothing decoded);
2. count the stream's packets, never past the duration limit, so a header that lies about the
   duration (or a truncated file) is found before anything is decoded. The frame count is the
   header's when it has one (as `transformers` reads it), else the count; the two must agree, and
   the stream must not fall short of the declared duration by more than `TRUNCATED_SHARE`;
3. the model's sampler (`FrameSampler`: the checkpoint's own `video_processor.sample_frames`)
   picks frame indices from that metadata, in the parent;
4. decode up to the last picked frame, keeping the picked ones in decode order (as
   `transformers` does), each converted to RGB `uint8` at once. Every decoded frame, picked or
   not, must have the stream's declared size (so a file whose unpicked frames are huge stops at
   the first) and be coded within the per-frame limit (a stream that crops frames coded far larger
   than it shows stops at its first frame), and the picked frames' pixels together are bounded
   (`max_decoded_pixels`) before any is decoded.

How step 4 decodes (`DecodeOptions`: FFmpeg's threads, skipping unsampled frames, GOP segments decoded
at once) is docs/video.md#decoding-fast; the sampled frames are bit-identical whatever the options.

Steps 1-2 and 4 run in a worker process (`mmserve.video.workers`), under a deadline, so a decoder
that hangs or crashes on a hostile file takes only its own request down.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import inspect
import io
import itertools
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mmserve.errors import InvalidRequest
from mmserve.settings import check_fields, setting

CONTAINERS = ("mp4", "mov", "matroska", "webm")  # names in FFmpeg's demuxer list ("mov,mp4,m4a,...")
PYAV_MISSING = "video_url needs PyAV on the server: install mmserve[video] (pip install 'mmserve[video]')"
# Qwen2-VL's processors sample at the rate the family was trained with (qwen-vl-utils' FPS) when
# their config names neither fps nor num_frames (their sampler would then keep every frame).
DEFAULT_SAMPLE_FPS = 2.0
MAX_STREAM_FPS = 1000.0
# A stream this much shorter than its header's duration (and at least 1 s) is a truncated file; a
# container's duration also covers its audio, which may run a little longer than the video.
TRUNCATED_SHARE = 0.25


def pyav_available() -> bool:
    try:
        import av  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class VideoLimits:
    """What one video may cost; each is checked before the work it bounds (settings of the app's
    `limits`, under their names there: `mmserve.settings`)."""

    max_seconds: float = setting(600.0, "video_url: longest video, by its header and by its stream",
                                 name="max_video_seconds", gt=0)
    max_frames: int = setting(64, name="max_frames_per_video", ge=1)  # sampled frames (what the encoder gets)
    max_pixels_per_frame: int = setting(3840 * 2160, "video_url: pixels (width x height) of every decoded frame",
                                        name="max_pixels_per_video_frame", ge=1)
    decode_timeout_s: float = setting(60.0, "video_url: one video's decode, waiting for a decoder included; past "
                                      "it the decoding worker is killed and the request refused (400)",
                                      name="video_decode_timeout_s", gt=0)
    max_decoded_pixels: int = setting(
        64 * 1920 * 1080, "video_url: pixels of a video's sampled frames together, before the processor resizes "
        "them (3 bytes each decoded: the default, 64 frames of 1080p, is ~400 MB; a 4K clip samples to at most "
        "16); checked before decoding", name="max_decoded_pixels_per_video", ge=1)

    def __post_init__(self):
        check_fields(self)


@dataclass(frozen=True)
class DecodeOptions:
    """How a worker decodes a video's frames (the sampled frames are the same bit for bit)."""

    threads: int = 1  # FFmpeg threads for one video (frame threading); 1: the calling thread only
    skip_unsampled: bool = True  # frames neither sampled nor referenced are not decoded
    # segments of the clip (split at keyframes) decoded at once, each in a thread of its own from its
    # keyframe, sharing `threads` (each segment's decoder gets threads // segments, at least 1); 1: off
    segments: int = 1

    def usable_threads(self) -> int:
        return max(1, min(self.threads, _cores()))

    def usable_segments(self) -> int:
        return max(1, min(self.segments, _cores()))


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


SEQUENTIAL = DecodeOptions(threads=1, skip_unsampled=False)  # one thread, every frame up to the last sampled


class _Unaligned(Exception):
    """A frame came out of the decoder out of its timestamps' order (or one it dropped itself)."""


class _Stopped(Exception):
    """A segment's decode was told to stop (the video's decode ended or fell back)."""


@dataclass(frozen=True)
class VideoProbe:
    """A video stream as its container declares it, with the frame count checked by demuxing."""

    total_num_frames: int
    fps: float
    width: int
    height: int
    codec: str
    # the video packets' pts, ascending: the display-order frame k has the k-th; () where a packet
    # has none or two share one (then nothing is skipped)
    pts: tuple[int, ...] = ()
    # display positions of the keyframes the stream can be split at (each frame before one is
    # decoded before it, each after it after it: a closed GOP begins there), `pts` permitting
    splits: tuple[int, ...] = ()
    # display positions of the keyframes (past the first packet) with frames on the wrong side of
    # them: an open GOP's, whose leading frames refer to the GOP before (the stream is not split)
    open_keys: tuple[int, ...] = ()

    @property
    def duration(self) -> float:
        return self.total_num_frames / self.fps  # as `read_video_pyav` computes it


@dataclass(frozen=True)
class VideoSampling:
    """A request's own sampling of its video files, as vLLM's `mm_processor_kwargs` carries it to the
    processor's `sample_frames`: `fps` or `num_frames` (None: the model's own)."""

    fps: float | None = None
    num_frames: int | None = None

    def check(self, max_frames: int) -> None:
        """InvalidRequest naming the field when a value is out of range (`max_frames`: max_frames_per_video)."""
        if self.fps is not None and self.num_frames is not None:
            raise InvalidRequest("mm_processor_kwargs: fps and num_frames are mutually exclusive; send one")
        if self.fps is not None and not 0 < self.fps <= MAX_STREAM_FPS:
            raise InvalidRequest(f"mm_processor_kwargs.fps must be in (0, {MAX_STREAM_FPS:g}]; got {self.fps:g}")
        if self.num_frames is not None and not 1 <= self.num_frames <= max_frames:
            raise InvalidRequest(f"mm_processor_kwargs.num_frames must be in [1, {max_frames}] "
                                 f"(max_frames_per_video); got {self.num_frames}")

    def kwargs(self) -> dict:
        return {k: v for k, v in (("fps", self.fps), ("num_frames", self.num_frames)) if v is not None}


def video_content_hash(data: bytes, indices) -> str:
    """The embedding cache's key of a decoded video: its file and the frames sampled from it."""
    h = hashlib.sha256(b"video-file\0")
    h.update(data)
    h.update(np.asarray(indices, dtype=np.int64).tobytes())
    return h.hexdigest()


class ContainerReader:
    """One video file, opened and checked (`probe`), then decoded at chosen frames (`decode`)."""

    def __init__(self, data: bytes, limits: VideoLimits):
        import av

        if not data:
            raise InvalidRequest("video is empty (0 bytes)")
        self.limits = limits
        self.decoded = 0  # frames the decoder put out (skipped ones are not)
        self.fell_back = False  # skipping was given up for the plain decode (`_picked`)
        self.segment_fell_back = False  # a segmented decode was given up for the one-pass decode
        self.segments = 0  # segments decoded at once (0: one pass from the stream's start)
        self.data = data
        try:
            self.container = av.open(io.BytesIO(data), mode="r")
        except av.error.FFmpegError as e:
            raise InvalidRequest(f"cannot read video: not a recognised or complete container ({_reason(e)})") from None
        try:
            self.probe = self._probe()
        except BaseException:
            self.close()
            raise

    def _probe(self) -> VideoProbe:
        container = self.container
        if not set(container.format.name.split(",")) & set(CONTAINERS):
            raise InvalidRequest(f"unsupported video container {container.format.name!r}; send mp4, webm, mkv or mov")
        if not container.streams.video:
            what = "an audio-only file" if container.streams.audio else "no video stream"
            raise InvalidRequest(f"video has no video stream ({what})")
        stream = container.streams.video[0]
        codec = _codec_name(stream)
        width, height = int(stream.width or 0), int(stream.height or 0)
        if width < 1 or height < 1:
            raise InvalidRequest(f"video stream ({codec}) declares no frame size")
        if width * height > self.limits.max_pixels_per_frame:
            raise InvalidRequest(f"video frames of {width}x{height} pixels exceed the limit of "
                                 f"{self.limits.max_pixels_per_frame} pixels per frame")
        fps = float(stream.average_rate or 0)  # what `transformers` uses
        if not 0 < fps <= MAX_STREAM_FPS:
            raise InvalidRequest(f"video stream declares a frame rate of {fps:g} fps; it must be in (0, {MAX_STREAM_FPS:g}]")
        declared = _declared_seconds(stream, container)
        if declared is not None and declared > self.limits.max_seconds:
            raise InvalidRequest(f"video is {declared:.1f} s long; the limit is {self.limits.max_seconds:g} s")
        counted, pts, splits, open_keys = self._count_frames(stream, fps)
        if (header := int(stream.frames or 0)) and header != counted:
            raise InvalidRequest(f"video is truncated or inconsistent: its header declares {header} frames, "
                                 f"its stream holds {counted}")
        if counted == 0:
            raise InvalidRequest("video stream holds no frames")
        if declared is not None and declared - counted / fps > max(1.0, TRUNCATED_SHARE * declared):
            raise InvalidRequest(f"video is truncated: its header declares {declared:.1f} s, its stream holds "
                                 f"{counted / fps:.1f} s")
        return VideoProbe(header or counted, fps, width, height, codec, pts, splits, open_keys)

    def _count_frames(self, stream, fps: float) -> tuple[int, tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """Packets of the stream, counted no further than the duration limit allows, their pts in
        ascending order (() where one has none or two share one), and where the stream splits at
        keyframes (`VideoProbe.splits`, `open_keys`)."""
        import av

        cap = math.floor(self.limits.max_seconds * fps) + 1
        count = 0
        pts: list[int | None] = []
        keys: list[int] = []  # decode positions of the keyframe packets
        try:
            for packet in self.container.demux(stream):
                if packet.size == 0:  # the demuxer's flush packet
                    continue
                count += 1
                if packet.is_keyframe:
                    keys.append(count - 1)
                pts.append(packet.pts)
                if count > cap:
                    raise InvalidRequest(f"video is longer than the limit of {self.limits.max_seconds:g} s "
                                         f"(more than {cap - 1} frames at {fps:g} fps), whatever its header says")
        except av.error.FFmpegError as e:
            raise InvalidRequest(f"video is truncated or corrupt after {count} frames ({_reason(e)})") from None
        if None in pts or len(set(pts)) != count:
            return count, (), (), ()
        ordered = tuple(sorted(pts))
        return count, ordered, *_split_points(pts, ordered, keys)

    def decode(self, indices: list[int], group_size: int = 0, options: DecodeOptions = SEQUENTIAL
               ) -> Iterator[np.ndarray]:
        """The frames at `indices` in decode order (each frame once, as `transformers` keeps them),
        (frames, height, width, 3) uint8 RGB, in groups of `group_size` frames as they are decoded
        (0: all in one), decoded as `options` says."""
        probe = self.probe
        if not indices:
            raise InvalidRequest("the model's sampler picked no frames of this video")
        if min(indices) < 0 or max(indices) >= probe.total_num_frames:
            raise InvalidRequest(f"sampled frame indices fall outside the video's {probe.total_num_frames} frames")
        wanted, end = set(indices), max(indices)
        group_size = group_size or len(wanted)
        if (threads := options.usable_threads()) > 1:  # before the decoder opens (its first packet)
            context = self.container.streams.video[0].codec_context
            context.thread_type, context.thread_count = "AUTO", threads
        skip = options.skip_unsampled and len(probe.pts) == probe.total_num_frames
        chunks = self._chunks(wanted, options.usable_segments())
        picked = (self._segmented(chunks, wanted, end, skip, max(1, threads // len(chunks))) if len(chunks) > 1
                  else self._picked(wanted, end, skip))
        while group := list(itertools.islice(picked, group_size)):
            yield np.stack(group)

    def _picked(self, wanted: set[int], end: int, skip: bool) -> Iterator[np.ndarray]:
        """The picked frames, RGB, in order; by their timestamps when `skip`, falling back to the
        plain decode when the decoder's frames do not follow them (before any frame was picked)."""
        if not skip:
            yield from self._in_order(wanted, end)
            return
        picked = 0
        try:
            for _, frame in self._by_pts(wanted, end):
                picked += 1
                yield frame
        except _Unaligned:
            if picked:
                raise InvalidRequest("video frames do not come out of the decoder in the order of their "
                                     "timestamps") from None
            self.container.streams.video[0].codec_context.skip_frame = "DEFAULT"
            self.fell_back = True
            yield from self._in_order(wanted, end)

    def _in_order(self, wanted: set[int], end: int) -> Iterator[np.ndarray]:
        """Every frame up to `end`, counted as they come out of the decoder (`read_video_pyav`)."""
        import av

        i = -1
        try:
            self.container.seek(0)
            context = self.container.streams.video[0].codec_context
            for i, frame in enumerate(self.container.decode(video=0)):
                if i > end:
                    break
                self.decoded += 1
                self._check_size(i, frame, context)
                if i in wanted:
                    yield frame.to_ndarray(format="rgb24")
        except av.error.FFmpegError as e:
            raise InvalidRequest(f"cannot decode video ({self.probe.codec}) at frame {i + 1}: {_reason(e)}") from None
        if i < end:
            raise InvalidRequest(f"video is truncated: {i + 1} of its {self.probe.total_num_frames} frames decode")

    def _by_pts(self, wanted: set[int], end: int, container=None, start: int = 0, skip: bool = True, stop=None,
                tally: list[int] | None = None) -> Iterator[tuple[int, np.ndarray]]:
        """(position, RGB frame) of the picked frames found by pts, each packet of an unpicked frame
        handed to the decoder with `skip_frame = NONREF` when `skip` (decoded only if another frame
        refers to it). Nothing is skipped until the first frame came out; a frame out of order, or a
        gap not made of skipped packets, raises `_Unaligned`. `container` (else the reader's own) is
        decoded from the stream's start, or with `start` from that keyframe (`VideoProbe.splits`),
        whose packet must come first and its frame first out; `stop` (an Event) set ends it
        (`_Stopped`), `tally` counts the frames decoded (else `decoded`)."""
        import av

        container = container or self.container
        pts = self.probe.pts
        position = {p: k for k, p in enumerate(pts)}
        wanted_pts = {pts[k] for k in wanted}
        stream = container.streams.video[0]
        context = stream.codec_context
        skipped: set[int] = set()  # positions handed to the decoder as skippable
        after, skipping = start, False  # the next position expected out; whether skipping has begun
        key = pts[start] if start else None  # packets before the keyframe's are not decoded
        try:
            if key is None:
                container.seek(0)
            else:
                try:  # to its keyframe or one before it (mp4 seeks by dts); the packets up to it are passed over
                    container.seek(key, stream=stream)
                except av.error.FFmpegError:  # a container that cannot seek there: decoded in one pass
                    raise _Unaligned from None
            for packet in container.demux(stream):
                if stop is not None and stop.is_set():
                    raise _Stopped
                if key is not None:
                    if packet.pts != key:
                        if packet.size == 0 or packet.pts is None or packet.pts > key:
                            raise _Unaligned  # the seek went past the keyframe
                        continue
                    key = None
                drop = skip and skipping and packet.size > 0 and packet.pts not in wanted_pts and packet.pts in position
                context.skip_frame = "NONREF" if drop else "DEFAULT"
                if drop:
                    skipped.add(position[packet.pts])
                for frame in packet.decode():
                    k = position.get(frame.pts, -1)
                    if k < after or not skipped.issuperset(range(after, k)):
                        raise _Unaligned
                    after, skipping = k + 1, True
                    if tally is None:
                        self.decoded += 1
                    else:
                        tally[0] += 1
                    self._check_size(k, frame, context)
                    if k in wanted:
                        yield k, frame.to_ndarray(format="rgb24")
                    if k >= end:
                        return
        except av.error.FFmpegError as e:
            raise InvalidRequest(f"cannot decode video ({self.probe.codec}) at frame {after}: {_reason(e)}") from None
        raise InvalidRequest(f"video is truncated: {after} of its {self.probe.total_num_frames} frames decode")

    def _chunks(self, wanted: set[int], segments: int) -> list[list[tuple[int, list[int]]]]:
        """The sampled frames split into at most `segments` chunks for `_segmented`, each a list of
        runs (start, the sampled positions from it, ascending): a run is decoded from its start, a
        keyframe of `VideoProbe.splits` (or the stream's start), to its last sampled frame, over
        consecutive GOPs that hold sampled frames (GOPs without any are not decoded); chunks are cut
        at GOPs so their frames to decode are about even. [] where the video is not split
        (docs/video.md#decoding-fast; an open-GOP stream sets `segment_fell_back`)."""
        probe = self.probe
        if segments < 2 or len(probe.pts) != probe.total_num_frames:
            return []
        starts = sorted({0, *probe.splits, *probe.open_keys})
        gops: dict[int, list[int]] = {}  # GOP number (in `starts`) -> its sampled positions
        for k in sorted(wanted):
            gops.setdefault(bisect.bisect_right(starts, k) - 1, []).append(k)
        if len(gops) < 2:
            return []
        if probe.open_keys:
            self.segment_fell_back = True
            return []
        numbers = sorted(gops)
        cost = [gops[g][-1] - starts[g] + 1 for g in numbers]  # frames decoded from the GOP's keyframe
        total, done = sum(cost), 0
        chunks: list[list[tuple[int, list[int]]]] = [[]]
        previous = None
        for g, c in zip(numbers, cost):
            if chunks[-1] and len(chunks) < segments and done + c / 2 >= total * len(chunks) / segments:
                chunks.append([])
            if chunks[-1] and previous == g - 1:  # the run goes on through this GOP
                chunks[-1][-1][1].extend(gops[g])
            else:
                chunks[-1].append((starts[g], list(gops[g])))
            previous, done = g, done + c
        return chunks

    def _segmented(self, chunks, wanted: set[int], end: int, skip: bool, threads: int) -> Iterator[np.ndarray]:
        """The picked frames in order, each chunk decoded in a thread of its own (docs/video.md#decoding-fast);
        a chunk out of line with the probe stops them all, the rest then decoded in one pass."""
        import queue
        import threading

        stop = threading.Event()
        queues = [queue.SimpleQueue() for _ in chunks]
        tallies = [[0] for _ in chunks]  # frames each chunk's decoder put out

        def work(i: int) -> None:
            try:
                for item in self._chunk(chunks[i], skip, threads, stop, tallies[i]):
                    queues[i].put(("frame", item))
                queues[i].put(("done", None))
            except BaseException as e:  # noqa: BLE001 (raised again by the consumer)
                queues[i].put(("error", e))

        workers = [threading.Thread(target=work, args=(i,), name=f"video-segment-{i}", daemon=True)
                   for i in range(len(chunks))]
        for t in workers:
            t.start()
        self.segments = len(chunks)
        picked: set[int] = set()
        unaligned = False
        try:
            for q in queues:
                kind, value = q.get()
                while kind == "frame":
                    picked.add(value[0])
                    yield value[1]
                    kind, value = q.get()
                if kind == "error":
                    if not isinstance(value, _Unaligned):
                        raise value
                    unaligned = True
                    break
        finally:
            stop.set()
            for t in workers:
                t.join()
            self.decoded += sum(t[0] for t in tallies)
        if unaligned:
            self.segment_fell_back, self.segments = True, 0
            if rest := wanted - picked:
                yield from self._picked(rest, max(rest), skip)

    def _chunk(self, runs, skip: bool, threads: int, stop, tally: list[int]) -> Iterator[tuple[int, np.ndarray]]:
        """(position, RGB frame) of a chunk's sampled frames, run by run, from a container of its own."""
        import av

        with av.open(io.BytesIO(self.data), mode="r") as container:
            if threads > 1:
                context = container.streams.video[0].codec_context
                context.thread_type, context.thread_count = "AUTO", threads
            for start, positions in runs:
                yield from self._by_pts(set(positions), positions[-1], container, start, skip, stop, tally)

    def _check_size(self, i: int, frame, context) -> None:
        """Frame `i` (picked or not) has the stream's declared size, and its decoder (`context`)
        codes it within the per-frame limit: a stream may code frames far larger than it shows
        (H.264 / HEVC cropping), and the coded size is known only once the decoder has read the
        stream's parameters (the codec context says 0 before), so the first frame out is checked."""
        probe = self.probe
        if (frame.width, frame.height) != (probe.width, probe.height):
            raise InvalidRequest(f"video frame {i} is {frame.width}x{frame.height}; the stream "
                                 f"declares {probe.width}x{probe.height}")
        coded_width, coded_height = int(context.coded_width or 0), int(context.coded_height or 0)
        # a codec pads a frame to whole blocks (H.264 16 pixels, HEVC up to 64): a frame within the
        # limit may code a little over it, never further than its size rounded up to 64
        padded = -(-frame.width // 64) * 64 * (-(-frame.height // 64) * 64)
        if coded_width * coded_height > max(self.limits.max_pixels_per_frame, padded):
            raise InvalidRequest(f"video frame {i} is coded at {coded_width}x{coded_height} pixels (shown at "
                                 f"{frame.width}x{frame.height}), over the limit of "
                                 f"{self.limits.max_pixels_per_frame} pixels per frame")

    def close(self) -> None:
        self.container.close()


def _split_points(pts: list[int], ordered: tuple[int, ...], keys: list[int]
                  ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(`VideoProbe.splits`, `VideoProbe.open_keys`) from the packets' pts in decode order, the same ascending,
    and the decode positions of the keyframe packets: a keyframe splits the stream where every
    packet before it shows before it and every one after it after it (its display position is its
    decode position, and none before it shows later)."""
    splits, open_keys, keyset = [], [], set(keys)
    shown = float("-inf")  # the largest pts before the packet at hand
    for d, p in enumerate(pts):
        if d in keyset and d > 0:
            if ordered[d] == p and shown < p:
                splits.append(d)
            else:
                open_keys.append(bisect.bisect_left(ordered, p))
        shown = max(shown, p)
    return tuple(splits), tuple(open_keys)


def _codec_name(stream) -> str:
    try:
        ctx = stream.codec_context
        name = ctx.codec.name if ctx is not None else ""
    except Exception:  # noqa: BLE001 (no decoder for this codec id)
        name = ""
    if not name or name == "none":
        tag = getattr(stream.codec_context, "codec_tag", "") if stream.codec_context is not None else ""
        raise InvalidRequest(f"video codec {tag!r} is not supported (no decoder)")
    return name


def _declared_seconds(stream, container) -> float | None:
    if stream.duration and stream.time_base:
        return float(stream.duration * stream.time_base)
    return container.duration / 1_000_000 if container.duration else None  # AV_TIME_BASE


def _reason(e: Exception) -> str:
    return getattr(e, "strerror", None) or type(e).__name__


class FrameSampler:
    """The checkpoint's own frame sampler: `video_processor.sample_frames(VideoMetadata)`, loaded
    with the first video (a model without a video processor takes no video: InvalidRequest)."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = str(model_dir)

    @functools.cached_property
    def processor(self):
        from transformers import AutoVideoProcessor

        try:
            return AutoVideoProcessor.from_pretrained(self.model_dir)
        except (OSError, ValueError, KeyError):
            raise InvalidRequest("this model takes no video") from None

    @functools.cached_property
    def kwargs(self) -> dict:
        takes_fps = "fps" in inspect.signature(self.processor.sample_frames).parameters
        unset = getattr(self.processor, "fps", None) is None and getattr(self.processor, "num_frames", None) is None
        return {"fps": DEFAULT_SAMPLE_FPS} if takes_fps and unset else {}

    def indices(self, probe: VideoProbe, sampling: VideoSampling | None = None) -> list[int]:
        """Sampled frame indices, by the request's `sampling` where it sets one; InvalidRequest when
        the sampler cannot sample this video (or takes no such argument)."""
        from transformers.video_utils import VideoMetadata

        kwargs = (sampling.kwargs() if sampling is not None else {}) or self.kwargs
        takes = inspect.signature(self.processor.sample_frames).parameters
        if unknown := [name for name in kwargs if name not in takes]:
            raise InvalidRequest(f"mm_processor_kwargs.{unknown[0]}: this model's video sampler takes no {unknown[0]}")

        metadata = VideoMetadata(total_num_frames=probe.total_num_frames, fps=probe.fps, width=probe.width,
                                 height=probe.height, duration=probe.duration, video_backend="pyav")
        try:
            picked = self.processor.sample_frames(metadata, **kwargs)
        except (ValueError, ZeroDivisionError) as e:
            raise InvalidRequest(f"video of {probe.total_num_frames} frames at {probe.fps:g} fps cannot be sampled "
                                 f"for this model: {e}") from None
        return [int(i) for i in picked]
