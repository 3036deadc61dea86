"""A choice's streamed text when the request has tools (`ToolText`): content as it comes, calls
parsed out as `tools.answer` parses the whole text, so that the streamed answer is the unstreamed one."""

from __future__ import annotations

from dataclasses import dataclass

from mmserve.request.tools import END, JSON_FORMAT, START, ToolCall, ToolFormat, new_call_id


@dataclass
class _Streaming:
    """A forced call whose id and name went out: the arguments' text sent so far."""

    index: int
    call: ToolCall  # its id and name (`arguments`: ""), as sent
    sent: str = ""


class ToolText:
    """One choice's streamed text when the request has tools, as events to send: `("content", text)`,
    `("call", index, ToolCall)` (its id and name) and `("arguments", index, piece)`. The rule is that
    the streamed answer is the unstreamed one (`answer` on the whole text): under `tool_choice` auto a
    `<tool_call>` block is held until its `</tool_call>` is written, and no event of a call goes out
    before the call is known to be one; `forced` (a grammar holds the text to calls) sends a call as it
    is generated (`ToolFormat.arguments_so_far`). What is held, sent and dropped: docs/api.md#tool-calls."""

    def __init__(self, tools, parallel: bool = True, fmt: ToolFormat = JSON_FORMAT, forced: bool = False):
        self.tools, self.parallel, self.fmt, self.forced = list(tools), parallel, fmt, forced
        self.held = ""  # text not read yet: from an open `<tool_call>` on, or a tail that may begin one
        self.base = 0  # where `held` begins in the choice's text
        self.marks: list[int] = []  # where in the choice's text the pieces added so far end (of `held`'s)
        self.blank = ""  # whitespace read as content, not sent yet
        self.sent = False  # whether any content went out
        self.calls: list[ToolCall] = []
        self.streaming: _Streaming | None = None  # forced: the open block's call, sent as it comes

    def add(self, text: str) -> list[tuple]:
        self.held += text
        self.marks = [m for m in self.marks if m > self.base] + [self.base + len(self.held)]
        events: list[tuple] = []
        while (at := self.held.find(START)) >= 0:
            self._content(self._take(at), events)
            if (close := self.held.find(END, len(START))) < 0:  # an open block: a call or not when it closes
                if self.forced:
                    self._stream(self.held, events)
                return self._kept(events)
            start = self.base
            block = self._take(close + len(END))
            if self.forced:
                self._stream(block, events)
            _, calls = self.fmt.parse(block, self.tools)
            if self.streaming is not None:  # its events went out: the call closes with the whole arguments
                self._close_streaming(calls[0].arguments if calls else self.streaming.sent, events)
                continue
            if not calls:
                self._content(block, events)  # malformed, or no known function: text
                continue
            self.calls.append(calls[0])
            index = len(self.calls) - 1
            events.append(("call", index, calls[0]))
            events += [("arguments", index, piece) for piece in self._pieces(calls[0], block, start)]
        keep = next((k for k in range(min(len(START) - 1, len(self.held)), 0, -1)
                     if START.startswith(self.held[-k:])), 0)
        self._content(self._take(len(self.held) - keep), events)
        return self._kept(events)

    def _stream(self, block: str, events: list[tuple]) -> None:
        """A forced call block as written so far: its id and name once its head is, then the
        arguments' new text."""
        head = self.fmt.head(block) if self.streaming is None else (self.streaming.call.name,)
        if (tool := next((t for t in self.tools if head and t.name == head[0]), None)) is None:
            return
        if self.streaming is None:
            self.streaming = _Streaming(len(self.calls), ToolCall(new_call_id(), tool.name, ""))
            events.append(("call", self.streaming.index, self.streaming.call))
        self._send(self.fmt.arguments_so_far(block, tool), events)

    def _send(self, arguments: str, events: list[tuple]) -> None:
        streaming = self.streaming
        if arguments.startswith(streaming.sent) and len(arguments) > len(streaming.sent):
            events.append(("arguments", streaming.index, arguments[len(streaming.sent):]))
            streaming.sent = arguments

    def _close_streaming(self, arguments: str, events: list[tuple]) -> None:
        self._send(arguments, events)
        self.calls.append(ToolCall(self.streaming.call.id, self.streaming.call.name, self.streaming.sent))
        self.streaming = None

    def _take(self, n: int) -> str:
        taken, self.held, self.base = self.held[:n], self.held[n:], self.base + n
        return taken

    def _content(self, text: str, events: list[tuple]) -> None:
        """Send `text` as content: whitespace at its end held until content follows."""
        text = self.blank + text
        body = text.rstrip()
        if not body:
            self.blank = text
            return
        self.blank = text[len(body):]
        if self.calls and not self.sent:  # the unstreamed content is stripped when there are calls
            body = body.lstrip()
        events.append(("content", body))
        self.sent = True

    def _pieces(self, call: ToolCall, block: str, start: int) -> list[str]:
        """A call's arguments in the pieces they were added in, when they are the model's own text
        (the JSON form), else whole; `start`: where `block` began in the choice's text."""
        head = None if self.fmt.xml else self.fmt.head(block)
        if head is None or not block.startswith(call.arguments, head[1]):
            return [call.arguments]
        begin, stop = start + head[1], start + head[1] + len(call.arguments)
        edges = [begin, *(m for m in self.marks if begin < m < stop), stop]
        return [call.arguments[a - begin:b - begin] for a, b in zip(edges, edges[1:])]

    def _kept(self, events: list[tuple]) -> list[tuple]:
        return events if self.parallel else [e for e in events if e[0] == "content" or e[1] == 0]

    def end(self) -> tuple[list[tuple], list[ToolCall]]:
        """The events still to send (what is held is content: an open block never became a call;
        forced, an open call ends with what it sent) and every call of the choice."""
        events: list[tuple] = []
        if self.streaming is not None:  # cut off by max_tokens
            self._close_streaming(self.streaming.sent, events)
            self._take(len(self.held))
        self._content(self._take(len(self.held)), events)
        if self.blank and not self.calls:
            events.append(("content", self.blank))
        self.blank = ""
        return self._kept(events), self.calls if self.parallel else self.calls[:1]
