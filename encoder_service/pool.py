"""The encoder pool runtime: cache and dedup in front, CPU preprocessing pool, token-budget batches.

One `EncoderPool` per process (a Ray Serve replica or the standalone gRPC server) serves items of
any number of concurrent requests from one asyncio event loop:

    encode(items) -> cache hit?  -> embedding (items come with the router face's layout and cost)
                  -> in flight?  -> share that item's future (dedup)
                  -> decode on the worker pool -> queue (over budget: the face splits it)
    scheduler     -> select_batch (token budget, wait at most batch_wait_ms)
                  -> on the device thread: the processor (resize, normalize, patchify) and one
                     packed forward, on the device -> split per item -> cache

The worker pool runs the face's `preprocess`: for every family but MiniCPM-V only the decode, so
the queue holds decoded uint8 pixels (3 bytes a pixel: ~3.1 MB for a 1024x1024 image, against
~25.8 MB of float32 Qwen2-VL patches); see `encoder_service.families.base`. The forward of one
batch overlaps the decoding of the next. An item that fails (corrupt media) fails only the
requests that asked for it. The pixels waiting for the device are bounded by `max_queued_bytes`,
counted as the items' own tensors (`PreparedItem.num_bytes`: uint8 where the face queues uint8):
an item that would go over is refused with `Overloaded` (one item alone is always admitted, so
any item can run).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
import dataclasses
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, Protocol

import torch

from encoder_service.batching import BatchConfig, Selection, overtaken, select_batch
from encoder_service.cache import EmbeddingCache, EncoderIdentity
from encoder_service.families.base import PreparedItem
from mmserve.errors import Overloaded
from mmserve.inputs.embeddings import ItemEmbedding
from mmserve.inputs.encode_timing import EncodeTiming
from mmserve.inputs.media import EncodeItem
from mmserve.settings import check_fields, setting

logger = logging.getLogger(__name__)

Lookup = Literal["hit", "miss", "dedup"]


@dataclass(frozen=True)
class PoolConfig:
    """The pool's batching and bounds (settings of the app's `encoder_pool`, `mmserve.settings`)."""

    batch: BatchConfig = BatchConfig()
    preprocess_workers: int = setting(4, "threads decoding media (the processor runs on the device)", ge=1)
    cache_bytes: int = setting(1 << 30, "embedding cache bound per replica; 0 = off", ge=0)
    max_queued_bytes: int = setting(1 << 30, "decoded (uint8) pixels queued per replica, waiting for or in a "
                                    "forward; over it items are refused (503)", ge=1)

    def __post_init__(self):
        check_fields(self)


class Encoder(Protocol):
    """What the pool needs of `encoder_service.VisionEncoder` (tests pass fakes)."""

    identity: EncoderIdentity

    def preprocess(self, item: EncodeItem) -> PreparedItem: ...
    def split(self, prepared: PreparedItem, budget: int, unit: str) -> list[PreparedItem]: ...
    def forward(self, prepared: Sequence[PreparedItem]) -> list[tuple[torch.Tensor, ...]]: ...


class BatchRecord(NamedTuple):
    items: int
    cost: int
    fill_ratio: float  # cost / max_batch_tokens, at most 1 (an oversize item alone counts as full)
    wait_ms: float  # from the oldest piece's enqueue to the start of the forward
    forward_ms: float


class PoolStats(NamedTuple):
    queued_tokens: int  # output tokens of items admitted and not yet answered
    queued_items: int
    forwards: int
    pieces_forwarded: int
    cache_hits: int
    cache_misses: int
    dedup_hits: int
    cache_bytes: int
    queued_bytes: int = 0  # queued pixels (`PreparedItem.num_bytes`) waiting for (or in) a forward
    refused_overloaded: int = 0  # items refused because the queue was full


class PoolListener:
    """Observer of the pool (metrics); every method runs on the event loop and must be cheap."""

    def on_lookup(self, outcome: Lookup) -> None:
        pass

    def on_batch(self, record: BatchRecord) -> None:
        pass

    def on_queue(self, queued_tokens: int, queued_items: int, cache_bytes: int) -> None:
        pass


@dataclass(eq=False)
class _Job:
    """One distinct item being encoded (shared by every request that asked for it)."""

    key: str
    future: asyncio.Future
    tokens: int
    outputs: list[tuple[torch.Tensor, ...] | None] = field(default_factory=list)
    remaining: int = 0
    forward_at: float | None = None  # time.monotonic() at the start of its first piece's forward
    done_at: float | None = None  # time.monotonic() when its result was set


@dataclass(eq=False)
class _Piece:
    job: _Job
    index: int
    prepared: PreparedItem
    cost: int
    enqueued: float
    num_bytes: int = 0
    skips: int = 0


class EncoderPool:
    """Encodes media items from concurrent callers in token-budget batches (see module docstring).

    Bound to the event loop of its first `encode` call; `close()` stops it.
    """

    def __init__(self, encoder: Encoder, config: PoolConfig = PoolConfig(), listener: PoolListener | None = None):
        self.encoder, self.config = encoder, config
        self.listener = listener or PoolListener()
        self.cache = EmbeddingCache(config.cache_bytes) if config.cache_bytes > 0 else None
        self._preprocess = ThreadPoolExecutor(config.preprocess_workers, thread_name_prefix="encoder-preprocess")
        self._device = ThreadPoolExecutor(1, thread_name_prefix="encoder-forward")
        self._inflight: dict[str, _Job] = {}
        self._queue: list[_Piece] = []
        self._wake: asyncio.Event | None = None
        self._scheduler: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queued_tokens = self._queued_bytes = self._refused = 0
        self._forwards = self._pieces_forwarded = self._dedup_hits = 0

    # -- public ---------------------------------------------------------------------------------
    async def encode(self, items: Sequence[EncodeItem]) -> list[ItemEmbedding]:
        """One output per item, in order, on CPU (shared: treat as read-only). Raises the first
        failing item's error; the others keep running for the requests that share them, and
        cancelling the caller does not cancel shared work."""
        self._ensure_started()
        began = time.monotonic()
        submitted = [self._submit(item) for item in items]
        if submitted:
            await asyncio.wait([f for f, _ in submitted])
        now, wall = time.monotonic(), time.time()
        return [dataclasses.replace(f.result(), timing=_timing(job, began, now, wall)) for f, job in submitted]

    def encode_threadsafe(self, items: Sequence[EncodeItem], timeout: float | None = None) -> list[ItemEmbedding]:
        """`encode` from another thread (the pool's loop running: after a first `encode`, or `start`)."""
        if self._loop is None:
            raise RuntimeError("encoder pool not started: call start(loop) or encode() on its loop first")
        return asyncio.run_coroutine_threadsafe(self.encode(items), self._loop).result(timeout)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Bind to `loop` (running, or about to run) before any `encode`; thread-safe."""
        loop.call_soon_threadsafe(self._ensure_started)
        self._loop = loop

    @property
    def queued_tokens(self) -> int:
        return self._queued_tokens

    def stats(self) -> PoolStats:
        cache = self.cache
        return PoolStats(self._queued_tokens, len(self._inflight), self._forwards, self._pieces_forwarded,
                         cache.hits if cache else 0, cache.misses if cache else 0, self._dedup_hits,
                         cache.num_bytes if cache else 0, self._queued_bytes, self._refused)

    async def close(self) -> None:
        if self._scheduler is not None:
            self._scheduler.cancel()
            await asyncio.gather(self._scheduler, return_exceptions=True)
        self._preprocess.shutdown(wait=False, cancel_futures=True)
        self._device.shutdown(wait=False, cancel_futures=True)

    # -- admission ------------------------------------------------------------------------------
    def _ensure_started(self) -> None:
        if self._scheduler is None or self._scheduler.done():
            self._loop = asyncio.get_running_loop()
            self._wake = asyncio.Event()
            self._scheduler = self._loop.create_task(self._schedule())

    def _submit(self, item: EncodeItem) -> tuple[asyncio.Future, _Job | None]:
        """The item's future, and the job computing it (None: a cache hit, or refused)."""
        loop = asyncio.get_running_loop()
        key = self.encoder.identity.key(item.item)
        if (job := self._inflight.get(key)) is not None:
            self._dedup_hits += 1
            self.listener.on_lookup("dedup")
            return job.future, job
        future = loop.create_future()
        if self.cache is not None and (hit := self.cache.get(key)) is not None:
            self.listener.on_lookup("hit")
            future.set_result(hit)
            return future, None
        self.listener.on_lookup("miss")
        if self._queued_bytes >= self.config.max_queued_bytes:  # full already: do not even preprocess
            future.set_exception(self._overloaded())
            return future, None
        job = _Job(key, future, item.cost)
        self._inflight[key] = job
        self._queued_tokens += item.cost
        self._notify_queue()
        prepared = loop.run_in_executor(self._preprocess, self.encoder.preprocess, item)
        prepared.add_done_callback(lambda f: self._on_prepared(job, f))
        return future, job

    def _on_prepared(self, job: _Job, prepared_future: asyncio.Future) -> None:
        error = RuntimeError("encoder pool closed") if prepared_future.cancelled() else prepared_future.exception()
        if error is not None:
            self._finish(job, error=error)
            return
        prepared = prepared_future.result()
        unit, budget = self.config.batch.cost_unit, self.config.batch.max_batch_tokens
        pieces = self.encoder.split(prepared, budget, unit) if prepared.cost(unit) > budget else [prepared]
        num_bytes = [piece.num_bytes for piece in pieces]
        if self._queued_bytes > 0 and self._queued_bytes + sum(num_bytes) > self.config.max_queued_bytes:
            self._finish(job, error=self._overloaded())
            return
        job.outputs, job.remaining = [None] * len(pieces), len(pieces)
        now = time.monotonic()
        for index, (piece, size) in enumerate(zip(pieces, num_bytes)):
            self._queue.append(_Piece(job, index, piece, piece.cost(unit), now, size))
            self._queued_bytes += size
        assert self._wake is not None
        self._wake.set()

    def _finish(self, job: _Job, result: ItemEmbedding | None = None, error: BaseException | None = None) -> None:
        if self._inflight.get(job.key) is job:
            del self._inflight[job.key]
            self._queued_tokens -= job.tokens
        if job.future.done():
            return
        if error is not None:
            job.future.set_exception(error)
        else:
            assert result is not None
            if self.cache is not None:
                self.cache.put(job.key, result)
            job.done_at = time.monotonic()
            job.future.set_result(result)
        self._notify_queue()

    def _overloaded(self) -> Overloaded:
        """An item refused (counted): the queue is full."""
        self._refused += 1
        return Overloaded(f"the encoder's queue of preprocessed media is full ({self.config.max_queued_bytes} bytes)")

    def _release(self, pieces: Sequence[_Piece]) -> None:
        self._queued_bytes -= sum(p.num_bytes for p in pieces)

    def _notify_queue(self) -> None:
        cache_bytes = self.cache.num_bytes if self.cache is not None else 0
        self.listener.on_queue(self._queued_tokens, len(self._inflight), cache_bytes)

    # -- batches --------------------------------------------------------------------------------
    async def _schedule(self) -> None:
        assert self._wake is not None
        wait_s = self.config.batch.batch_wait_ms / 1000
        while True:
            if dropped := [p for p in self._queue if p.job.future.done()]:  # pieces of failed jobs
                self._release(dropped)
                self._queue = [p for p in self._queue if not p.job.future.done()]
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            selection = select_batch([p.cost for p in self._queue], [p.skips for p in self._queue], self.config.batch)
            remaining_s = self._queue[0].enqueued + wait_s - time.monotonic()
            if not selection.full and remaining_s > 0:
                self._wake.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), remaining_s)
                continue
            await self._run_batch(self._take(selection))

    def _take(self, selection: Selection) -> list[_Piece]:
        for i in overtaken(selection, len(self._queue)):
            self._queue[i].skips += 1
        chosen = set(selection.indices)
        batch = [self._queue[i] for i in selection.indices]
        self._queue = [p for i, p in enumerate(self._queue) if i not in chosen]
        return batch

    async def _run_batch(self, batch: list[_Piece]) -> None:
        start = time.monotonic()
        wait_ms = (start - min(p.enqueued for p in batch)) * 1000
        for piece in batch:
            if piece.job.forward_at is None:
                piece.job.forward_at = start
        try:
            outputs: list[tuple[torch.Tensor, ...] | BaseException] = list(await self._forward(batch))
        except Exception as e:
            if len(batch) == 1:
                outputs = [e]
            else:  # find the culprit: one forward per piece, so only its requests fail
                logger.warning("batched forward of %d pieces failed (%r); retrying one by one", len(batch), e)
                outputs = [await self._forward_alone(p) for p in batch]
        finally:
            self._release(batch)
        forward_ms = (time.monotonic() - start) * 1000
        cost = sum(p.cost for p in batch)
        self._forwards += 1
        self._pieces_forwarded += len(batch)
        fill = min(1.0, cost / self.config.batch.max_batch_tokens)
        self.listener.on_batch(BatchRecord(len(batch), cost, fill, wait_ms, forward_ms))
        for piece, out in zip(batch, outputs):
            self._deliver(piece, out)

    def _forward(self, pieces: Sequence[_Piece]) -> asyncio.Future:
        prepared = [p.prepared for p in pieces]
        return asyncio.get_running_loop().run_in_executor(self._device, self.encoder.forward, prepared)

    async def _forward_alone(self, piece: _Piece) -> tuple[torch.Tensor, ...] | BaseException:
        try:
            return (await self._forward([piece]))[0]
        except Exception as e:
            return e

    def _deliver(self, piece: _Piece, out: tuple[torch.Tensor, ...] | BaseException) -> None:
        job = piece.job
        if job.future.done():
            return
        if isinstance(out, BaseException):
            self._finish(job, error=out)
            return
        job.outputs[piece.index] = out
        job.remaining -= 1
        if job.remaining == 0:
            self._finish(job, result=ItemEmbedding.concat(job.outputs, job.key))  # type: ignore[arg-type]


def _timing(job: _Job | None, began: float, now: float, wall: float) -> EncodeTiming:
    """An item's `EncodeTiming` for the call that began at `began` and returns at `now` (monotonic;
    `wall`: now on the wall clock). A caller that joined a job in flight (dedup) counts from its call."""
    if job is None:
        return EncodeTiming(0.0, 0.0, True, wall)
    done = job.done_at if job.done_at is not None else now
    forward = min(done, job.forward_at) if job.forward_at is not None else done
    start = max(forward, began)
    return EncodeTiming((start - began) * 1000, max(0.0, done - start) * 1000, False, wall - (now - done))
