"""The router's work on one request, without Ray: media layouts, prompt ids, ranges, positions."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mmserve.checkpoint import read_chat_template
from mmserve.errors import InvalidRequest
from mmserve.families import router_face
from mmserve.families.base import ItemExpansion
from mmserve.media import EncodeItem, MediaItem, MediaKind, PlaceholderRange
from mmserve.positions import PositionPlan
from mmserve.prompt import ChatMessage, PromptBuilder


@dataclass(frozen=True)
class MediaLimits:
    max_items_per_request: int = 16
    max_frames_per_video: int = 64
    max_pixels_per_image: int = 40_000_000


@dataclass(frozen=True)
class Message:
    """A chat message whose media parts carry their bytes."""

    role: str
    parts: tuple[str | MediaItem, ...]


@dataclass(frozen=True)
class RequestPlan:
    token_ids: list[int]
    items: list[MediaItem]
    ranges: list[PlaceholderRange]
    expansions: list[ItemExpansion]  # per item: tokens, embedding slots, encoder cost, layout
    positions: PositionPlan  # the family's: opaque outside it

    @property
    def num_media_tokens(self) -> int:
        return sum(r.length for r in self.ranges)

    @property
    def media(self) -> list[EncodeItem]:
        """What the encoder gets: each item with the layout computed here."""
        return [EncodeItem(item, e.layout, e.cost) for item, e in zip(self.items, self.expansions)]


class RequestPlanner:
    def __init__(self, model_dir: str | Path, tokenizer, limits: MediaLimits = MediaLimits()):
        template = read_chat_template(model_dir)
        if template is None:
            raise ValueError(f"{model_dir} has no chat template")
        self.face = router_face(model_dir)
        self.limits = limits
        self.tokenizer = tokenizer
        placeholders = {kind: self.face.placeholder(kind) for kind in MediaKind}
        self._builder = PromptBuilder(tokenizer, template, placeholders)

    def _check_limits(self, items: list[MediaItem]) -> None:
        lim = self.limits
        if len(items) > lim.max_items_per_request:
            raise InvalidRequest(
                f"request has {len(items)} media items; the limit is {lim.max_items_per_request}"
            )
        for item in items:
            if item.kind is MediaKind.VIDEO and len(item.frames) > lim.max_frames_per_video:
                raise InvalidRequest(
                    f"video has {len(item.frames)} frames; the limit is {lim.max_frames_per_video}"
                )
            if item.kind is MediaKind.VIDEO and not item.frames:
                raise InvalidRequest("video has no frames")
            if item.kind is MediaKind.VIDEO and not item.fps > 0:
                raise InvalidRequest(f"video fps must be positive, got {item.fps}")

    def plan(self, messages: list[Message]) -> RequestPlan:
        items = [p for m in messages for p in m.parts if isinstance(p, MediaItem)]
        self._check_limits(items)
        expansions = self.face.expand_all(items, self.limits.max_pixels_per_image)
        chat = [
            ChatMessage(m.role, tuple(p.kind if isinstance(p, MediaItem) else p for p in m.parts))
            for m in messages
        ]
        prompt = self._builder.build(chat, expansions)
        positions = self.face.position_plan(prompt.token_ids, prompt.ranges, expansions)
        return RequestPlan(prompt.token_ids, items, prompt.ranges, expansions, positions)
