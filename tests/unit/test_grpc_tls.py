"""The standalone EncoderService behind TLS and a token, from a real grpcio client."""

import asyncio

import grpc
import pytest
import torch

from encoder_service import VisionEncoder
from encoder_service.rpc.result_store import ResultStore
from encoder_service.rpc.server import ServerOptions, ServerSecurity, ServerThread
from mmserve.inputs.media import MediaItem, MediaKind
from mmserve.rpc.encoder_client import EncoderClient
from tests.support.media_factory import image_bytes
from tests.support.tls_certs import self_signed


@pytest.fixture(scope="module")
def tls_server(tiny_models, tmp_path_factory):
    cert, key = self_signed(tmp_path_factory.mktemp("tls"))
    encoder = VisionEncoder(tiny_models["qwen2_vl"], dtype="float64")
    security = ServerSecurity("t0ken", tls_cert=str(cert), tls_key=str(key))
    server = ServerThread(encoder, ResultStore(ttl_s=60), ServerOptions("127.0.0.1", 0, security=security))
    yield f"localhost:{server.port}", cert.read_bytes(), encoder
    server.stop()


def _encode(address, token, roots, item):
    async def go():
        client = EncoderClient(address, token, root_certificates=roots, timeout_s=20)
        try:
            return await client.encode(item)
        finally:
            await client.close()

    return asyncio.run(go())


def test_tls_client_with_token_gets_the_in_process_embedding(tls_server):
    address, roots, encoder = tls_server
    item = MediaItem(MediaKind.IMAGE, (image_bytes(64, 96, 7),))
    got, [expected] = _encode(address, "t0ken", roots, item), encoder.encode([item])
    assert torch.equal(got.rows, expected.rows) and got.key == expected.key


def test_plaintext_client_cannot_talk_to_the_tls_server(tls_server):
    address, _, _ = tls_server
    item = MediaItem(MediaKind.IMAGE, (image_bytes(32, 32, 8),))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        _encode(address, "t0ken", None, item)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_tls_client_without_the_token_is_unauthenticated(tls_server):
    address, roots, _ = tls_server
    item = MediaItem(MediaKind.IMAGE, (image_bytes(32, 32, 9),))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        _encode(address, None, roots, item)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
