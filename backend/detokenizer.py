"""Incremental detokenization and stop strings.

Text is released only when it is final: a trailing U+FFFD (an incomplete UTF-8 sequence that the
next token may complete) is held back, and so is any tail that could still grow into a stop
string. When a stop string appears, the text before it is released and generation stops.
"""

from __future__ import annotations

from tokenizers import Tokenizer

_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: list[str] | None = None):
        self.tokenizer = tokenizer
        self.stop = list(stop or [])
        self._ids: list[int] = []
        self._text = ""  # decoded text of all ids that decode completely
        self._released = 0  # characters of _text already returned
        self.stopped = False

    def add(self, token_id: int) -> str:
        """Append one token; return the newly final text (possibly empty)."""
        self._ids.append(token_id)
        text = self.tokenizer.decode(self._ids, skip_special_tokens=True)
        if not text.endswith(_INCOMPLETE):
            self._text = text
        return self._release(final=False)

    def flush(self) -> str:
        """At the end of generation: whatever is left (an incomplete character stays out)."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        limit = len(self._text)
        for s in self.stop:
            at = self._text.find(s, max(0, self._released - len(s) + 1))
            if at != -1 and at < limit:
                limit = at
                self.stopped = True
        if not self.stopped and not final and self.stop:
            limit = max(self._released, limit - (max(len(s) for s in self.stop) - 1))
        out = self._text[self._released:limit]
        self._released = max(self._released, limit)
        return out
