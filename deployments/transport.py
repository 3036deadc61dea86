"""How an item's embedding gets from the encoder to the LLM replica, by either transport.

With `transport: object_store` (the default) encoder results are `ItemEmbedding`s that Ray moves;
with `transport: grpc` each encoder replica runs an `EncoderService` server and its results are
`EncodedRef`s, which the LLM replica resolves by streaming them from that server. Both give the
same tensors bit for bit. The router hands the LLM one `EmbeddingHandle` per item either way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from deployments.config import GrpcArgs
from encoder_service.grpc_server import Encoder, ServerOptions, ServerSecurity, ServerThread
from encoder_service.result_store import ResultStore
from mmserve.embeddings import ItemEmbedding
from mmserve.encoder_client import EmbeddingNotFound, EncodedRef, EncoderClient
from mmserve.errors import EmbeddingsLost
from mmserve.media import EncodeItem



@dataclass(frozen=True)
class EmbeddingHandle:
    """Where one item's encoder output is, or will be.

    `ref` is the ObjectRef of one encoder call's result list and `index` the item's place in it
    (the router owns the ref, so it outlives the encoder replica that computed it), or `ref` is
    an `EncodedRef` pinned on an encoder's gRPC server and `index` is None. An encoder call's
    results are themselves `ItemEmbedding`s, or `EncodedRef`s with `transport: grpc`.
    """

    ref: object
    index: int | None = None


def advertised_host() -> str:
    """This node's address as other nodes reach it (127.0.0.1 outside Ray)."""
    import ray

    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"


class GrpcPublisher:
    """Encoder side: serves this replica's results and pins each one until fetched or expired."""

    def __init__(self, args: GrpcArgs, encoder: Encoder | None = None, host: str | None = None):
        self.store = ResultStore(ttl_s=args.result_ttl_s, max_bytes=args.result_store_bytes)
        options = ServerOptions(args.bind_host, args.port, args.chunk_bytes, ServerSecurity(token=args.token))
        self._server = ServerThread(encoder, self.store, options)
        self.address = f"{host or advertised_host()}:{self._server.port}"

    def publish(self, items: Sequence[EncodeItem], embeddings: Sequence[ItemEmbedding]) -> list[EncodedRef]:
        """Pin each embedding for one fetch; what to return to the caller instead of the tensors.

        Raises `Overloaded` when the store is full."""
        refs = []
        for item, embedding in zip(items, embeddings, strict=True):
            content_hash = item.item.content_hash
            wire = embedding.to_wire()
            self.store.put(content_hash, wire)
            dtype = str(wire.dtype).removeprefix("torch.")
            refs.append(EncodedRef(self.address, content_hash, dtype, tuple(wire.shape), embedding.key))
        return refs

    def stop(self) -> None:
        self._server.stop()


class GrpcFetcher:
    """LLM side: one channel per encoder address, reused across requests."""

    def __init__(self, args: GrpcArgs):
        self._token = args.token
        self._timeout_s = args.fetch_timeout_s
        self._clients: dict[str, EncoderClient] = {}
        # a standalone encoder may be behind TLS; encoder replicas inside the cluster are not
        self._tls_roots: dict[str, bytes] = {}
        if args.tls_ca and args.encoder_address:
            self._tls_roots[args.encoder_address] = Path(args.tls_ca).read_bytes()

    def _client(self, address: str) -> EncoderClient:
        client = self._clients.get(address)
        if client is None:
            client = self._clients[address] = EncoderClient(
                address, self._token, root_certificates=self._tls_roots.get(address), timeout_s=self._timeout_s
            )
        return client

    async def fetch(self, ref: EncodedRef) -> ItemEmbedding:
        return await self._client(ref.address).fetch_embedding(ref)

    async def close(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        await asyncio.gather(*(c.close() for c in clients))


async def resolve(handles: Sequence[EmbeddingHandle], fetcher: GrpcFetcher | None) -> list[ItemEmbedding]:
    """The outputs behind `handles`, in order: each encoder call's result list is awaited once,
    `EncodedRef`s are fetched concurrently (they need `fetcher`).

    Raises `EmbeddingsLost` naming every item whose encoder replica is gone (its call died, or
    its pinned gRPC result can no longer be fetched), so the router can re-encode just those.
    """
    calls = list(dict.fromkeys(h.ref for h in handles if h.index is not None))
    results = dict(zip(calls, await asyncio.gather(*calls, return_exceptions=True)))

    async def one(h: EmbeddingHandle) -> ItemEmbedding:
        found = h.ref if h.index is None else results[h.ref]
        if isinstance(found, BaseException):
            raise found
        if h.index is not None:
            found = found[h.index]
        if isinstance(found, ItemEmbedding):
            return found
        if fetcher is None:
            raise RuntimeError("an encoder returned a gRPC reference but this replica has no gRPC fetcher")
        return await fetcher.fetch(found)

    outcomes = await asyncio.gather(*(one(h) for h in handles), return_exceptions=True)
    lost = tuple(i for i, o in enumerate(outcomes) if isinstance(o, BaseException) and encoder_lost(o))
    if lost:
        raise EmbeddingsLost(lost)
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome
    return list(outcomes)


def encoder_lost(e: BaseException) -> bool:
    """True when `e` means the encoder that computed (or holds) an item is gone, not that the item is bad."""
    import grpc

    from deployments.failures import replica_lost  # (failures imports this module's neighbours)

    if isinstance(e, EmbeddingNotFound):  # a pinned result died with its encoder's server
        return True
    if isinstance(e, grpc.aio.AioRpcError):
        return e.code() == grpc.StatusCode.UNAVAILABLE
    return replica_lost(e)
