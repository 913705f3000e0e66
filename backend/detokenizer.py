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

Special tokens (end-of-sequence, chat markers) are skipped in the text, as the decoder skips them: they never
enter the window (a run of them, an ignore_eos benchmark's, kept it from moving, every token decoding the whole run).
"""

from __future__ import annotations

import threading
import weakref

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
        # stop strings count where they end past this many characters of the text: the first min_tokens tokens' text,
        # known once those tokens are in and their text is taken (`_boundary`: the ids it ends at, until then)
        self._stops_from: int | None = 0 if min_tokens == 0 else None
        self._boundary: int | None = None
        self._ids: list[int] = []  # the tokens that carry text (special tokens skipped)
        self._num_tokens = 0  # every token added
        self._text = ""  # decoded text of the ids before _read (they decode completely)
        self._prefix = self._read = 0  # the decoding window's context starts at _prefix, its new ids at _read
        self._released = 0  # characters of _text already returned
        self._special = special_token_ids(tokenizer)
        self.stopped = False

    def add(self, token_id: int) -> str:
        """Append one token; return the newly final text (possibly empty)."""
        self._num_tokens += 1
        if self._num_tokens == self.min_tokens:
            self._boundary = len(self._ids) + (token_id not in self._special)
        if token_id not in self._special:
            self._decode_with(token_id)
        if self._boundary is not None and self._read >= self._boundary:  # (a special token's: nothing to take)
            self._stops_from, self._boundary = len(self._text), None
        return self._release(final=False)

    def _decode_with(self, token_id: int) -> None:
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

    def _settled_end(self) -> int:
        """Where the ids end that no incomplete character after them can reach back into: before the last
        _CHARACTER_TOKENS ids (each carries bytes); `_read` if there are not that many past it."""
        return max(self._read, len(self._ids) - _CHARACTER_TOKENS)

    def flush(self) -> str:
        """At the end of generation: whatever is left, but an incomplete character at its end (as vLLM leaves it out;
        a U+FFFD of the text's own there goes with it). The complete characters before it go out."""
        if not self.stopped and len(self._ids) > self._read:
            context = self.tokenizer.decode(self._ids[self._prefix:self._read], skip_special_tokens=True)
            text = self.tokenizer.decode(self._ids[self._prefix:], skip_special_tokens=True).rstrip(_INCOMPLETE)
            if len(text) > len(context) and text.startswith(context):
                self._take(context, text, len(self._ids))
        return self._release(final=True)

    def _take(self, context: str, text: str, end: int) -> None:
        """The ids up to `end` decode to `text` (`context`, those before `_read`, then theirs): theirs is final."""
        if self._boundary is not None and end >= self._boundary:  # (the first min_tokens tokens' text ends in it)
            head = text if end == self._boundary else self.tokenizer.decode(
                self._ids[self._prefix:self._boundary], skip_special_tokens=True).rstrip(_INCOMPLETE)
            self._stops_from, self._boundary = len(self._text) + max(0, len(head) - len(context)), None
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


_SPECIAL_IDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> its special tokens' ids
_SPECIAL_IDS_LOCK = threading.Lock()


def special_token_ids(tokenizer) -> frozenset[int]:
    """The ids of the tokenizer's special tokens, which decoding with skip_special_tokens leaves out (a stand-in
    tokenizer without added tokens has none); found once a tokenizer, kept as long as it lives."""
    with _SPECIAL_IDS_LOCK:
        ids = _SPECIAL_IDS.get(tokenizer)
        if ids is None:
            added = getattr(tokenizer, "get_added_tokens_decoder", None)
            ids = frozenset(i for i, t in added().items() if t.special) if added is not None else frozenset()
            _SPECIAL_IDS[tokenizer] = ids
        return ids
