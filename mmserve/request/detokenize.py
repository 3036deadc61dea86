"""Incremental detokenization with stop strings (stop strings are not part of the output)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tokenizers.decoders import DecodeStream

_INVALID_PREFIX = "Invalid prefix"  # DecodeStream's error when a token rewrites text it released


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, in constant work per token.

    `tokenizers.decoders.DecodeStream` decodes a short window of recent ids per token and holds
    back half a multi-byte UTF-8 character (U+FFFD until its last byte arrives); on top of it, a
    prefix that could still become a stop string is held back. `add` returns the new text;
    `stopped` turns true once a stop string appears, after which the output ends just before it;
    `flush` releases the rest (a trailing U+FFFD the ids really decode to included).

    Invariant: the concatenated output equals `tokenizer.decode(ids, skip_special_tokens=True)`
    cut before the first stop string, except that the ids of `markers` (id -> text: the family's
    tool-call tags, which a parser finds in the text) always give their text, special or not, so
    that a checkpoint marking `<tool_call>` special answers as one that does not. The stream
    restarts after a marker (a byte-level decoder gives the same text; the tags are added tokens
    of Qwen-style tokenizers only). `tokenizer` is a fast transformers tokenizer; the stream
    follows its `backend_tokenizer`, so a tokenizer that also cleans up spaces after decoding
    (`clean_up_tokenization_spaces`, which transformers applies to non-BPE models only) streams
    without that clean-up. A decoder whose output for invalid bytes is not prefix-stable (byte
    fallback, where one more byte token can turn bytes already released into U+FFFD) cannot
    stream that text exactly: the stream restarts at that token; the text released stands.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = (), markers: Mapping[int, str] | None = None):
        self._backend = tokenizer.backend_tokenizer
        self._markers = dict(markers or {})
        self._stream = DecodeStream(skip_special_tokens=True)
        self._ids: list[int] = []
        self._base = self._base_chars = 0  # the stream started at ids[_base], when `text` was _base_chars long
        self._pending = False  # the stream holds ids whose text is not in `text` yet
        self._stop = [s for s in stop if s]
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._sent = 0
        self.text = ""
        self.stopped = False

    def _step(self, token_id: int) -> str:
        if token_id in self._markers:  # its text whatever the tokenizer flags; the stream restarts after it
            new = self._held() + self._markers[token_id]
            self._ids.append(token_id)
            self._stream = DecodeStream(skip_special_tokens=True)
            self._base, self._base_chars, self._pending = len(self._ids), len(self.text) + len(new), False
            return new
        self._ids.append(token_id)
        try:
            new = self._stream.step(self._backend, token_id)
        except Exception as e:  # tokenizers raises a bare Exception
            if not str(e).startswith(_INVALID_PREFIX):
                raise
            self._stream = DecodeStream(skip_special_tokens=True)
            self._base, self._base_chars = len(self._ids) - 1, len(self.text)
            new = self._stream.step(self._backend, token_id)
        self._pending = new is None
        return new or ""

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
        self._append(self._step(token_id))
        return self._release(len(self.text) - (0 if self.stopped else self._hold))

    def _held(self) -> str:
        """The text of the ids the stream holds back (half a character), decoded as they are."""
        if not self._pending:
            return ""
        self._pending = False
        rest = self._backend.decode(self._ids[self._base:], skip_special_tokens=True)
        return rest[len(self.text) - self._base_chars:]

    def flush(self) -> str:
        """Everything not yet released (call when generation ends)."""
        if not self.stopped:
            self._append(self._held())
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        delta = self.text[self._sent:upto] if upto > self._sent else ""
        self._sent = max(self._sent, upto)
        return delta
