"""Video decoding in worker processes that can be killed: a deadline per video, crashes contained.

A video is two calls to its worker (`python -m mmserve.video.workers`): `probe` (open, check, count
frames) and, once the model's sampler has picked frames, `decode`, answered by one reply per group of
frames. Both share the video's deadline; a worker past it, dead, or whose caller went away mid-video is
killed and replaced, and the request gets a 400 naming what happened (docs/video.md).

The protocol is length-prefixed pickles over the worker's stdin/stdout (the worker's own stdout goes
to stderr, so nothing FFmpeg prints can corrupt it); pickles come only from our own child. Frames
travel out of band (pickle protocol 5), never copied into a pickle.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import struct
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import numpy as np

from mmserve.errors import InvalidRequest
from mmserve.inputs.media import DecodedVideo
from mmserve.video.container import (
    PYAV_MISSING, ContainerReader, DecodeOptions, FrameSampler, VideoLimits, VideoSampling, pyav_available,
    video_content_hash,
)

logger = logging.getLogger("ray.serve")
KILL_WAIT_S = 10.0  # how long closing waits for a killed worker to be reaped
# a whole video crosses the pipe in groups of this many frames, so the worker decodes on while the
# parent reads (one 166 MB message would leave each side waiting on the other)
TRANSFER_GROUP_FRAMES = 8
_SIZE = struct.Struct("<Q")


def _send(stream, message) -> None:
    """[pickle size, buffer count, buffer sizes] [pickle] [buffers]."""
    buffers: list[pickle.PickleBuffer] = []
    body = pickle.dumps(message, protocol=5, buffer_callback=buffers.append)
    views = [b.raw() for b in buffers]
    stream.write(struct.pack(f"<QQ{len(views)}Q", len(body), len(views), *(v.nbytes for v in views)))
    for part in (body, *views):
        stream.write(part)
    stream.flush()


def _read_into(stream, view: memoryview) -> None:
    done = 0
    while done < len(view):
        if not (n := stream.readinto(view[done:])):
            raise EOFError("worker pipe closed mid-message")
        done += n


def _receive(stream, into: Callable[[int], np.ndarray] | None = None):
    """The next message; its out-of-band buffers read straight into `into(size)` (a uint8 view
    of the caller's array), or into arrays of their own."""
    if len(header := stream.read(2 * _SIZE.size)) < 2 * _SIZE.size:
        raise EOFError("worker pipe closed")
    size, count = struct.unpack("<QQ", header)
    sizes = struct.unpack(f"<{count}Q", stream.read(count * _SIZE.size)) if count else ()
    body = bytearray(size)
    _read_into(stream, memoryview(body))
    buffers = []
    for n in sizes:
        # a frame array's memory, read into once: its own, or the caller's
        buffers.append(into(n) if into is not None else np.empty(n, dtype=np.uint8))
        _read_into(stream, memoryview(buffers[-1]))
    return pickle.loads(body, buffers=buffers)


# -- the worker process ---------------------------------------------------------------------------
def main() -> None:
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything printed goes to stderr, never into the protocol
    requests = sys.stdin.buffer
    reader: ContainerReader | None = None
    while True:
        try:
            op, *args = _receive(requests)
        except EOFError:
            return
        try:
            if op in ("probe", "close"):
                if reader is not None:
                    reader.close()
                reader = None
                reader = ContainerReader(*args) if op == "probe" else None
                reply = ("ok", reader.probe if reader else None)
            elif op == "decode":  # (indices, group_size, options): one ("frames", array) per group, then
                # ("ok", (whether skipping fell back to the plain decode, whether a segmented decode fell
                # back to one pass, segments decoded at once (0: one pass)))
                if reader is None:
                    raise RuntimeError("decode before probe")
                try:
                    for group in reader.decode(*args):
                        _send(replies, ("frames", group))
                    reply = ("ok", (reader.fell_back, reader.segment_fell_back, reader.segments))
                finally:
                    reader.close()
                    reader = None
            else:
                raise RuntimeError(f"unknown operation {op!r}")
        except InvalidRequest as e:
            reply = ("invalid", str(e))
        except Exception as e:  # noqa: BLE001 (reported to the parent, which logs it)
            reply = ("error", f"{type(e).__name__}: {e}")
        _send(replies, reply)


# -- the parent side ----------------------------------------------------------------------------------
class WorkerLost(Exception):
    """The worker was killed at the deadline (`timed_out`) or died."""

    def __init__(self, message: str, timed_out: bool):
        super().__init__(message)
        self.timed_out = timed_out


PIPE_BYTES = 1 << 20  # the frames' pipe, grown from Linux's 64 KiB (bench/video_transfer.py: 2.0-2.5x idle)
F_SETPIPE_SZ = 1031  # fcntl.F_SETPIPE_SZ (Linux; Python >= 3.10 names it)


def grow_pipe(stream, size: int = PIPE_BYTES) -> int | None:
    """Grow the pipe under `stream` to `size` bytes, so a worker writes a frame group in fewer
    wake-ups of the reader; its new size, or None where the system refuses (not Linux, or over
    /proc/sys/fs/pipe-max-size): the pipe then stays as it was."""
    try:
        import fcntl

        return fcntl.fcntl(stream.fileno(), getattr(fcntl, "F_SETPIPE_SZ", F_SETPIPE_SZ), size)
    except (ImportError, OSError):
        return None


class DecodeWorker:
    """One worker process; `call` blocks (run it in a thread) and kills the worker at `deadline`."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-m", "mmserve.video.workers"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, close_fds=True)
        grow_pipe(self.proc.stdout)
        self._timed_out = False
        self.pending: list[int] | None = None  # the sampled indices of the video it holds probed

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def call(self, message, deadline: float, into: Callable[[int], np.ndarray] | None = None):
        """The worker's reply to `message` (None: send nothing, read its next reply), its frames
        read into `into` (see `_receive`); WorkerLost when it passes `deadline` (time.monotonic)
        or dies."""
        self._timed_out = False
        timer = threading.Timer(max(0.0, deadline - time.monotonic()), self._kill_at_deadline)
        timer.start()
        try:
            if message is not None:
                _send(self.proc.stdin, message)
            return _receive(self.proc.stdout, into)
        except (EOFError, OSError, ValueError, pickle.UnpicklingError):  # ValueError: pipes closed by kill()
            self.kill()
            if self._timed_out:
                raise WorkerLost("killed at its deadline", timed_out=True) from None
            raise WorkerLost(f"exited with code {self.proc.returncode}", timed_out=False) from None
        finally:
            timer.cancel()

    def _kill_at_deadline(self) -> None:
        self._timed_out = True
        self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:  # a killed worker with a thread stuck in the kernel stays a zombie ("Zl"): never wait forever on it
            self.proc.wait(timeout=KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            logger.warning("video decode worker %d did not end %g s after SIGKILL; left to the OS", self.proc.pid,
                           KILL_WAIT_S)
        for pipe in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                pipe.close()


@dataclass
class DecodeStats:
    decoded: int = 0  # videos decoded (whole, or streamed)
    streamed: int = 0  # of those, streamed group by group
    refused: int = 0  # bad input (400)
    killed: int = 0  # workers killed at a deadline or found dead
    busy_s: float = 0.0  # seconds workers spent on videos
    skip_fallbacks: int = 0  # videos whose frames did not follow their timestamps: decoded again, nothing skipped
    segmented: int = 0  # videos decoded in segments at once (DecodeOptions.segments)
    segment_fallbacks: int = 0  # videos that would have been, but were (or their rest was) decoded in one pass


class VideoDecodePool:
    """Decodes one request's video file to its sampled frames in one of `workers` processes, as
    `options` says: its header (`probe`), all frames (`decode`) or groups as decoded (`frames`)."""

    def __init__(self, sampler: FrameSampler, limits: VideoLimits, workers: int,
                 options: DecodeOptions = DecodeOptions()):
        self.sampler, self.limits, self.options = sampler, limits, options
        self.stats = DecodeStats()
        self._idle: list[DecodeWorker] = []
        self._slots = asyncio.Semaphore(workers)
        self.waiting = 0
        self._running: dict[object, float] = {}  # one entry per video being decoded -> its start
        self._mean_s = 1.0  # decode seconds of a video, a moving average (the autoscaling estimate)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def queued_seconds(self) -> float:
        """Decode seconds ahead: the running videos' elapsed time plus the waiting ones at the mean."""
        now = time.monotonic()
        return sum(now - t for t in self._running.values()) + self.waiting * self._mean_s

    async def probe(self, data: bytes, request_id: str = "-", sampling: VideoSampling | None = None,
                    decode_below: int = 0) -> DecodedVideo:
        """The video's header: what its frames will be (shape, sampled indices), none decoded;
        `sampling`: the request's own (None: the model's). A video sampling to fewer than
        `decode_below` frames comes decoded (its pixels), in the same call and worker (too short to
        stream: `video_decode.stream_min_frames`)."""
        async with self._session(data, request_id, sampling) as (worker, header, deadline):
            if header.shape[0] < decode_below:
                return await self._whole(worker, header, deadline)
            await self._call(worker, ("close",), deadline)
            worker.pending = None
            return header

    async def decode(self, data: bytes, request_id: str = "-", sampling: VideoSampling | None = None) -> DecodedVideo:
        async with self._session(data, request_id, sampling) as (worker, header, deadline):
            return await self._whole(worker, header, deadline)

    async def _whole(self, worker: DecodeWorker, header: DecodedVideo, deadline: float) -> DecodedVideo:
        """The probed video's frames, all of them: `header` with its pixels."""
        # the groups are read straight into the video's one array (no concatenation after)
        pixels = np.empty((*header.shape, 3), dtype=np.uint8)
        flat, filled = pixels.reshape(-1), 0

        def into(size: int) -> np.ndarray:
            nonlocal filled
            start, filled = filled, filled + size
            # more than the header said: an array of its own, and refused below
            return flat[start:filled] if filled <= flat.size else np.empty(size, dtype=np.uint8)

        async for _ in self._frames(worker, TRANSFER_GROUP_FRAMES, deadline, into):
            pass
        if filled != flat.size:
            raise RuntimeError(f"the decode worker sent {filled} of its video's {flat.size} pixel bytes")
        return header.with_pixels(pixels)

    async def frames(self, data: bytes, request_id: str = "-", group_size: int = 1,
                     indices: tuple[int, ...] | None = None) -> AsyncIterator[np.ndarray]:
        """The sampled frames in groups of `group_size` (the last may be shorter), each as soon as
        it is decoded; `indices`: those of the video's header (`probe`), else the model's sampler
        picks them. Closing the iterator early kills its worker (it may be mid-video)."""
        async with self._session(data, request_id, indices=indices) as (worker, header, deadline):
            async for group in self._frames(worker, group_size, deadline):
                yield group
            self.stats.streamed += 1

    @contextlib.asynccontextmanager
    async def _session(self, data: bytes, request_id: str, sampling: VideoSampling | None = None,
                       indices: tuple[int, ...] | None = None):
        """A worker with the video opened and checked: yields (worker, header, deadline)."""
        if not pyav_available():
            raise InvalidRequest(PYAV_MISSING)
        deadline = time.monotonic() + self.limits.decode_timeout_s
        self.waiting += 1
        try:
            await asyncio.wait_for(self._slots.acquire(), self.limits.decode_timeout_s)
        except asyncio.TimeoutError:
            raise InvalidRequest(f"video was not decoded within {self.limits.decode_timeout_s:g} s "
                                 "(decoders busy)") from None
        finally:
            self.waiting -= 1
        worker = self._idle.pop() if self._idle else None
        start, token = time.monotonic(), object()
        self._running[token] = start
        try:
            worker = worker if worker is not None and worker.alive else await asyncio.to_thread(DecodeWorker)
            yield worker, await self._header(worker, data, deadline, sampling, indices), deadline
            self.stats.decoded += 1
        except InvalidRequest:
            self.stats.refused += 1
            raise
        except (asyncio.CancelledError, GeneratorExit):  # the request went away mid-call: the worker goes too
            if worker is not None:
                worker.kill()
            raise
        finally:
            elapsed = time.monotonic() - start
            del self._running[token]
            self.stats.busy_s += elapsed
            self._mean_s = 0.8 * self._mean_s + 0.2 * elapsed
            if worker is not None and worker.alive:
                if worker.pending is not None:  # probed, frames never asked for: it still holds the video open
                    worker.kill()
                else:
                    self._idle.append(worker)
            self._slots.release()
            logger.info("request %s: video of %d bytes, %.3f s in a decoder", request_id, len(data), elapsed)

    async def _header(self, worker: DecodeWorker, data: bytes, deadline: float, sampling: VideoSampling | None,
                      indices: tuple[int, ...] | None) -> DecodedVideo:
        probe = await self._call(worker, ("probe", data, self.limits), deadline)
        if indices is None:  # the first loads the processor
            indices = await asyncio.to_thread(self.sampler.indices, probe, sampling)
        indices = [int(i) for i in indices]
        if len(indices) > self.limits.max_frames:
            asked = f" at mm_processor_kwargs.fps {sampling.fps:g}" if sampling and sampling.fps else ""
            raise InvalidRequest(f"video samples to {len(indices)} frames for this model{asked}; the limit is "
                                 f"{self.limits.max_frames} (max_frames_per_video)")
        shape = (len(set(indices)), probe.height, probe.width)  # each sampled frame once (a sampler may repeat one)
        if shape[0] * shape[1] * shape[2] > self.limits.max_decoded_pixels:
            raise InvalidRequest(
                f"video samples to {shape[0]} frames of {probe.width}x{probe.height}: {shape[0] * shape[1] * shape[2]} "
                f"decoded pixels, over the limit of {self.limits.max_decoded_pixels} (max_decoded_pixels_per_video); "
                "send a shorter or smaller video")
        worker.pending = indices
        return DecodedVideo(shape, probe.fps, probe.total_num_frames, tuple(indices), video_content_hash(data, indices))

    async def _frames(self, worker: DecodeWorker, group_size: int, deadline: float,
                      into: Callable[[int], np.ndarray] | None = None) -> AsyncIterator[np.ndarray]:
        """The worker's groups (read into `into`, see `_receive`); the next one is read while the
        caller holds this one, so the worker decodes on instead of waiting on a full pipe."""
        message = ("decode", worker.pending, group_size, self.options)
        worker.pending = None
        reply = asyncio.ensure_future(self._call(worker, message, deadline, "frames", into=into))
        try:
            while True:
                status, value = await reply
                if status == "ok":
                    skip_fallback, segment_fallback, segments = value
                    self.stats.skip_fallbacks += bool(skip_fallback)
                    self.stats.segment_fallbacks += bool(segment_fallback)
                    self.stats.segmented += segments > 1
                    return
                reply = asyncio.ensure_future(self._call(worker, None, deadline, "frames", into=into))
                yield value
        finally:  # left early: the session kills the worker, which ends a read still running
            reply.cancel()
            if reply.done() and not reply.cancelled():
                reply.exception()  # retrieved: a read the worker's kill ended is no error to log

    async def _call(self, worker: DecodeWorker, message, deadline: float, *more: str,
                    into: Callable[[int], np.ndarray] | None = None):
        """The worker's reply's value ("ok"); with `more`, (status, value) of a reply of those statuses too."""
        try:
            status, value = await asyncio.to_thread(worker.call, message, deadline, into)
        except WorkerLost as e:
            self.stats.killed += 1
            if e.timed_out:
                raise InvalidRequest(f"video decoding took longer than {self.limits.decode_timeout_s:g} s") from None
            logger.warning("video decode worker died: %s", e)
            raise InvalidRequest(f"video could not be decoded (the decoder {e})") from None
        if status == "invalid":
            raise InvalidRequest(value)
        if status != "ok" and status not in more:
            raise RuntimeError(f"video decode worker failed: {value}")
        return (status, value) if more else value

    def close(self) -> None:
        for worker in self._idle:
            worker.kill()
        self._idle.clear()


if __name__ == "__main__":
    main()
