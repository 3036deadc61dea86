"""The router's work on one request, without Ray: media layouts, prompt ids, ranges, positions."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mmserve.checkpoint import read_chat_template
from mmserve.errors import InvalidRequest, RequestTooLarge
from mmserve.families import family_of, router_face
from mmserve.families.base import ItemExpansion
from mmserve.inputs.media import EncodeItem, MediaItem, MediaKind, MediaSource, PlaceholderRange
from mmserve.inputs.positions import PositionPlan
from mmserve.request.prompt import Message, PromptBuilder
from mmserve.request.tools import ToolFormat, ToolSpec, check_call_arguments
from mmserve.settings import check_fields, setting

__all__ = ["MediaLimits", "Message", "RequestPlan", "RequestPlanner", "prompt_chars"]


@dataclass(frozen=True)
class MediaLimits:
    """Per-request media limits (settings of the app's `limits`, `mmserve.settings`)."""

    max_items_per_request: int = setting(16, "media items (images, videos) of one request", ge=0)
    max_frames_per_video: int = setting(64, "frames of one video: as sent, or sampled from a video_url file", ge=1)
    max_pixels_per_image: int = setting(40_000_000, "pixels (width x height) of one image", ge=1)

    def __post_init__(self):
        check_fields(self)

    def check(self, items: Sequence[MediaSource | MediaItem]) -> None:
        """InvalidRequest naming the first limit one request's media break; needs only what the
        client sent (counts, fps), so it runs before anything is fetched or decoded."""
        if len(items) > self.max_items_per_request:
            raise InvalidRequest(f"request has {len(items)} media items; the limit is {self.max_items_per_request}")
        for item in items:
            if item.kind is not MediaKind.VIDEO or getattr(item, "container", False):
                continue  # a video file's sampled frames are counted by its decoder
            frames = item.num_frames if isinstance(item, MediaItem) else len(item.frames)
            if not frames:
                raise InvalidRequest("video has no frames")
            if frames > self.max_frames_per_video:
                raise InvalidRequest(f"video has {frames} frames; the limit is {self.max_frames_per_video}")
            if not item.fps > 0:
                raise InvalidRequest(f"video fps must be positive, got {item.fps}")


@dataclass(frozen=True)
class RequestPlan:
    token_ids: list[int]
    items: list[MediaItem]
    ranges: list[PlaceholderRange]
    expansions: list[ItemExpansion]  # per item: tokens, embedding slots, encoder cost, layout
    positions: PositionPlan  # the family's: opaque outside it
    # prompt offsets where a hybrid LM keeps its recurrent state for later requests (the end of
    # the system prompt; the engine adds the ends of the media items and of the prompt itself)
    snapshot_boundaries: tuple[int, ...] = ()

    @property
    def num_media_tokens(self) -> int:
        return sum(r.length for r in self.ranges)

    @property
    def media(self) -> list[EncodeItem]:
        """What the encoder gets: each item with the layout computed here."""
        return [EncodeItem(item, e.layout, e.cost) for item, e in zip(self.items, self.expansions)]


def prompt_chars(messages: Sequence[Message], tools: Sequence[ToolSpec] = ()) -> int:
    """Characters of everything of a conversation that is tokenized: its messages' text (system
    text and tool results included), its calls' names and arguments, its tools' definitions."""
    return (sum(len(p) for m in messages for p in m.parts if isinstance(p, str))
            + sum(len(c.name) + len(c.arguments) for m in messages for c in m.tool_calls)
            + sum(tool.num_chars for tool in tools))


class RequestPlanner:
    """`max_prompt_chars` bounds a request's text before it is tokenized (RequestTooLarge),
    `max_model_len` its prompt tokens before media positions are computed (InvalidRequest)."""

    def __init__(self, model_dir: str | Path, tokenizer, limits: MediaLimits = MediaLimits(),
                 max_prompt_chars: int | None = None, max_model_len: int | None = None):
        if (template := read_chat_template(model_dir)) is None:
            raise ValueError(f"{model_dir} has no chat template")
        self.face = router_face(model_dir)
        self.model_type = family_of(model_dir)
        self.limits, self.max_prompt_chars, self.max_model_len = limits, max_prompt_chars, max_model_len
        self.tokenizer = tokenizer
        placeholders = {kind: self.face.placeholder(kind) for kind in MediaKind}
        # the family's tool-call form: how calls render, parse and are forced (`mmserve.request.tools`)
        self.tool_format = ToolFormat.of(tokenizer, self.face.tool_call_format)
        self._builder = PromptBuilder(tokenizer, template, placeholders, self.tool_format)

    def check_tools(self, messages: Sequence[Message]) -> None:
        """InvalidRequest when the conversation's calls cannot be rendered in the family's form
        (`tools.check_call_arguments`)."""
        check_call_arguments(messages, self.tool_format)

    def check_chars(self, chars: int) -> None:
        """RequestTooLarge when a request's text (`prompt_chars`, and whatever else of it is
        compiled) is over `max_prompt_chars`: checked before anything is tokenized or compiled."""
        if self.max_prompt_chars is not None and chars > self.max_prompt_chars:
            raise RequestTooLarge(f"request text has {chars} characters; the limit is {self.max_prompt_chars} "
                                  "(max_prompt_chars: messages, tool calls and results, tool definitions and schemas "
                                  "together)")

    def plan(self, messages: list[Message[MediaItem]], tools: tuple = ()) -> RequestPlan:
        """`tools`: `mmserve.request.tools.ToolSpec`s described to the model."""
        self.check_chars(prompt_chars(messages, tools))
        self.check_tools(messages)
        items = [p for m in messages for p in m.parts if isinstance(p, MediaItem)]
        self.limits.check(items)
        expansions = self.face.expand_all(items, self.limits.max_pixels_per_image)
        prompt = self._builder.build(messages, expansions, tools)
        if self.max_model_len is not None and len(prompt.token_ids) > self.max_model_len:
            raise InvalidRequest(f"prompt has {len(prompt.token_ids)} tokens, media included; the model's context "
                                 f"is {self.max_model_len} tokens")
        positions = self.face.position_plan(prompt.token_ids, prompt.ranges, expansions)
        boundaries = () if prompt.system_end is None else (prompt.system_end,)
        return RequestPlan(prompt.token_ids, items, prompt.ranges, expansions, positions, boundaries)
