"""Transport `grpc` against a real EncoderService server: bit-identical tensors, pinning, auth."""

import asyncio
import dataclasses

import psutil
import pytest
import torch
from pydantic import ValidationError

from deployments.config import GrpcArgs
from deployments.core.llm_inputs import PinnedEmbedding
from deployments.serve.transport import GrpcFetcher, GrpcPublisher, resolve
from mmserve.inputs.embeddings import ItemEmbedding
from mmserve.inputs.media import EncodeItem, MediaItem, MediaKind
from mmserve.rpc.encoder_client import EmbeddingNotFound, EncodedRef, EncoderClient


def _item(i: int) -> EncodeItem:
    return EncodeItem(MediaItem(MediaKind.IMAGE, (f"image-{i}".encode(),)), None, 0)


@pytest.fixture(scope="module")
def publisher():
    pub = GrpcPublisher(GrpcArgs(bind_host="127.0.0.1", token="s3cret", chunk_bytes=1 << 20), host="127.0.0.1")
    yield pub
    pub.stop()


def _roundtrip(publisher, tensors):
    """Publish tensors (or whole `ItemEmbedding`s), fetch them back: (refs, the tensors' rows)."""
    refs, embeddings = _roundtrip_embeddings(publisher, [
        t if isinstance(t, ItemEmbedding) else ItemEmbedding((t,), f"key-{i}") for i, t in enumerate(tensors)
    ])
    return refs, [e.rows for e in embeddings]


def _roundtrip_embeddings(publisher, embeddings):
    refs = publisher.publish([_item(i) for i in range(len(embeddings))], embeddings)
    fetcher = GrpcFetcher(GrpcArgs(token="s3cret"))

    async def go():
        try:
            return await resolve([PinnedEmbedding(ref) for ref in refs], fetcher)
        finally:
            await fetcher.close()

    back = asyncio.run(go())
    assert [b.key for b in back] == [e.key for e in embeddings]
    return refs, back


def test_output_parts_cross_as_one_unit(publisher):
    """Several parts per item (DeepStack features) arrive together, in order, bit for bit."""
    gen = torch.Generator().manual_seed(3)
    parts = tuple(torch.randn(7, 16, generator=gen).to(torch.bfloat16) for _ in range(3))
    _, [back] = _roundtrip_embeddings(publisher, [ItemEmbedding(parts, "deepstack-key")])
    assert len(back.parts) == 3
    assert all(torch.equal(b.view(torch.int16), p.view(torch.int16)) for b, p in zip(back.parts, parts))


def test_real_qwen3_vl_output_crosses_bit_identical(publisher, qwen3_dir):
    """A Qwen3-VL encoder output (embeddings + DeepStack features) of an image and a video."""
    from tests.support.cases import family_cases
    from tests.support.pipeline import runtimes, to_planner_messages

    planner, encoder, _ = runtimes(qwen3_dir)
    outputs = encoder.encode(planner.plan(to_planner_messages(family_cases("qwen3_vl")["image_and_video"])).media)
    assert len(outputs) == 2 and all(len(e.parts) > 1 for e in outputs)
    _, back = _roundtrip_embeddings(publisher, outputs)
    for got, sent in zip(back, outputs):
        assert len(got.parts) == len(sent.parts)
        assert all(torch.equal(b.view(torch.int64), p.view(torch.int64)) for b, p in zip(got.parts, sent.parts))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_embedding_crosses_bit_identical(publisher, dtype):
    tensor = torch.randn(300, 64, generator=torch.Generator().manual_seed(0)).to(dtype)
    refs, [back] = _roundtrip(publisher, [tensor])
    assert back.dtype == dtype and back.shape == tensor.shape
    assert torch.equal(back.view(torch.uint8), tensor.view(torch.uint8))
    assert refs[0].num_bytes == tensor.numel() * tensor.element_size()


def test_20mb_embedding_crosses_intact(publisher):
    tensor = torch.randn(5120, 2048, generator=torch.Generator().manual_seed(1))  # 40 MB fp32 -> 20 MB bf16
    tensor = tensor.to(torch.bfloat16)
    assert tensor.numel() * tensor.element_size() >= 20_000_000
    _, [back] = _roundtrip(publisher, [tensor])
    assert torch.equal(back.view(torch.int16), tensor.view(torch.int16))


