"""How the router sends a request's media to be encoded: one `MediaDispatcher` per app mode.

- `EncoderPoolDispatcher`: the app's Encoder deployment; results stay in the object store.
- `ExternalEncoderDispatcher`: a standalone `mmserve encoder-server` (`grpc.encoder_address`),
  which keeps each result pinned for the LLM replica to fetch.
- `ColocatedDispatcher` (`colocated: true`): no encoder; the LLM replica encodes the items.

A dispatcher never waits for an embedding to be computed: it returns one handle per item, in
order, which the router passes on to the LLM replica. Encoding the items of a lost encoder again
(failover) is another `dispatch` of just those items.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path

from cachetools import LRUCache

from deployments.core.llm_inputs import EmbeddingHandle, LocalMedia, PinnedEmbedding, StoredEmbedding
from mmserve.errors import InvalidRequest
from mmserve.request.encode_calls import affinity_spread, spread
from mmserve.inputs.media import EncodeItem


class MediaDispatcher(ABC):
    @abstractmethod
    async def dispatch(self, media: Sequence[EncodeItem]) -> tuple[EmbeddingHandle, ...]:
        """Send every item to be encoded, waiting for none; one handle per item, in order."""


class EncoderPoolDispatcher(MediaDispatcher):
    """Items to the Encoder deployment, each replica batching them with other requests' items.

    A request's items are split into size-balanced calls so that Serve spreads a large request
    over replicas. With affinity routing, an item this router sent before goes alone in its own
    call, which `AffinityRequestRouter` sends back to the replica that got it (a cache hit there);
    the cold items keep the size-balanced spread, each call going to its first item's owner."""

    def __init__(self, encoder, await_embeddings: bool = False, affinity: bool = False):
        self.encoder = encoder  # DeploymentHandle of the Encoder deployment
        self.await_embeddings = await_embeddings  # wait until computed (not fetched) before handing over
        self.affinity = affinity
        self._sent: LRUCache[str, None] = LRUCache(maxsize=1 << 16)  # content hashes sent (affinity)

    async def dispatch(self, media: Sequence[EncodeItem]) -> tuple[EmbeddingHandle, ...]:
        groups = self._groups(media)
        # a LoRA adapter of the tower (one per request) is Serve's multiplexed model: replicas that read it are preferred
        adapter = next((m.item.tower_adapter.name for m in media if m.item.tower_adapter is not None), None)
        encoder = self.encoder.options(multiplexed_model_id=adapter) if adapter else self.encoder
        if self.affinity:
            # each call routed before the next is made: calls made from one request share Serve's
            # internal request id, which a custom request router matches replicas by
            refs = [await encoder.encode.remote([media[i] for i in group])._to_object_ref() for group in groups]
        else:
            responses = [encoder.encode.remote([media[i] for i in group]) for group in groups]
            refs = [await r._to_object_ref() for r in responses]  # nested refs: the LLM need not wait for them
        if self.await_embeddings:
            import ray

            await asyncio.to_thread(ray.wait, refs, num_returns=len(refs), fetch_local=False)
        where = {i: StoredEmbedding(ref, pos) for group, ref in zip(groups, refs) for pos, i in enumerate(group)}
        return tuple(where[i] for i in range(len(media)))

    def _groups(self, media: Sequence[EncodeItem]) -> list[list[int]]:
        if not self.affinity:
            return spread([m.cost for m in media])
        keys = [m.item.content_hash for m in media]
        seen = [key in self._sent for key in keys]
        for key in keys:
            self._sent[key] = None
        return affinity_spread([m.cost for m in media], seen)


class ExternalEncoderDispatcher(MediaDispatcher):
    """Items to a standalone EncoderService, which pins each result for the LLM to fetch."""

    def __init__(self, address: str, token: str | None = None, tls_ca: str | None = None):
        self.address, self.token = address, token
        self.root_certificates = Path(tls_ca).read_bytes() if tls_ca else None
        self._client = None  # grpc.aio channels belong to the running loop: made on first use

    async def dispatch(self, media: Sequence[EncodeItem]) -> tuple[EmbeddingHandle, ...]:
        if adapters := sorted({m.item.tower_adapter.name for m in media if m.item.tower_adapter is not None}):
            raise InvalidRequest(f"LoRA adapter {adapters[0]!r} targets the vision tower, which a standalone encoder "
                                 "(grpc.encoder_address) does not apply; use the app's Encoder deployment")
        if self._client is None:
            from mmserve.rpc.encoder_client import EncoderClient

            self._client = EncoderClient(self.address, self.token, root_certificates=self.root_certificates)
        refs = await asyncio.gather(*(self._client.encode_pinned(m.item) for m in media))
        return tuple(PinnedEmbedding(ref) for ref in refs)


class ColocatedDispatcher(MediaDispatcher):
    """No encoder: each item goes to the LLM replica as is."""

    async def dispatch(self, media: Sequence[EncodeItem]) -> tuple[EmbeddingHandle, ...]:
        return tuple(LocalMedia(m) for m in media)
