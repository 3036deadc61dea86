"""The router's work on one request, without Ray: media layouts, prompt ids, ranges, positions."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mmserve.checkpoint import read_chat_template
from mmserve.errors import InvalidRequest
from mmserve.families import router_face
from mmserve.media import MediaItem, MediaKind, PlaceholderRange
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
    positions: PositionPlan  # the family's: opaque outside it

    @property
    def num_media_tokens(self) -> int:
        return sum(r.length for r in self.ranges)


class RequestPlanner:
    def __init__(self, model_dir: str | Path, tokenizer, limits: MediaLimits = MediaLimits()):
        template = read_chat_template(model_dir)
        if template is None:
            raise ValueError(f"{model_dir} has no chat template")
        self.face = router_face(model_dir)
        self.limits = limits
        self.tokenizer = tokenizer
        self._builder = PromptBuilder(tokenizer, template, self.face.image_token, self.face.video_token)

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
        layouts = [self.face.layout(item, self.limits.max_pixels_per_image) for item in items]
        chat = [
            ChatMessage(m.role, tuple(p.kind if isinstance(p, MediaItem) else p for p in m.parts))
            for m in messages
        ]
        prompt = self._builder.build(chat, [lay.num_tokens for lay in layouts])
        positions = self.face.position_plan(len(prompt.token_ids), prompt.ranges, layouts)
        return RequestPlan(prompt.token_ids, items, prompt.ranges, positions)
