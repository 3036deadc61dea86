"""The standalone EncoderService (no Ray) answers a plain grpcio client."""

import os
import subprocess
import sys

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from encoder_service import VisionEncoder
from encoder_service.rpc.result_store import ResultStore
from encoder_service.rpc.server import ServerOptions, ServerSecurity, ServerThread
from mmserve.inputs.media import MediaItem, MediaKind
from mmserve.rpc.embedding_wire import from_chunks
from protos.mmserve.v1 import encoder_pb2, encoder_pb2_grpc
from tests.support.media_factory import image_bytes, video_frames

TOKEN = (("authorization", "Bearer tok"),)


@pytest.fixture(scope="module")
def encoder(tiny_models):
    return VisionEncoder(tiny_models["qwen2_vl"], dtype="float32")


@pytest.fixture(scope="module")
def server(encoder):
    server = ServerThread(encoder, ResultStore(ttl_s=60),
                          ServerOptions(host="127.0.0.1", chunk_bytes=4096, security=ServerSecurity(token="tok")))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        yield ch


def _image_proto(data: bytes) -> encoder_pb2.MediaItem:
    return encoder_pb2.MediaItem(kind=encoder_pb2.MediaItem.IMAGE, frames=[data])


def test_encode_streams_the_in_process_embedding(encoder, channel):
    data = image_bytes(224, 280, 21)  # the embedding spans several 4 KiB chunks
    stub = encoder_pb2_grpc.EncoderServiceStub(channel)
    chunks = list(stub.Encode(encoder_pb2.EncodeRequest(item=_image_proto(data), return_embedding=True),
                              metadata=TOKEN, timeout=120))
    header, tensor = from_chunks(chunks)
    assert len(chunks) > 1 and all(len(c.data) <= 4096 for c in chunks)
    [expected] = encoder.encode([MediaItem(MediaKind.IMAGE, (data,))])
    assert torch.equal(tensor, expected.rows) and header.key == expected.key != ""
    expected = expected.rows
    assert header.content_hash == MediaItem(MediaKind.IMAGE, (data,)).content_hash
    assert list(header.shape) == list(expected.shape) and header.dtype == "float32"


