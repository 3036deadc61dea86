"""`EncoderService` over gRPC (grpc.aio): encode media, fetch pinned embeddings by hash.

Runs inside an encoder replica (`transport: grpc`, in a background thread) or standalone
(`mmserve encoder-server`), with the standard `grpc.health.v1` and reflection services, an
optional shared token (metadata "authorization: Bearer <token>", required for everything but
health checks) and optional TLS. No Ray here: the encoder is anything with `plan(item,
max_pixels)` and `encode(items) -> list[ItemEmbedding]`. Every item is checked against the app's
media limits (`MediaLimits`: frames, pixels read from the image headers) before it is decoded.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import grpc
import numpy as np
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from encoder_service.rpc.result_store import ResultStore
from mmserve.errors import InvalidRequest, Overloaded
from mmserve.inputs.embeddings import ItemEmbedding
from mmserve.inputs.media import DecodedVideo, EncodeItem, MediaItem, MediaKind
from mmserve.request.prompt_plan import MediaLimits
from mmserve.video.container import VideoLimits
from mmserve.rpc.embedding_wire import DEFAULT_CHUNK_BYTES, header_of, to_chunks
from mmserve.settings import setting
from protos.mmserve.v1 import encoder_pb2, encoder_pb2_grpc

logger = logging.getLogger(__name__)
SERVICE_NAME = encoder_pb2.DESCRIPTOR.services_by_name["EncoderService"].full_name
_KINDS = {encoder_pb2.MediaItem.IMAGE: MediaKind.IMAGE, encoder_pb2.MediaItem.VIDEO: MediaKind.VIDEO}
_MAX_WAIT_MS = 60_000
# The largest message received: an Encode request carries an image or a video's frames as the
# client sent them, bounded by the app's request size (max_request_bytes' default, 64 MiB); a
# decoded video (up to ~400 MB) comes over EncodeStream in pieces instead, so a client without the
# token can make the server hold at most one message of this size before it is refused.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024 + (1 << 20)
STREAM_PIECE_BYTES = 4 * 1024 * 1024  # the pieces of EncodeStream (gRPC's own default message size)
MAX_DECODED_VIDEO_BYTES = 3 * VideoLimits.max_decoded_pixels


class Encoder(Protocol):
    def plan(self, item: MediaItem, max_pixels: int) -> EncodeItem: ...

    def encode(self, items: Sequence[EncodeItem]) -> list[ItemEmbedding]: ...


class PooledEncoder:
    """An `EncoderPool` seen as an `Encoder`: `Encode` calls from the server's worker threads join
    the pool's token-budget batches, cache and dedup (the pool runs on the server's loop)."""

    def __init__(self, pool):
        self._pool = pool

    def plan(self, item: MediaItem, max_pixels: int) -> EncodeItem:
        return self._pool.encoder.plan(item, max_pixels)

    def encode(self, items: Sequence[EncodeItem]) -> list[ItemEmbedding]:
        return self._pool.encode_threadsafe(list(items))


@dataclass(frozen=True)
class ServerSecurity:
    """Shared token and TLS files (PEM); all optional. `tls_client_ca` turns on mutual TLS."""

    token: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None

    def credentials(self) -> grpc.ServerCredentials | None:
        if not (self.tls_cert or self.tls_key):
            return None
        if not (self.tls_cert and self.tls_key):
            raise ValueError("TLS needs both a certificate and a key")
        pair = (Path(self.tls_key).read_bytes(), Path(self.tls_cert).read_bytes())
        ca = Path(self.tls_client_ca).read_bytes() if self.tls_client_ca else None
        return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


@dataclass(frozen=True)
class ServerOptions:
    """`port` and `chunk_bytes` are settings of the app's `grpc` (`mmserve.settings`)."""

    host: str = "[::]"
    port: int = setting(0, "each encoder replica's port; 0 = any free port", ge=0, le=65535)
    chunk_bytes: int = setting(DEFAULT_CHUNK_BYTES, "bytes per message of an embedding streamed to an LLM replica",
                               ge=1 << 16, le=3 << 20)
    security: ServerSecurity = ServerSecurity()
    limits: MediaLimits = MediaLimits()  # what one Encode item may be (the app's defaults)