def test_result_is_unpinned_after_fetch(publisher):
    tensor = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    refs, [back] = _roundtrip(publisher, [tensor])
    assert torch.equal(back, tensor)
    assert refs[0].content_hash not in publisher.store

    async def again():
        client = EncoderClient(refs[0].address, "s3cret")
        try:
            await client.fetch(refs[0].content_hash)
        finally:
            await client.close()

    with pytest.raises(EmbeddingNotFound):
        asyncio.run(again())


def test_wrong_token_is_unauthenticated(publisher):
    import grpc

    [ref] = publisher.publish([_item(99)], [ItemEmbedding((torch.ones(2, 2),), "k")])

    async def steal():
        client = EncoderClient(ref.address, "guess")
        try:
            await client.fetch(ref.content_hash)
        finally:
            await client.close()

    with pytest.raises(grpc.aio.AioRpcError) as e:
        asyncio.run(steal())
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert ref.content_hash in publisher.store  # still pinned for the rightful fetch


def _listening(port: int) -> set[str]:
    """The addresses this process listens on at `port` (an IPv4 one mapped into a dual-stack socket as IPv4)."""
    return {c.laddr.ip.removeprefix("::ffff:") for c in psutil.Process().net_connections("inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


def _ipv6_loopback() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_without_a_token_each_encoder_replicas_server_listens_on_loopback_only():
    """`transport: grpc` with neither grpc.token nor grpc.token_env: the EncoderService (Encode,
    FetchEmbedding) binds 127.0.0.1 and says so in its refs, so a one-node app (`mmserve serve`, the
    serve tests) works and nothing unauthenticated listens beyond loopback; with a token it binds
    every interface and advertises the node's address, as across nodes (k8s)."""
    open_ = GrpcPublisher(GrpcArgs())
    try:
        port = int(open_.address.rsplit(":", 1)[1])
        assert _listening(port) == {"127.0.0.1"} and open_.address == f"127.0.0.1:{port}"
        tensor = torch.arange(6, dtype=torch.float32).reshape(2, 3)
        [ref] = open_.publish([_item(0)], [ItemEmbedding((tensor,), "k")])
        assert torch.equal(_fetch_once(ref).rows, tensor)  # one node: fetched over loopback
    finally:
        open_.stop()
    if _ipv6_loopback():
        six = GrpcPublisher(GrpcArgs(bind_host="::1"))
        try:
            port = int(six.address.rsplit(":", 1)[1])
            assert _listening(port) == {"::1"} and six.address == f"[::1]:{port}"
        finally:
            six.stop()
    for args in (GrpcArgs(token="s3cret"), GrpcArgs(bind_host="0.0.0.0", token="s3cret")):
        secured = GrpcPublisher(args, host="10.0.0.5")
        try:
            port = int(secured.address.rsplit(":", 1)[1])
            assert _listening(port) & {"::", "0.0.0.0"} and secured.address == f"10.0.0.5:{port}"
        finally:
            secured.stop()


@pytest.mark.parametrize("host", ["[::]", "::", "0.0.0.0", "10.1.2.3", "encoder.example"])
def test_a_bind_beyond_loopback_without_a_token_is_refused_naming_token_env(host):
    with pytest.raises(ValidationError, match=r"grpc.bind_host .* needs grpc.token_env"):
        GrpcArgs(bind_host=host)
    assert GrpcArgs(bind_host=host, token_env="MMSERVE_GRPC_TOKEN").listen_host() == host
    assert GrpcArgs(bind_host=host, token="s3cret").listen_host() == host
    for loopback in ("127.0.0.1", "::1", "[::1]", "localhost"):
        assert GrpcArgs(bind_host=loopback).listen_host() == loopback
    assert GrpcArgs().listen_host() == "127.0.0.1"
    assert GrpcArgs(token_env="MMSERVE_GRPC_TOKEN").listen_host() == "[::]"


def test_a_loopback_ref_from_another_node_fails_saying_to_set_token_env():
    """Across nodes without a token the encoder's loopback address is not this node's: the LLM
    replica says so instead of fetching from its own loopback."""
    ref = dataclasses.replace(EncodedRef("127.0.0.1:1", "hash", "float32", (2, 2)), node="another-node")
    with pytest.raises(RuntimeError, match="loopback only .* grpc.token_env"):
        _fetch_once(ref)


def _fetch_once(ref):
    """`ref` fetched by a new untokened fetcher, closed after."""
    fetcher = GrpcFetcher(GrpcArgs())

    async def fetch():
        try:
            return await fetcher.fetch(ref)
        finally:
            await fetcher.close()

    return asyncio.run(fetch())
