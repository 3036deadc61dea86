"""Embedding transport `grpc`: the encoder publishes, the LLM pulls by (address, content hash).

With `transport: object_store` (the default) encoder results are tensors that Ray moves; with
`transport: grpc` each encoder replica runs an `EncoderService` server and its results are
`EncodedRef`s, which the LLM replica resolves into tensors by streaming them from that server.
Both give the same tensors bit for bit.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import torch

from deployments.config import GrpcArgs
from encoder_service.grpc_server import Encoder, ServerOptions, ServerSecurity, ServerThread
from encoder_service.result_store import ResultStore
from mmserve.encoder_client import EncodedRef, EncoderClient
from mmserve.media import MediaItem

Embedding = torch.Tensor | EncodedRef


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

    def publish(self, items: Sequence[MediaItem], embeddings: Sequence[torch.Tensor]) -> list[EncodedRef]:
        """Pin each embedding for one fetch; what to return to the caller instead of the tensors.

        Raises `Overloaded` when the store is full."""
        refs = []
        for item, embedding in zip(items, embeddings, strict=True):
            content_hash = item.content_hash
            self.store.put(content_hash, embedding)
            dtype = str(embedding.dtype).removeprefix("torch.")
            refs.append(EncodedRef(self.address, content_hash, dtype, tuple(embedding.shape)))
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

    async def resolve(self, embeddings: Sequence[Embedding]) -> list[torch.Tensor]:
        """Tensors for `embeddings`: refs are fetched concurrently, tensors pass through."""

        async def one(e: Embedding) -> torch.Tensor:
            if isinstance(e, torch.Tensor):
                return e
            return await self._client(e.address).fetch(e.content_hash)

        return list(await asyncio.gather(*(one(e) for e in embeddings)))

    async def close(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        await asyncio.gather(*(c.close() for c in clients))
