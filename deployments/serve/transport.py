"""How an item's embedding gets from the encoder to the LLM replica, by either transport.

With `transport: object_store` (the default) encoder results are `ItemEmbedding`s that Ray moves;
with `transport: grpc` each encoder replica runs an `EncoderService` server and its results are
`EncodedRef`s, which the LLM replica resolves by streaming them from that server. Both give the
same tensors bit for bit. The router hands the LLM one handle per item (`deployments.core.llm_inputs`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import grpc

from deployments.config import GrpcArgs, is_loopback
from deployments.core.failures import replica_lost
from deployments.core.llm_inputs import EmbeddingHandle, LocalMedia, PinnedEmbedding, StoredEmbedding
from deployments.deployment_args import build
from encoder_service.rpc.result_store import ResultStore
from encoder_service.rpc.server import Encoder, ServerOptions, ServerSecurity, ServerThread
from mmserve.errors import EmbeddingsLost
from mmserve.inputs.embeddings import ItemEmbedding
from mmserve.inputs.media import EncodeItem
from mmserve.rpc.encoder_client import EmbeddingNotFound, EncodedRef, EncoderClient

EncodeLocally = Callable[[list[EncodeItem]], Awaitable[list[ItemEmbedding]]]


def advertised_host() -> str:
    """This node's address as other nodes reach it (127.0.0.1 outside Ray)."""
    import ray

    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"


def current_node() -> str:
    """This process's Ray node id ("" outside Ray)."""
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""


def url_host(host: str) -> str:
    """`host` as the host part of a host:port address (an IPv6 literal in brackets)."""
    host = host.strip("[]")
    return f"[{host}]" if ":" in host else host


class GrpcPublisher:
    """Encoder side: serves this replica's results and pins each one until fetched or expired.

    It binds `GrpcArgs.listen_host()`: without a token, loopback, advertised as such and marked with
    this node (`EncodedRef.node`), so that an LLM replica on another node fails saying why."""

    def __init__(self, args: GrpcArgs, encoder: Encoder | None = None, host: str | None = None):
        self.store = build(args, ResultStore)
        bind = args.listen_host()
        options = build(args, ServerOptions, host=url_host(bind), security=ServerSecurity(token=args.token))
        self._server = ServerThread(encoder, self.store, options)
        local = is_loopback(bind)
        self.node = current_node() if local else ""
        self.address = f"{host or (url_host(bind) if local else advertised_host())}:{self._server.port}"

    def publish(self, items: Sequence[EncodeItem], embeddings: Sequence[ItemEmbedding]) -> list[EncodedRef]:
        """Pin each embedding for one fetch; what to return to the caller instead of the tensors.

        Raises `Overloaded` when the store is full."""
        refs = []
        for item, embedding in zip(items, embeddings, strict=True):
            content_hash = item.item.content_hash
            wire = embedding.to_wire()
            self.store.put(content_hash, wire)
            dtype = str(wire.dtype).removeprefix("torch.")
            refs.append(EncodedRef(self.address, content_hash, dtype, tuple(wire.shape), embedding.key,
                                   embedding.timing, self.node))
        return refs

    def stop(self) -> None:
        self._server.stop()


class GrpcFetcher:
    """LLM side: one channel per encoder address, reused across requests."""

    def __init__(self, args: GrpcArgs):
        self._token = args.token
        self._timeout_s = args.fetch_timeout_s
        self._clients: dict[str, EncoderClient] = {}
        tls = args.tls_ca and args.encoder_address  # a standalone encoder's; encoder replicas in the cluster have none
        self._tls_roots = {args.encoder_address: Path(args.tls_ca).read_bytes()} if tls else {}

    def _client(self, address: str) -> EncoderClient:
        if (client := self._clients.get(address)) is None:
            client = self._clients[address] = EncoderClient(
                address, self._token, root_certificates=self._tls_roots.get(address), timeout_s=self._timeout_s
            )
        return client

    async def fetch(self, ref: EncodedRef) -> ItemEmbedding:
        if ref.node and ref.node != (here := current_node()):
            raise RuntimeError(
                f"transport: grpc: the encoder replica that holds this embedding (Ray node {ref.node}) serves it on "
                f"loopback only ({ref.address}), since the app sets no token; this LLM replica runs on "
                f"{f'node {here}' if here else 'another node'}. Across nodes set grpc.token_env (on Kubernetes "
                "from a Secret): encoder replicas then listen on every interface and every call carries the token")
        return await self._client(ref.address).fetch_embedding(ref)

    async def close(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        await asyncio.gather(*(c.close() for c in clients))


async def resolve(handles: Sequence[EmbeddingHandle], fetcher: GrpcFetcher | None = None,
                  encode_locally: EncodeLocally | None = None) -> list[ItemEmbedding]:
    """The outputs behind `handles`, in order: each encoder call's result list is awaited once,
    `EncodedRef`s are fetched concurrently (they need `fetcher`), `LocalMedia` are encoded here
    in one call (they need `encode_locally`).

    Raises `EmbeddingsLost` naming every item whose encoder replica is gone (its call died, or
    its pinned gRPC result can no longer be fetched), so the router can re-encode just those.
    """
    calls = list(dict.fromkeys(h.ref for h in handles if isinstance(h, StoredEmbedding)))
    results = dict(zip(calls, await asyncio.gather(*calls, return_exceptions=True)))
    if local := [i for i, h in enumerate(handles) if isinstance(h, LocalMedia)]:
        if encode_locally is None:
            raise RuntimeError("the router sent media to encode but this replica has no encoder (colocated: false)")
        encoded = dict(zip(local, await encode_locally([handles[i].item for i in local])))

    async def one(i: int, h: EmbeddingHandle) -> ItemEmbedding:
        if isinstance(h, LocalMedia):
            return encoded[i]
        if isinstance(h, PinnedEmbedding):
            found = h.ref
        else:
            found = results[h.ref]
            if isinstance(found, BaseException):
                raise found
            found = found[h.index]
        if isinstance(found, ItemEmbedding):
            return found
        if fetcher is None:
            raise RuntimeError("an encoder returned a gRPC reference but this replica has no gRPC fetcher")
        fetched = await fetcher.fetch(found)
        return dataclasses.replace(fetched, timing=found.timing) if found.timing is not None else fetched

    outcomes = await asyncio.gather(*(one(i, h) for i, h in enumerate(handles)), return_exceptions=True)
    if lost := tuple(i for i, o in enumerate(outcomes) if isinstance(o, BaseException) and encoder_lost(o)):
        raise EmbeddingsLost(lost)
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome
    return list(outcomes)


def encoder_lost(e: BaseException) -> bool:
    """True when `e` means the encoder that computed (or holds) an item is gone, not that the item is bad."""
    if isinstance(e, EmbeddingNotFound):  # a pinned result died with its encoder's server
        return True
    if isinstance(e, grpc.aio.AioRpcError):
        return e.code() == grpc.StatusCode.UNAVAILABLE
    return replica_lost(e)