def media_item(proto: encoder_pb2.MediaItem, pixels: bytearray | None = None) -> MediaItem:
    if (kind := _KINDS.get(proto.kind)) is None:
        raise InvalidRequest("media item kind must be IMAGE or VIDEO")
    if proto.HasField("decoded"):
        return MediaItem(kind, (), fps=proto.fps or 2.0, decoded=decoded_video(proto.decoded, pixels))
    if not proto.frames or (kind is MediaKind.IMAGE and len(proto.frames) != 1):
        raise InvalidRequest("an image has exactly one frame, a video at least one")
    return MediaItem(kind, tuple(proto.frames), fps=proto.fps or 2.0)


def decoded_video(proto: encoder_pb2.DecodedVideo, pixels: bytes | bytearray | None = None) -> DecodedVideo:
    """`pixels`: the video's pixels when they came apart from its header (EncodeStream)."""
    shape = tuple(proto.shape)
    data = proto.pixels if pixels is None else pixels
    if len(shape) != 4 or shape[-1] != 3 or min(shape) < 1 or int(np.prod(shape)) != len(data):
        raise InvalidRequest(f"decoded video: shape {shape} does not describe {len(data)} bytes of RGB frames")
    if not proto.indices or not proto.fps > 0 or max(proto.indices) >= proto.total_num_frames:
        raise InvalidRequest("decoded video: indices, fps and total_num_frames disagree")
    pixels = np.frombuffer(data, dtype=np.uint8).reshape(shape)
    return DecodedVideo(shape[:3], proto.fps, proto.total_num_frames, tuple(proto.indices), proto.content_hash, pixels)


class _TokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        if details.method.startswith(f"/{health.SERVICE_NAME}/"):
            return await continuation(details)
        given = dict(details.invocation_metadata or ()).get("authorization", "")
        if isinstance(given, str):
            given = given.encode()
        if hmac.compare_digest(given, self._expected):  # constant time: no timing oracle on the token
            return await continuation(details)

        async def deny(request, context: grpc.aio.ServicerContext):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong encoder service token")

        if details.method.endswith("/EncodeStream"):  # refused before a piece is read
            return grpc.stream_stream_rpc_method_handler(deny)
        return grpc.unary_unary_rpc_method_handler(deny)


