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
from mmserve.request.media import MediaItem, MediaKind
from mmserve.rpc.embedding_wire import from_chunks
from protos.mmserve.v1 import encoder_pb2, encoder_pb2_grpc
from tests.support.media_factory import image_bytes, video_frames

TOKEN = (("authorization", "Bearer tok"),)


@pytest.fixture(scope="module")
def encoder(tiny_models):
    return VisionEncoder(tiny_models["qwen2_vl"], dtype="float32")


@pytest.fixture(scope="module")
def channel(encoder):
    server = ServerThread(encoder, ResultStore(ttl_s=60),
                          ServerOptions(host="127.0.0.1", chunk_bytes=4096, security=ServerSecurity(token="tok")))
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        yield ch
    server.stop()


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


def test_a_decoded_video_crosses_as_uint8_frames_beyond_4_mib(encoder, channel):
    """A video_url file's sampled frames (the router's VideoDecoder output) reach a standalone
    encoder as raw uint8 (one message past gRPC's default 4 MiB) and encode as they do in-process;
    a shape that does not describe the bytes is INVALID_ARGUMENT."""
    import numpy as np

    from mmserve.request.media import DecodedVideo
    from mmserve.rpc.encoder_client import _item_proto

    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 255, (8, 480, 400, 3), dtype=np.uint8)  # 4.6 MB
    item = MediaItem(MediaKind.VIDEO, (), decoded=DecodedVideo((8, 480, 400), 10.0, 40, tuple(range(0, 40, 5)), "h" * 64, pixels))
    stub = encoder_pb2_grpc.EncoderServiceStub(channel)
    chunks = list(stub.Encode(encoder_pb2.EncodeRequest(item=_item_proto(item), return_embedding=True),
                              metadata=TOKEN, timeout=120))
    header, tensor = from_chunks(chunks)
    [expected] = encoder.encode([item])
    assert torch.equal(tensor, expected.rows) and header.content_hash == "h" * 64
    bad = _item_proto(item)
    bad.decoded.shape[:] = [8, 480, 400, 4]
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Encode(encoder_pb2.EncodeRequest(item=bad), metadata=TOKEN, timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "does not describe" in e.value.details()
