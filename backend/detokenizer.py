"""Incremental detokenization and stop strings.

Text is released only when it is final: a trailing U+FFFD (an incomplete UTF-8 sequence that the
next token may complete) is held back, and so is any tail that could still grow into a stop
string. When a stop string appears, the text before it is released and generation stops. With
min_tokens (vLLM's), a stop string counts only where it ends in the text after the first min_tokens
tokens'.

Each token decodes a few ids, not the whole output (that grew with the output: 1.8 ms a token at 16K
tokens, on the thread that sends every request's responses). As vLLM's `detokenize_incrementally`
does: the ids from `_prefix` are decoded with and without those past `_read`, and the text the new
ids add is the difference; the ids before `_read` give the decoder the context it needs (a space a
token's leading marker stands for), and once the new text is complete the window moves on.

A text may end in U+FFFD of its own (the model wrote the character, or bytes no UTF-8 character
completes): once it has ended so for more tokens than an incomplete character can still need, the
ids before the last few are taken as they decode (where the later ids leave their text as it is),
so the window moves on and the text goes out.
"""

from __future__ import annotations

from tokenizers import Tokenizer

_INCOMPLETE = "\ufffd"
# The tokens after its first byte that an incomplete UTF-8 character may still need (at most three bytes, a byte a
# token at the least): a text that has ended in U+FFFD for longer holds one of its own.
_CHARACTER_TOKENS = 3


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: list[str] | None = None, min_tokens: int = 0):
        self.tokenizer = tokenizer
        self.stop = list(stop or [])
        self.min_tokens = min_tokens
        # stop strings count where they end past this many characters of the text: once min_tokens tokens are in
        self._stops_from: int | None = 0 if min_tokens == 0 else None
        self._ids: list[int] = []
        self._text = ""  # decoded text of the ids before _read (they decode completely)
        self._prefix = self._read = 0  # the decoding window's context starts at _prefix, its new ids at _read
        self._released = 0  # characters of _text already returned
        self._special: frozenset[int] | None = None  # the tokenizer's special tokens' ids, once needed
        self.stopped = False

    def add(self, token_id: int) -> str:
        """Append one token; return the newly final text (possibly empty)."""
        self._ids.append(token_id)
        decode = self.tokenizer.decode
        context = decode(self._ids[self._prefix:self._read], skip_special_tokens=True)
        text = decode(self._ids[self._prefix:], skip_special_tokens=True)
        if len(text) > len(context) and not text.endswith(_INCOMPLETE):
            self._take(context, text, len(self._ids))
        elif len(self._ids) - self._read > _CHARACTER_TOKENS and (cut := self._settled_end()) > self._read:
            head = decode(self._ids[self._prefix:cut], skip_special_tokens=True)  # (a U+FFFD of the text's own)
            if len(head) > len(context) and text.startswith(head):  # (what the last ids no longer change)
                self._take(context, head, cut)
        if len(self._ids) == self.min_tokens:
            self._stops_from = len(self._text)
        return self._release(final=False)

    def _settled_end(self) -> int:
        """Where the ids end that no incomplete character after them can reach back into: before the last
        _CHARACTER_TOKENS ids that carry bytes (a special token, skipped, carries none); `_read` if there is none."""
        if self._special is None:
            self._special = frozenset(i for i, token in self.tokenizer.get_added_tokens_decoder().items()
                                      if token.special)
        cut, carrying = len(self._ids), 0
        while cut > self._read and carrying < _CHARACTER_TOKENS:
            cut -= 1
            carrying += self._ids[cut] not in self._special
        return cut if carrying == _CHARACTER_TOKENS else self._read

    def flush(self) -> str:
        """At the end of generation: whatever is left (an incomplete character stays out, as vLLM leaves it: a
        U+FFFD of the text's own in its last few tokens with it)."""
        return self._release(final=True)

    def _take(self, context: str, text: str, end: int) -> None:
        """The ids up to `end` decode to `text` (`context`, those before `_read`, then theirs): theirs is final."""
        self._text += text[len(context):]
        self._prefix, self._read = self._read, end

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        limit = len(self._text)
        for s in self.stop if self._stops_from is not None else ():
            at = self._text.find(s, max(0, max(self._released, self._stops_from) - len(s) + 1))  # (ending past both)
            if at != -1 and at < limit:
                limit = at
                self.stopped = True
        if not self.stopped and not final and self.stop:
            limit = max(self._released, limit - (max(len(s) for s in self.stop) - 1))
        out = self._text[self._released:limit]
        self._released = max(self._released, limit)
        return out
