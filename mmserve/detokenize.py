"""Incremental detokenization with stop strings (stop strings are not part of the output)."""

from __future__ import annotations

from collections.abc import Sequence


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, in constant work per token.

    Only a short window of recent ids is decoded per token (vLLM's prefix/read offsets): the
    text of `ids[prefix:]` minus the text of `ids[prefix:read]` is what the new token added.
    Text is released once it is final: never half of a multi-byte UTF-8 character (decoded as
    U+FFFD until its last byte arrives), and never a prefix that could still become a stop
    string. `add` returns the new text; `stopped` turns true once a stop string appears, after
    which the output ends just before it. The concatenated output equals decoding all ids at once.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self._tokenizer = tokenizer
        self._stop = [s for s in stop if s]
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._ids: list[int] = []
        self._prefix = 0  # ids[:_prefix] are fully reflected in `text`
        self._read = 0  # ids[:_read] produced the text so far
        self._sent = 0
        self.text = ""
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def _new_text(self, final: bool) -> str:
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        full = self._decode(self._ids[self._prefix:])
        if len(full) <= len(prefix_text) or (full.endswith("\ufffd") and not final):
            return ""  # nothing yet, or a character still incomplete
        self._prefix, self._read = self._read, len(self._ids)
        return full[len(prefix_text):]

    def _append(self, new: str) -> None:
        start = max(0, len(self.text) - self._hold)  # where a stop string completed by `new` can begin
        self.text += new
        cuts = [cut for stop in self._stop if (cut := self.text.find(stop, start)) != -1]
        if cuts:
            self.stopped = True
            self.text = self.text[:min(cuts)]

    def add(self, token_id: int) -> str:
        if self.stopped:
            return ""
        self._ids.append(token_id)
        self._append(self._new_text(final=False))
        if self.stopped:
            return self._release(len(self.text))
        return self._release(len(self.text) - self._hold)

    def flush(self) -> str:
        """Everything not yet released (call when generation ends)."""
        if not self.stopped:
            self._append(self._new_text(final=True))
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        delta = self.text[self._sent:upto] if upto > self._sent else ""
        self._sent = max(self._sent, upto)
        return delta
