"""Embeddings on the wire: a tensor as a stream of `EmbeddingChunk`s and back, bit for bit.

The first chunk carries the header (content hash, dtype, shape, byte count); the data of all
chunks concatenated is the tensor's memory in C order. Chunks stay far below gRPC's 4 MiB
message limit, so any embedding passes without raising it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from protos.mmserve.v1 import encoder_pb2

DEFAULT_CHUNK_BYTES = 1 << 20
_DTYPES = {name: getattr(torch, name) for name in ("float16", "bfloat16", "float32", "float64")}


class WireError(ValueError):
    """A chunk stream that does not describe a whole tensor."""


def header_of(content_hash: str, tensor: torch.Tensor, key: str = "") -> encoder_pb2.EmbeddingHeader:
    dtype = str(tensor.dtype).removeprefix("torch.")
    return encoder_pb2.EmbeddingHeader(content_hash=content_hash, key=key, dtype=dtype, shape=list(tensor.shape),
                                       num_bytes=tensor.numel() * tensor.element_size())


def to_chunks(content_hash: str, tensor: torch.Tensor, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
              key: str = "") -> Iterator[encoder_pb2.EmbeddingChunk]:
    """The tensor (any supported dtype, on CPU) as header + data chunks of at most `chunk_bytes`."""
    if (header := header_of(content_hash, tensor, key)).dtype not in _DTYPES:
        raise WireError(f"unsupported dtype {tensor.dtype}")
    data = memoryview(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
    yield encoder_pb2.EmbeddingChunk(header=header, data=bytes(data[:chunk_bytes]))
    for start in range(chunk_bytes, len(data), chunk_bytes):
        yield encoder_pb2.EmbeddingChunk(data=bytes(data[start:start + chunk_bytes]))


def from_chunks(chunks: Iterable[encoder_pb2.EmbeddingChunk]) -> tuple[encoder_pb2.EmbeddingHeader, torch.Tensor]:
    """Reassemble what `to_chunks` sent; WireError when the stream is cut or inconsistent."""
    header, buffer, filled = None, bytearray(), 0
    for chunk in chunks:
        if header is None:
            if not chunk.HasField("header"):
                raise WireError("embedding stream does not start with a header")
            header = chunk.header
            buffer = bytearray(header.num_bytes)
        if (end := filled + len(chunk.data)) > len(buffer):
            raise WireError(f"embedding stream carries more than the {header.num_bytes} bytes announced")
        buffer[filled:end] = chunk.data
        filled = end
    if header is None:
        raise WireError("empty embedding stream")
    return header, tensor_of(header, buffer, filled)


def tensor_of(header: encoder_pb2.EmbeddingHeader, buffer: bytearray, filled: int) -> torch.Tensor:
    if filled != header.num_bytes:
        raise WireError(f"embedding stream ended after {filled} of {header.num_bytes} bytes")
    if (dtype := _DTYPES.get(header.dtype)) is None:
        raise WireError(f"unsupported dtype {header.dtype!r}")
    if not buffer:
        return torch.empty(tuple(header.shape), dtype=dtype)
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).reshape(tuple(header.shape))
