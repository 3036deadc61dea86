"""Chat messages -> prompt token ids with each media placeholder replaced by its expansion.

User text is tokenized as text: a user who types `<|image_pad|>` or `<|im_start|>` gets those
characters, never a placeholder or a new turn. The chat template is rendered with the user's own
text, in which each added-token string is escaped (a private-use sentinel stands for it); the
rendered string is split at the added tokens, all of them the template's own, exactly as the
tokenizer splits a whole string, and each piece between them is tokenized with added tokens
disabled, its sentinels back to what the user wrote. Without special strings in user text this
equals tokenizing the whole string, whatever the template does to the text (Qwen3.5's trims
each message's content). Text the project writes into the conversation itself (tool calls and
results for a template without tools, `TemplateText`) is not escaped: its tags are the model's.
The tokenizer's own special tokens (a Llama tokenizer's BOS) wrap the result, as the processor's
`tokenizer(text)` adds them.

The builder also says where a leading system message ends in the ids (`Prompt.system_end`): the
template rendered with that message alone is a prefix of the whole rendering, ending where the
tokenizing splits it (at an added token). A hybrid language model snapshots its recurrent state
there for later requests with the same system prompt (`RequestPlan.snapshot_boundaries`).
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from typing import Generic, NamedTuple, TypeVar

from mmserve.errors import InvalidRequest
from mmserve.families.base import ItemExpansion
from mmserve.inputs.media import MediaItem, MediaKind, MediaSource, PlaceholderRange
from mmserve.request.tools import JSON_FORMAT, ToolCall, ToolFormat, ToolSpec, fallback_system_text

_SENTINEL = "\ue000{}\ue001"
_SENTINEL_RE = re.compile("\ue000(\\d+)\ue001")


class TemplateText(str):
    """Conversation text the project wrote, not the user (tags of tool calls and results for a
    template without tools): rendered as the template would render it, added tokens included."""


Media = TypeVar("Media", MediaSource, MediaItem)


@dataclass(frozen=True)
class Message(Generic[Media]):
    """A chat message: text parts and media parts, as the client sent them (`MediaSource`) or
    loaded (`MediaItem`, what the planner takes); an assistant's `tool_calls`, a tool result's
    `tool_call_id`."""

    role: str
    parts: tuple[str | Media, ...]
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None


class Prompt(NamedTuple):
    token_ids: list[int]
    ranges: list[PlaceholderRange]
    kinds: list[MediaKind]
    system_end: int | None = None  # ids of the leading system message (None: none, or not a clean split)


class PromptBuilder:
    """Renders the checkpoint's chat template and tokenizes it safely (see module docstring)."""

    def __init__(self, tokenizer, chat_template: str, placeholders: dict[MediaKind, str | None],
                 tool_format: ToolFormat = JSON_FORMAT):
        """`placeholders`: the added token the template writes per media kind (None: kind not taken);
        `tool_format`: the family's call form (the XML form's template takes a call's `arguments` as
        a mapping, the JSON form's as the JSON text)."""
        self._tokenizer, self._tool_format, self._template = tokenizer, tool_format, chat_template
        self.native_tools = "tools" in chat_template  # the template has a tools section (Qwen3-VL's)
        self._plain = copy.deepcopy(tokenizer.backend_tokenizer)
        self._plain.encode_special_tokens = True
        added = sorted(tokenizer.get_added_vocab().items(), key=lambda kv: -len(kv[0]))
        self._added_ids = dict(added)
        self._added_re = re.compile("|".join(re.escape(tok) for tok, _ in added))
        # what a user's text may not bring into the rendering as it is: added-token strings, and
        # the sentinel's own marks (so that a typed sentinel stays text too)
        self._escaped_re = re.compile("|".join([*(re.escape(tok) for tok, _ in added), "\ue000", "\ue001"]))
        self._placeholder_ids = {kind: tokenizer.convert_tokens_to_ids(tok) for kind, tok in placeholders.items()
                                 if tok is not None}
        self._prefix, self._suffix = _special_wrapping(tokenizer)

    def _render(self, messages: list[Message], add_generation_prompt: bool = True,
                tools: tuple[ToolSpec, ...] = ()) -> tuple[str, list[str]]:
        calls = [(c.name, c.arguments) for m in messages for c in m.tool_calls]
        # the template (or `_tools_as_text`) writes these as they are: a special token in them would be one in the prompt
        if self._added_re.pattern and self._added_re.search(json.dumps(([t.as_openai() for t in tools], calls),
                                                                        ensure_ascii=False)):
            raise InvalidRequest("tools and tool calls may not contain the tokenizer's special token strings")
        if not self.native_tools:
            messages = _tools_as_text(messages, tools, self._tool_format)
            tools = ()
        escaped: list[str] = []

        def escape(match: re.Match) -> str:
            escaped.append(match.group(0))
            return _SENTINEL.format(len(escaped) - 1)

        conversation, sub = [], self._escaped_re.sub
        for message in messages:
            content = [{"type": part.kind.value} if not isinstance(part, str) else
                       {"type": "text", "text": part if isinstance(part, TemplateText) else sub(escape, part)}
                       for part in message.parts]
            entry = {"role": message.role, "content": content}
            if message.tool_calls:
                # the XML form's template iterates `arguments` as a mapping (`tools.check_call_arguments`)
                entry["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": (
                    json.loads(c.arguments) if self._tool_format.xml else c.arguments)}} for c in message.tool_calls]
            if message.tool_call_id is not None:
                entry["tool_call_id"] = message.tool_call_id
            conversation.append(entry)
        rendered = self._tokenizer.apply_chat_template(conversation, tools=[t.as_openai() for t in tools] or None,
                                                       chat_template=self._template, tokenize=False,
                                                       add_generation_prompt=add_generation_prompt)
        return rendered, escaped

    def _system_end(self, messages: list[Message], rendered: str) -> int | None:
        """Characters of `rendered` (sentinels in) that render the leading system message alone."""
        if len(messages) < 2 or messages[0].role != "system":
            return None
        try:
            head, _ = self._render(messages[:1], add_generation_prompt=False)
        except Exception:  # a template that refuses a system message alone: no boundary, nothing else lost
            return None
        return len(head) if head and rendered.startswith(head) else None

    def _encode_plain(self, text: str, escaped: list[str]) -> list[int]:
        text = _SENTINEL_RE.sub(lambda m: escaped[int(m.group(1))], text)
        # `encode_batch` releases the GIL while it tokenizes (`encode` holds it throughout), so a
        # long prompt planned in a worker thread never stalls the router's event loop
        return self._plain.encode_batch([text], add_special_tokens=False)[0].ids if text else []

    def build(self, messages: list[Message], expansions: list[ItemExpansion],
              tools: tuple[ToolSpec, ...] = ()) -> Prompt:
        """Token ids with the i-th media placeholder replaced by `expansions[i]`; `tools` described
        to the model (by the template's tools section, else in a system message)."""
        rendered, escaped = self._render(messages, tools=tools)
        stop = None if tools else self._system_end(messages, rendered)
        system_end, ids, ranges, kinds = None, [], [], []
        placeholder_kind = {v: k for k, v in self._placeholder_ids.items()}
        pos = 0
        for match in self._added_re.finditer(rendered):
            ids += self._encode_plain(rendered[pos:match.start()], escaped)
            if match.start() == stop:
                system_end = len(ids)
            token_id = self._added_ids[match.group(0)]
            if (kind := placeholder_kind.get(token_id)) is None:
                ids.append(token_id)
            else:
                if len(ranges) >= len(expansions):
                    raise InvalidRequest("chat template produced more media placeholders than media items")
                expansion = expansions[len(ranges)]
                ranges.append(PlaceholderRange(len(ids), len(expansion.token_ids), expansion.is_embed))
                kinds.append(kind)
                ids += expansion.token_ids
            if match.end() == stop:
                system_end = len(ids)
            pos = match.end()
        ids += self._encode_plain(rendered[pos:], escaped)
        if len(ranges) != len(expansions):
            raise InvalidRequest(f"chat template placed {len(ranges)} media placeholders for {len(expansions)} "
                                 "media items")
        shift = len(self._prefix)
        return Prompt(self._prefix + ids + self._suffix, [r._replace(offset=r.offset + shift) for r in ranges], kinds,
                      None if system_end is None else system_end + shift)


