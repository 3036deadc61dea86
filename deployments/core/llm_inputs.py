"""What the router hands an LLM replica: the prompt plan and one typed handle per media item.

A handle says where the item's embedding is, or will be; which kind the router makes depends on
the app's mode (`deployments.core.dispatch`), and the LLM replica resolves each kind its own way
(`deployments.serve.transport.resolve`).
"""

from __future__ import annotations

from dataclasses import dataclass

from llm_service.engine.sequence import LoraRequest
from llm_service.sampling import SamplingParams
from mmserve.families.base import StreamGroup
from mmserve.inputs.media import AdapterRef, DecodedVideo, EncodeItem, PlaceholderRange
from mmserve.inputs.positions import PositionPlan
from mmserve.rpc.encoder_client import EncodedRef


@dataclass(frozen=True)
class StoredEmbedding:
    """In the Ray object store: `ref` is one encoder call's result list and `index` the item's
    place in it. The router owns the ref, so it outlives the encoder replica that computed it.
    The result is an `ItemEmbedding`, or with `transport: grpc` an `EncodedRef` to fetch."""

    ref: object  # ray.ObjectRef (or any awaitable of the call's result list)
    index: int


@dataclass(frozen=True)
class PinnedEmbedding:
    """Pinned on a standalone encoder's `EncoderService` (`grpc.encoder_address`): fetched by hash."""

    ref: EncodedRef


@dataclass(frozen=True)
class LocalMedia:
    """The item itself, for the LLM replica to encode in-process (`colocated: true`)."""

    item: EncodeItem


@dataclass(frozen=True)
class StreamedVideo:
    """A video file the LLM replica takes through the pipeline itself, frame group by frame group:
    it streams the groups from the VideoDecoder as they are decoded, sends each to be encoded at
    once, and prefills up to the last group whose rows are in (`deployments.core.video_stream`).
    `header` is the decoder's (no pixels) and `groups` the router face's `stream_groups`;
    `tower_adapter` the item's (`MediaItem.tower_adapter`), which each group is encoded under."""

    data: bytes
    header: DecodedVideo
    groups: tuple[StreamGroup, ...]
    tower_adapter: AdapterRef | None = None


EmbeddingHandle = StoredEmbedding | PinnedEmbedding | LocalMedia | StreamedVideo


@dataclass(frozen=True)
class PendingRequest:
    """What the router sends: the prompt plan plus a handle per media item (still being computed)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    positions: PositionPlan | None
    ranges: tuple[PlaceholderRange, ...]
    embeddings: tuple[EmbeddingHandle, ...]  # one per range
    prefix_hashes: tuple[int, ...] = ()  # the prompt's block chain (`affinity.prefix_hashes`): routing only
    snapshot_boundaries: tuple[int, ...] = ()  # `RequestPlan.snapshot_boundaries` (the system prompt's end)
    resumed_tokens: int = 0  # a failover continuation: the last this many prompt tokens were already sent
    attempt: int = 0  # 0: the first submission; n: the router's n-th resubmission (never refused as busy)
    n: int = 1  # choices: sequences of the same prompt, each sampled on its own (its seed + its index)
    lora: LoraRequest | None = None  # the LoRA adapter it runs under (`lora_modules`); None: the base model
