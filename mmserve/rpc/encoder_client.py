"""Client of the internal `EncoderService` (grpc.aio): encode media, fetch embeddings by hash.

Used by the LLM side of `transport: grpc` and by callers of a standalone encoder server. The
channel never needs a raised message limit: embeddings arrive as chunks.
"""

from __future__ import annotations

from collections.abc import AsyncIterable
from dataclasses import dataclass

import grpc
import numpy as np
import torch

from mmserve.errors import InvalidRequest, Overloaded
from mmserve.inputs.embeddings import ItemEmbedding
from mmserve.inputs.encode_timing import EncodeTiming
from mmserve.inputs.media import MediaItem, MediaKind
from mmserve.rpc.embedding_wire import from_chunks
from protos.mmserve.v1 import encoder_pb2, encoder_pb2_grpc

PIECE_BYTES = 4 * 1024 * 1024  # EncodeStream's pieces (the server's STREAM_PIECE_BYTES)


@dataclass(frozen=True)
class EncodedRef:
    """Where an embedding waits: the server's address and the item's content hash."""

    address: str
    content_hash: str
    dtype: str
    shape: tuple[int, ...]
    key: str = ""  # the output's identity (`ItemEmbedding.key`)
    timing: EncodeTiming | None = None  # the encode call's view of the item (an app's encoder replica)
    node: str = ""  # the Ray node of a server on loopback (reachable from that node only); "": any

    @property
    def num_bytes(self) -> int:
        return torch.empty((), dtype=getattr(torch, self.dtype)).element_size() * int(torch.Size(self.shape).numel())


class EmbeddingNotFound(LookupError):
    """The server holds no embedding under that hash (fetched already, expired, or never encoded)."""


class EncoderClient:
    """One channel to one EncoderService; safe to share between concurrent coroutines."""

    def __init__(self, address: str, token: str | None = None, root_certificates: bytes | None = None,
                 timeout_s: float = 60.0):
        self.address, self.timeout_s = address, timeout_s
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._channel = (grpc.aio.insecure_channel(address) if root_certificates is None else
                         grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(root_certificates)))
        self._stub = encoder_pb2_grpc.EncoderServiceStub(self._channel)

    def _call(self, item: MediaItem, return_embedding: bool):
        """Encode, or EncodeStream for a decoded video (its pixels in pieces: no message is large)."""
        if item.decoded is None:
            request = encoder_pb2.EncodeRequest(item=_item_proto(item), return_embedding=return_embedding)
            return self._stub.Encode(request, metadata=self._metadata, timeout=self.timeout_s)
        header = encoder_pb2.EncodeRequest(item=_item_proto(item, with_pixels=False), return_embedding=return_embedding)
        pixels = memoryview(np.ascontiguousarray(item.decoded.pixels)).cast("B")

        def pieces():
            yield encoder_pb2.EncodeChunk(request=header)
            for start in range(0, len(pixels), PIECE_BYTES):
                yield encoder_pb2.EncodeChunk(data=bytes(pixels[start:start + PIECE_BYTES]))

        return self._stub.EncodeStream(pieces(), metadata=self._metadata, timeout=self.timeout_s)

    async def encode(self, item: MediaItem) -> ItemEmbedding:
        """Encode `item` and stream the embedding back (nothing stays pinned on the server)."""
        header, tensor = from_chunks(await _chunks(self._call(item, return_embedding=True)))
        return ItemEmbedding.from_wire(tensor, header.key)

    async def encode_pinned(self, item: MediaItem) -> EncodedRef:
        """Encode `item` and leave the embedding pinned on the server for one `fetch`."""
        header = (await _chunks(self._call(item, return_embedding=False)))[0].header
        return EncodedRef(self.address, header.content_hash, header.dtype, tuple(header.shape), header.key)

    async def fetch(self, content_hash: str, wait_ms: int = 0) -> torch.Tensor:
        """The tensor pinned under `content_hash` (`ItemEmbedding.to_wire`), bit for bit; releases the pin."""
        request = encoder_pb2.FetchEmbeddingRequest(content_hash=content_hash, wait_ms=wait_ms)
        call = self._stub.FetchEmbedding(request, metadata=self._metadata, timeout=self.timeout_s)
        return from_chunks(await _chunks(call))[1]

    async def fetch_embedding(self, ref: EncodedRef, wait_ms: int = 0) -> ItemEmbedding:
        return ItemEmbedding.from_wire(await self.fetch(ref.content_hash, wait_ms), ref.key)

    async def close(self) -> None:
        await self._channel.close()


async def _chunks(call: AsyncIterable[encoder_pb2.EmbeddingChunk]) -> list[encoder_pb2.EmbeddingChunk]:
    try:
        return [chunk async for chunk in call]
    except grpc.aio.AioRpcError as e:
        raise _translate(e) from None


def _item_proto(item: MediaItem, with_pixels: bool = True) -> encoder_pb2.MediaItem:
    kind = encoder_pb2.MediaItem.IMAGE if item.kind is MediaKind.IMAGE else encoder_pb2.MediaItem.VIDEO
    decoded = None
    if (video := item.decoded) is not None:
        decoded = encoder_pb2.DecodedVideo(
            pixels=video.pixels.tobytes() if with_pixels else b"", shape=video.pixels.shape, fps=video.fps,
            total_num_frames=video.total_num_frames, indices=video.indices, content_hash=video.content_hash)
    return encoder_pb2.MediaItem(kind=kind, frames=list(item.frames), fps=item.fps, decoded=decoded)


def _translate(e: grpc.aio.AioRpcError) -> Exception:
    if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidRequest(e.details() or "invalid media item")
    if e.code() == grpc.StatusCode.NOT_FOUND:
        return EmbeddingNotFound(e.details())
    if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return Overloaded(e.details() or "the encoder is overloaded")
    return e