def _tools_as_text(messages: list[Message], tools: tuple[ToolSpec, ...],
                   fmt: ToolFormat = JSON_FORMAT) -> list[Message]:
    """For a template without tools: Qwen's tools text in the system message, calls written in an
    assistant's text as Qwen's templates write them, tool results as user turns in
    `<tool_response>` tags."""
    out = []
    for m in messages:
        if m.role == "tool":
            out.append(Message("user", (TemplateText("<tool_response>\n"), *m.parts,
                                        TemplateText("\n</tool_response>"))))
        elif m.tool_calls:
            calls = "\n".join(fmt.render(c) for c in m.tool_calls)
            out.append(Message(m.role, (*m.parts, TemplateText(("\n" if m.parts else "") + calls))))
        else:
            out.append(m)
    if tools:
        described = fallback_system_text(list(tools))
        if out and out[0].role == "system":
            out[0] = Message("system", (*out[0].parts, TemplateText("\n\n" + described)))
        else:
            out.insert(0, Message("system", (TemplateText(described),)))
    return out


def _special_wrapping(tokenizer) -> tuple[list[int], list[int]]:
    """The ids the tokenizer puts before and after any text when it adds special tokens."""
    plain, full = (tokenizer.encode("a", add_special_tokens=special) for special in (False, True))
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return full[:start], full[start + len(plain):]
    return [], []
