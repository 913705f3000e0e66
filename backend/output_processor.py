"""Text and stop strings, off the engine thread: the engine's token outputs become the outputs clients see.

    processor = OutputProcessor(tokenizer, abort=engine.abort)
    processor.add(request_id, sampling)             # before the request is submitted
    out = processor.process(raw_output)             # RequestOutput with its text, or None: nothing to send

The engine reports token ids (and decides the stops that need no text: stop token ids, max_tokens).
Here each request's incremental detokenizer turns them into text, never splitting a UTF-8 character
nor streaming the start of a possible stop string (backend/detokenizer.py). When a stop string appears,
the output that completed it is the request's last (finish_reason "stop", text cut before the stop
string), the engine is asked to abort the request, and whatever the engine still reports for it is
dropped: nothing past a stop is ever sent. The Triton adapter runs this on its response thread, offline
generation inline.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from backend.detokenizer import IncrementalDetokenizer
from backend.request import FinishReason, RequestOutput, SamplingParams


@dataclass
class _Stream:
    detokenizer: IncrementalDetokenizer
    num_tokens: int = 0  # tokens passed on


class OutputProcessor:
    def __init__(self, tokenizer, abort: Callable[[str], object]):
        self.tokenizer = tokenizer
        self.abort = abort
        self._streams: dict[str, _Stream] = {}

    def add(self, request_id: str, sampling: SamplingParams) -> None:
        detokenizer = IncrementalDetokenizer(self.tokenizer, sampling.stop, sampling.min_tokens)
        self._streams[request_id] = _Stream(detokenizer)

    def discard(self, request_id: str) -> None:
        """The consumer no longer wants this request's outputs."""
        self._streams.pop(request_id, None)

    def process(self, output: RequestOutput) -> RequestOutput | None:
        stream = self._streams.get(output.request_id)
        if stream is None:
            return None  # ended already (a stop string): what the engine still reports is dropped
        detokenizer = stream.detokenizer
        finished, reason = output.finished, output.finish_reason
        tokens, logprobs, text = output.new_token_ids, output.logprobs, ""
        # An output may carry several tokens (speculative decoding). The engine's stop ends on a stop token, whose own
        # text is never sent; a stop string ends the output at the token that completed it.
        texted = tokens[:-1] if finished and reason is FinishReason.STOP else tokens
        for i, token in enumerate(texted):
            text += detokenizer.add(token)
            if detokenizer.stopped:
                tokens, logprobs = tokens[:i + 1], logprobs[:i + 1] if logprobs else logprobs
                break
        stream.num_tokens += len(tokens)
        if detokenizer.stopped and reason is not FinishReason.STOP:  # a stop string: the request's last output
            if not finished:
                self.abort(output.request_id)
            finished, reason = True, FinishReason.STOP
        if finished:
            if output.error is None:
                text += detokenizer.flush()
                if detokenizer.stopped:  # (the end's last characters held a stop: as where a token completes one)
                    reason = FinishReason.STOP
            self._streams.pop(output.request_id, None)  # (the consumer may have discarded it meanwhile)
        return replace(output, new_token_ids=tokens, logprobs=logprobs, new_text=text, finished=finished,
                       finish_reason=reason, num_output_tokens=stream.num_tokens)


def coalesce(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """The engine's outputs, each request's consecutive ones merged into one (its tokens, log-probabilities and end
    together), requests in the order they first appear. A consumer that drains what queued while it was busy sends
    one response a request instead of one a step: each send is a round trip to tritonserver, so a response thread
    that falls behind catches up rather than falling further behind (vLLM's output collector merges the same way).
    An output with an error is never merged into: the tokens before it still go out first."""
    merged: dict[str, list[RequestOutput]] = {}
    for output in outputs:
        runs = merged.setdefault(output.request_id, [])
        last = runs[-1] if runs else None
        if last is None or last.finished or last.error is not None or output.error is not None:
            runs.append(output)
        else:
            runs[-1] = _merged(last, output)
    return [output for runs in merged.values() for output in runs]


def _merged(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    logprobs = None if first.logprobs is None and then.logprobs is None else \
        (first.logprobs or []) + (then.logprobs or [])
    return replace(then, new_token_ids=first.new_token_ids + then.new_token_ids,
                   new_text=first.new_text + then.new_text, logprobs=logprobs)