class EncoderServicer(encoder_pb2_grpc.EncoderServiceServicer):
    """Thin adapter: protobuf <-> MediaItem / tensor; encoding runs in a worker thread."""

    def __init__(self, encoder: Encoder | None, store: ResultStore, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 limits: MediaLimits = MediaLimits()):
        self.encoder, self.store, self.chunk_bytes, self.limits = encoder, store, chunk_bytes, limits

    async def Encode(self, request: encoder_pb2.EncodeRequest,
                     context: grpc.aio.ServicerContext) -> AsyncIterator[encoder_pb2.EmbeddingChunk]:
        async for chunk in self._encode(request, None, context):
            yield chunk

    async def EncodeStream(self, pieces: AsyncIterator[encoder_pb2.EncodeChunk],
                           context: grpc.aio.ServicerContext) -> AsyncIterator[encoder_pb2.EmbeddingChunk]:
        first = await anext(aiter(pieces), None)
        if first is None or not first.request.item.HasField("decoded"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "EncodeStream sends a decoded video's header first")
        header = first.request.item.decoded
        try:
            size = self._declared_bytes(header)
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        pixels, filled = bytearray(size), 0
        async for piece in _then(first, pieces):
            if filled + len(piece.data) > size:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"decoded video: more than the {size} bytes "
                                    f"its shape {list(header.shape)} declares")
            pixels[filled:filled + len(piece.data)] = piece.data
            filled += len(piece.data)
        async for chunk in self._encode(first.request, pixels[:filled] if filled < size else pixels, context):
            yield chunk

    def _declared_bytes(self, header: encoder_pb2.DecodedVideo) -> int:
        """The bytes a video's header declares, refused beyond the limits before any is read."""
        shape = tuple(header.shape)
        if len(shape) != 4 or shape[-1] != 3 or min(shape) < 1:
            raise InvalidRequest(f"decoded video: shape {list(shape)} is not (frames, height, width, 3)")
        if shape[0] > self.limits.max_frames_per_video:
            raise InvalidRequest(f"video has {shape[0]} frames; the limit is {self.limits.max_frames_per_video}")
        if shape[1] * shape[2] > self.limits.max_pixels_per_image:
            raise InvalidRequest(f"video frames of {shape[2]}x{shape[1]}; the limit is "
                                 f"{self.limits.max_pixels_per_image} pixels")
        size = int(np.prod(shape))
        if size > MAX_DECODED_VIDEO_BYTES:
            raise InvalidRequest(f"decoded video of {size} bytes; the limit is {MAX_DECODED_VIDEO_BYTES}")
        return size

    async def _encode(self, request: encoder_pb2.EncodeRequest, pixels: bytearray | None,
                      context: grpc.aio.ServicerContext) -> AsyncIterator[encoder_pb2.EmbeddingChunk]:
        if self.encoder is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this server only serves published embeddings")
        try:
            item = media_item(request.item, pixels)
            self.limits.check([item])
            content_hash = item.content_hash
            planned = await asyncio.to_thread(self.encoder.plan, item, self.limits.max_pixels_per_image)
            [embedding] = await asyncio.to_thread(self.encoder.encode, [planned])
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Overloaded as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except torch.OutOfMemoryError:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "the encoder ran out of device memory")
        tensor = embedding.to_wire()
        if request.return_embedding:
            for chunk in to_chunks(content_hash, tensor, self.chunk_bytes, key=embedding.key):
                yield chunk
            return
        try:
            self.store.put(content_hash, tensor)
        except Overloaded as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        yield encoder_pb2.EmbeddingChunk(header=header_of(content_hash, tensor, key=embedding.key))

    async def FetchEmbedding(self, request: encoder_pb2.FetchEmbeddingRequest,
                             context: grpc.aio.ServicerContext) -> AsyncIterator[encoder_pb2.EmbeddingChunk]:
        tensor = await self.store.wait_acquire(request.content_hash, min(request.wait_ms, _MAX_WAIT_MS) / 1000)
        if tensor is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no embedding pinned for {request.content_hash!r}")
        delivered = False
        try:
            for chunk in to_chunks(request.content_hash, tensor, self.chunk_bytes):
                yield chunk
            delivered = True
        finally:
            self.store.finish(request.content_hash, delivered)


async def _then(first, rest: AsyncIterator):
    yield first
    async for item in rest:
        yield item


async def start_server(encoder: Encoder | None, store: ResultStore,
                       options: ServerOptions = ServerOptions()) -> tuple[grpc.aio.Server, int]:
    """A started server on the running loop and the port it bound."""
    interceptors = [_TokenInterceptor(options.security.token)] if options.security.token else []
    server = grpc.aio.server(interceptors=interceptors,
                             options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])
    servicer = EncoderServicer(encoder, store, options.chunk_bytes, options.limits)
    encoder_pb2_grpc.add_EncoderServiceServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"{options.host}:{options.port}"
    credentials = options.security.credentials()
    port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind the encoder gRPC server to {address}")
    await server.start()
    for service in ("", SERVICE_NAME):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    logger.info("EncoderService listening on %s:%d (tls %s, token %s)", options.host, port,
                credentials is not None, bool(options.security.token))
    return server, port


class ServerThread:
    """The server on its own event loop in a daemon thread (for hosts with their own loop)."""

    def __init__(self, encoder: Encoder | None, store: ResultStore, options: ServerOptions = ServerOptions()):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="encoder-grpc", daemon=True)
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(start_server(encoder, store, options), self._loop)
        self._server, self.port = future.result(timeout=30)

    def stop(self, grace_s: float = 1.0) -> None:
        asyncio.run_coroutine_threadsafe(self._server.stop(grace_s), self._loop).result(timeout=grace_s + 5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)


async def serve_forever(encoder: Encoder, options: ServerOptions, ttl_s: float) -> None:
    """The standalone microservice: serve until cancelled (Ctrl-C)."""
    server, port = await start_server(encoder, ResultStore(ttl_s=ttl_s), options)
    print(f"EncoderService ready on {options.host}:{port}", flush=True)
    try:
        await server.wait_for_termination()
    finally:
        await server.stop(2.0)
