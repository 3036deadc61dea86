"""The router face of a model family: what the router needs to know of it, and nothing more.

The encoder face (`encoder_service.families`) and the LM face (`llm_service.families`) are the
other two; all three are found through `mmserve.families.FAMILIES` by the checkpoint's
`model_type`. Outside the faces nothing knows a family's token layout, its position rows or its
preprocessing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, NamedTuple

from mmserve.inputs.media import MediaItem, MediaKind, PlaceholderRange
from mmserve.inputs.positions import LinearPositions, PositionPlan

if TYPE_CHECKING:
    from transformers import PreTrainedConfig


@dataclass(frozen=True)
class ItemExpansion:
    """What replaces one media item's placeholder, computed from the item's header alone.

    token_ids: the tokens in the prompt, embedding slots and structure tokens interleaved.
    is_embed: which of them take encoder rows, in order (None: all).
    cost: the item's encoder cost in output tokens (the encoder pool's batch budget unit).
    layout: the family's own description of the item (e.g. a patch grid); it travels with the
        item to the encoder face, which never re-reads headers, and to `position_plan`.
    """

    token_ids: tuple[int, ...]
    is_embed: tuple[bool, ...] | None
    cost: int
    layout: object = None

    @property
    def num_embeds(self) -> int:
        return len(self.token_ids) if self.is_embed is None else sum(self.is_embed)


class StreamGroup(NamedTuple):
    """One group of a streamed video's frames as the encoder takes it: `frames` consecutive
    sampled frames, their encoder `layout` and `cost` (output rows, in the item's row order)."""

    frames: int
    layout: object
    cost: int


class RouterFace(ABC):
    """Prompt layout of a family. Subclasses are immutable and built once per router."""

    # the form the family's models write tool calls in, and its template renders them in
    # (`mmserve.request.tools`: "json", Qwen's `<tool_call>` JSON; "xml", Qwen3.5's)
    tool_call_format: ClassVar[str] = "json"

    @classmethod
    @abstractmethod
    def from_checkpoint(cls, model_dir: str, config: PreTrainedConfig) -> RouterFace:
        """The face for the checkpoint at `model_dir`; `config`: its `transformers` config
        (`mmserve.checkpoint.load_config`: any layout of config.json reads the same)."""

    @abstractmethod
    def placeholder(self, kind: MediaKind) -> str:
        """The added token the chat template writes for one media item of `kind`."""

    @abstractmethod
    def expand(self, item: MediaItem, max_pixels: int) -> ItemExpansion:
        """The item's expansion from its header(s); InvalidRequest when it cannot be served
        (unreadable header, over `max_pixels`, a kind the family does not take)."""

    def expand_all(self, items: Sequence[MediaItem], max_pixels: int) -> list[ItemExpansion]:
        """The expansions of one request's items, in prompt order. Families whose expansion depends
        on an item's ordinal in the prompt (MiniCPM-V's `<image_id>N</image_id>`) override this."""
        return [self.expand(item, max_pixels) for item in items]

    def stream_groups(self, item: MediaItem, layout: object, frames: int = 1) -> list[StreamGroup] | None:
        """How a server-decoded video of this family (its `layout` from `expand`) goes to the
        encoder frame group by frame group, in order, as it is decoded: groups of about `frames`
        frames (at least the family's smallest unit) whose rows concatenate to the whole item's.
        None (the default): its videos are encoded whole."""
        return None

    @property
    def streams_video(self) -> bool:
        return type(self).stream_groups is not RouterFace.stream_groups

    def position_plan(self, token_ids: Sequence[int], ranges: Sequence[PlaceholderRange],
                      expansions: Sequence[ItemExpansion]) -> PositionPlan:
        """Positions of the whole prompt (media at `ranges`) and of every token after it (the default:
        plain 1-D RoPE, token `i` at `i`)."""
        return LinearPositions(rows=1)
