"""`python bench/video_transfer.py [--quick]`: a decoded clip's sampled frames from a decode worker
process to its parent, over the pipe (`mmserve.video.workers`' protocol, today's path) against
through POSIX shared memory, side by side in one process.

The frames are those of the video bench's 30 s 720p clip sampled at 2 fps: 60 frames of 1280x720
RGB uint8 (166 MB), synthetic (the transfer is what is timed, not the decode). A child process
(this script with `--child`) holds them as a decoder hands them out (one array per frame) and sends
a video at a time in groups of `TRANSFER_GROUP_FRAMES` as the worker does, stacking each group:

- `pipe`: the group stacked, then written to the pipe out of band; the parent reads each group
  straight into the video's one array (`VideoDecodePool.decode`);
- `pipe_1mb`: the same with both pipes grown to 1 MiB (`F_SETPIPE_SZ`, Linux; 64 KiB by default);
- `shm_view`: the parent makes a segment the video's size in /dev/shm, the child maps it and stacks
  each group straight into it, sending only a short note per group over the pipe; the parent's
  array is a view of the segment (no copy);
- `shm_copy`: the same, the parent copying each group into an array of its own as it arrives;
- `shm_reuse`: one segment kept mapped on both sides across videos (its pages already in memory),
  the parent copying each group out into the video's own array: the best shared memory can do once
  warm (a segment per worker, sized to the largest video, kept).

A fresh segment's pages are tmpfs pages, faulted in 4 KiB at a time (`shmem_enabled` is `never` on
most kernels), where numpy's large arrays get transparent huge pages; the table prints both settings.

Every run makes a fresh segment and a fresh array (as a request does), variants alternating; the
median of the runs per variant, and the frames checked equal to the child's. The last line is one
JSON object: `pipe_s`, `shm_view_s`, ..., `shm_view_speedup` (pipe over shm_view),
`shm_copy_speedup`, `shm_reuse_speedup`, `pipe_1mb_speedup`.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from mmserve.video.workers import TRANSFER_GROUP_FRAMES, _receive, _send, grow_pipe

FRAMES, HEIGHT, WIDTH = 60, 720, 1280  # 30 s at 2 fps, 720p


def frames(count: int, height: int, width: int) -> list[np.ndarray]:
    base = np.random.default_rng(0).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    return [np.roll(base, k, axis=1) for k in range(count)]


def child() -> None:
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    requests = sys.stdin.buffer
    held: list[np.ndarray] = []
    kept = None
    while True:
        try:
            op, *args = _receive(requests)
        except EOFError:
            return
        if op == "make":
            held = frames(*args)
        elif op == "pipe":
            for start in range(0, len(held), TRANSFER_GROUP_FRAMES):
                _send(replies, ("frames", np.stack(held[start:start + TRANSFER_GROUP_FRAMES])))
        elif op == "shm":  # (path, keep): stack each group into the segment at `path`; `keep`: map it once
            path, keep = args
            if kept is None or kept[0] != path:
                with open(path, "r+b") as f:
                    segment = mmap.mmap(f.fileno(), 0)
                kept = (path, segment) if keep else None
            else:
                segment = kept[1]
            out = np.frombuffer(segment, dtype=np.uint8).reshape(len(held), *held[0].shape)
            for start in range(0, len(held), TRANSFER_GROUP_FRAMES):
                group = held[start:start + TRANSFER_GROUP_FRAMES]
                np.stack(group, out=out[start:start + len(group)])
                _send(replies, ("frames", (start, len(group))))
            del out
            if not keep:
                segment.close()
        elif op == "pipe_size":
            grow_pipe(replies, args[0])
        _send(replies, ("ok", None))


class Parent:
    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, __file__, "--child"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE)
        self.shape: tuple[int, ...] = ()
        self.kept = None

    def call(self, *message, into=None):
        _send(self.proc.stdin, message)
        return _receive(self.proc.stdout, into)

    def next(self, into=None):
        return _receive(self.proc.stdout, into)

    def make(self, count, height, width):
        self.shape = (count, height, width, 3)
        self.call("make", count, height, width)

    def grow_pipes(self, size: int) -> None:
        if grow_pipe(self.proc.stdout, size) is None:
            raise OSError("the system refused F_SETPIPE_SZ")
        self.call("pipe_size", size)

    def pipe(self) -> np.ndarray:
        pixels = np.empty(self.shape, dtype=np.uint8)
        flat, filled = pixels.reshape(-1), 0

        def into(size):
            nonlocal filled
            start, filled = filled, filled + size
            return flat[start:filled]

        status, _ = self.call("pipe", into=into)
        while status == "frames":
            status, _ = self.next(into=into)
        return pixels

    def segment(self) -> tuple[str, mmap.mmap]:
        """A fresh segment in /dev/shm the video's size: (its path, its mapping)."""
        size = int(np.prod(self.shape))
        path = f"/dev/shm/mmserve-bench-{os.getpid()}-{time.monotonic_ns()}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)  # the space taken now: a full /dev/shm is ENOSPC here, not SIGBUS later
            return path, mmap.mmap(fd, size)
        finally:
            os.close(fd)

    def shm(self, copy: bool, reuse: bool = False) -> np.ndarray:
        """The video through a fresh segment (`reuse`: the one kept mapped on both sides), its frames viewed
        there or (`copy`) copied out group by group into an array of their own."""
        if reuse:
            self.kept = self.kept or self.segment()
        path, segment = self.kept if reuse else self.segment()
        try:
            view = np.frombuffer(segment, dtype=np.uint8).reshape(self.shape)
            pixels = np.empty(self.shape, dtype=np.uint8) if copy else view
            status, value = self.call("shm", path, reuse)
            while status == "frames":
                start, count = value
                if copy:
                    pixels[start:start + count] = view[start:start + count]
                status, value = self.next()
        finally:
            if not reuse:
                os.unlink(path)
        return pixels

    def close(self):
        if self.kept is not None:
            os.unlink(self.kept[0])
        self.proc.stdin.close()
        self.proc.wait()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 runs of 16 frames of 720p (seconds)")
    parser.add_argument("--runs", type=int, default=None, help="runs per variant (default 7; --quick 3)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child()
        return 0
    count = 16 if args.quick else FRAMES
    runs = args.runs or (3 if args.quick else 7)
    plain, grown = Parent(), Parent()
    variants = {"pipe": lambda: plain.pipe(), "pipe_1mb": lambda: grown.pipe(),
                "shm_view": lambda: plain.shm(copy=False), "shm_copy": lambda: plain.shm(copy=True),
                "shm_reuse": lambda: grown.shm(copy=True, reuse=True)}
    times: dict[str, list[float]] = {name: [] for name in variants}
    try:
        for parent in (plain, grown):
            parent.make(count, HEIGHT, WIDTH)
        try:
            grown.grow_pipes(1 << 20)
        except OSError as e:  # not Linux, or over /proc/sys/fs/pipe-max-size
            print(f"pipe_1mb: could not grow the pipes ({e}); it runs at the default size", file=sys.stderr)
        expected = np.stack(frames(count, HEIGHT, WIDTH))
        for k in range(runs + 1):
            for name, run in variants.items():
                began = time.perf_counter()
                got = run()
                elapsed = time.perf_counter() - began
                if not np.array_equal(got, expected):
                    raise SystemExit(f"{name}: frames differ")
                del got
                if k:  # the first warms both sides up
                    times[name].append(elapsed)
    finally:
        plain.close()
        grown.close()
    mb = count * HEIGHT * WIDTH * 3 / 1e6
    thp = {}
    for name in ("enabled", "shmem_enabled"):
        try:
            text = Path(f"/sys/kernel/mm/transparent_hugepage/{name}").read_text()
            thp[name] = text[text.index("[") + 1:text.index("]")]
        except (OSError, ValueError):
            thp[name] = None
    median = {name: statistics.median(t) for name, t in times.items()}
    print(f"{count} frames of {WIDTH}x{HEIGHT} RGB ({mb:.0f} MB), groups of {TRANSFER_GROUP_FRAMES}, "
          f"median of {runs}, variants alternating; transparent huge pages {thp['enabled']}, "
          f"for shared memory {thp['shmem_enabled']}:")
    print(f"{'variant':>9} {'s':>7} {'GB/s':>6} {'vs pipe':>8}  runs")
    for name, t in times.items():
        print(f"{name:>9} {median[name]:>7.3f} {mb / 1e3 / median[name]:>6.2f} "
              f"{median['pipe'] / median[name]:>7.2f}x  {' '.join(f'{x:.3f}' for x in t)}")
    summary = {"bench": "video_transfer", "frames": count, "mb": round(mb, 1), "runs": runs,
               "thp": thp["enabled"], "thp_shmem": thp["shmem_enabled"],
               **{f"{name}_s": round(s, 4) for name, s in median.items()},
               **{f"{name}_speedup": round(median["pipe"] / median[name], 3) for name in variants if name != "pipe"}}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