def test_encode_pinned_then_fetch_by_hash(encoder, channel):
    frames = video_frames(4, 56, 84, 22)
    item = encoder_pb2.MediaItem(kind=encoder_pb2.MediaItem.VIDEO, frames=frames, fps=1.0)
    stub = encoder_pb2_grpc.EncoderServiceStub(channel)
    [only] = list(stub.Encode(encoder_pb2.EncodeRequest(item=item), metadata=TOKEN, timeout=120))
    assert only.header.num_bytes > 0 and not only.data
    request = encoder_pb2.FetchEmbeddingRequest(content_hash=only.header.content_hash)
    _, tensor = from_chunks(stub.FetchEmbedding(request, metadata=TOKEN, timeout=60))
    [expected] = encoder.encode([MediaItem(MediaKind.VIDEO, tuple(frames), fps=1.0)])
    assert torch.equal(tensor, expected.rows) and only.header.key == expected.key
    with pytest.raises(grpc.RpcError) as e:  # fetched once: unpinned
        list(stub.FetchEmbedding(request, metadata=TOKEN, timeout=60))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_corrupt_image_is_invalid_argument(channel):
    data = image_bytes(64, 64, 23)
    stub = encoder_pb2_grpc.EncoderServiceStub(channel)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Encode(encoder_pb2.EncodeRequest(item=_image_proto(data[:100])), metadata=TOKEN, timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "decode" in e.value.details()


def test_the_apps_media_limits_hold_before_anything_is_decoded(channel):
    """A 9000x9000 PNG (a few hundred KB, 81 MP) is refused from its header; a video over the
    frame limit by its count."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (9000, 9000)).save(buf, format="PNG")
    stub = encoder_pb2_grpc.EncoderServiceStub(channel)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Encode(encoder_pb2.EncodeRequest(item=_image_proto(buf.getvalue())), metadata=TOKEN, timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "40000000" in e.value.details()
    frames = video_frames(65, 8, 8, 24)
    item = encoder_pb2.MediaItem(kind=encoder_pb2.MediaItem.VIDEO, frames=frames, fps=1.0)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Encode(encoder_pb2.EncodeRequest(item=item), metadata=TOKEN, timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "65 frames; the limit is 64" in e.value.details()


def test_the_command_listens_on_loopback_by_default_and_beyond_only_with_a_token(tiny_models, capsys, monkeypatch):
    from deployments.cli.ingress_modes import free_loopback_port
    from deployments.cli.main import main

    monkeypatch.delenv("MMSERVE_ENCODER_TOKEN", raising=False)
    assert main(["encoder-server", "--model", tiny_models["qwen2_vl"], "--host", "0.0.0.0"]) == 2
    assert "refusing to listen on 0.0.0.0 without a token" in capsys.readouterr().err
    port = free_loopback_port()
    env = {k: v for k, v in os.environ.items() if k != "MMSERVE_ENCODER_TOKEN"}
    proc = subprocess.Popen([sys.executable, "-m", "deployments.cli.main", "encoder-server", "--model",
                             tiny_models["qwen2_vl"], "--port", str(port)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == f"EncoderService ready on 127.0.0.1:{port}"
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=30)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_token_required_but_not_for_health(channel):
    stub = encoder_pb2_grpc.EncoderServiceStub(channel)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.FetchEmbedding(encoder_pb2.FetchEmbeddingRequest(content_hash="x"), timeout=30))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "mmserve.v1.EncoderService"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=30)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_encoder_and_health(channel):
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    [answer] = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                              metadata=TOKEN))
    names = {s.name for s in answer.list_services_response.service}
    assert {"mmserve.v1.EncoderService", "grpc.health.v1.Health"} <= names


def _decoded_video(frames=8, h=480, w=400):
    import numpy as np

    from mmserve.inputs.media import DecodedVideo

    pixels = np.random.default_rng(0).integers(0, 255, (frames, h, w, 3), dtype=np.uint8)  # 4.6 MB at the default
    return MediaItem(MediaKind.VIDEO, (), decoded=DecodedVideo((frames, h, w), 10.0, 40,
                                                               tuple(range(0, 5 * frames, 5)), "h" * 64, pixels))


def _pieces(item, piece_bytes=1 << 20, extra=b""):
    from mmserve.rpc.encoder_client import _item_proto

    data = item.decoded.pixels.tobytes() + extra
    yield encoder_pb2.EncodeChunk(request=encoder_pb2.EncodeRequest(item=_item_proto(item, with_pixels=False),
                                                                    return_embedding=True))
    for start in range(0, len(data), piece_bytes):
        yield encoder_pb2.EncodeChunk(data=data[start:start + piece_bytes])


def test_a_decoded_video_crosses_in_pieces_and_encodes_as_in_process(encoder, server, channel):
    """A video_url file's sampled frames (the router's VideoDecoder output) reach a standalone
    encoder as raw uint8 in 1 MiB pieces (no message is large) and encode as they do in-process;
    the client library sends them so too."""
    import asyncio

    from mmserve.rpc.encoder_client import EncoderClient

    item = _decoded_video()
    stub = encoder_pb2_grpc.EncoderServiceStub(channel)
    header, tensor = from_chunks(list(stub.EncodeStream(_pieces(item), metadata=TOKEN, timeout=120)))
    [expected] = encoder.encode([item])
    assert torch.equal(tensor, expected.rows) and header.content_hash == "h" * 64

    async def by_client():
        client = EncoderClient(f"127.0.0.1:{server.port}", token="tok")
        try:
            return await client.encode(item)
        finally:
            await client.close()

    assert torch.equal(asyncio.run(by_client()).rows, expected.rows)


def test_a_streamed_video_is_checked_before_its_pixels_are_read(channel):
    """No token: refused before a piece is read; a declared shape over the limits or a shape that is
    not RGB frames: refused from the header; more pixels than declared, or fewer: refused."""
    stub = encoder_pb2_grpc.EncoderServiceStub(channel)
    item = _decoded_video(2, 64, 64)

    def code(pieces, metadata=TOKEN):
        with pytest.raises(grpc.RpcError) as e:
            list(stub.EncodeStream(pieces, metadata=metadata, timeout=60))
        return e.value.code(), e.value.details()

    assert code(_pieces(item), metadata=())[0] == grpc.StatusCode.UNAUTHENTICATED
    huge = _pieces(_decoded_video(2, 64, 64))
    first = next(huge)
    first.request.item.decoded.shape[:] = [2, 9000, 9000, 3]  # 81 M pixels a frame: over max_pixels_per_image
    assert code(iter([first])) == (grpc.StatusCode.INVALID_ARGUMENT,
                                   "video frames of 9000x9000; the limit is 40000000 pixels")
    first.request.item.decoded.shape[:] = [2, 64, 64, 4]
    assert "is not (frames, height, width, 3)" in code(iter([first]))[1]
    assert "more than the 24576 bytes" in code(_pieces(item, extra=b"x"))[1]
    short = list(_pieces(item, piece_bytes=1000))[:-1]
    assert "does not describe" in code(iter(short))[1]


def test_one_message_is_at_most_the_request_size(channel):
    """A 70 MB Encode message (beyond the app's 64 MiB request bound) is refused as it arrives."""
    stub = encoder_pb2_grpc.EncoderServiceStub(channel)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Encode(encoder_pb2.EncodeRequest(item=_image_proto(b"\0" * 70_000_000)), metadata=TOKEN, timeout=60))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
