"""Incremental detokenization with stop strings (stop strings are not part of the output)."""

from __future__ import annotations

from collections.abc import Sequence


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Text is only released once it is final: never half of a multi-byte UTF-8 character (decoded
    as U+FFFD until its last byte arrives), and never a prefix that could still become a stop
    string. `add` returns the new text; `stopped` turns true once a stop string appears, after
    which the output ends just before it.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self._tokenizer = tokenizer
        self._stop = [s for s in stop if s]
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._ids: list[int] = []
        self._sent = 0
        self.text = ""
        self.stopped = False

    def add(self, token_id: int) -> str:
        if self.stopped:
            return ""
        self._ids.append(token_id)
        text = self._tokenizer.decode(self._ids, skip_special_tokens=True)
        for stop in self._stop:
            cut = text.find(stop)
            if cut != -1:
                self.stopped = True
                text = text[:cut]
        self.text = text
        if self.stopped:
            return self._release(len(text))
        final = len(text.rstrip("\ufffd"))
        return self._release(max(self._sent, final - self._hold))

    def flush(self) -> str:
        """Everything not yet released (call when generation ends)."""
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        delta = self.text[self._sent:upto]
        self._sent = max(self._sent, upto)
        return delta
