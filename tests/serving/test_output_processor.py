"""Text and stop strings off the engine thread: the output processor between the engine's token outputs and
the responses."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from backend.output_processor import OutputProcessor, coalesce
from backend.request import FinishReason, RequestOutput, SamplingParams, TokenLogprobs


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_checkpoint / "tokenizer.json"))


def _raw(token=None, finished=False, reason=None, count=0, error=None) -> RequestOutput:
    return RequestOutput("r", [] if token is None else [token], "", finished, reason, 3, count, error)


@pytest.mark.parametrize("stop", [["fox jumps"], ["zz", "fox jumps"], ["fox jumps", "zz"]])
def test_a_stop_string_ends_the_request_once_and_drops_what_the_engine_still_reports(tokenizer, stop):
    """(With stop strings of several lengths, the text held back is the longest one's: no part of the stop is ever
    sent.)"""
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog").ids
    aborted = []
    processor = OutputProcessor(tokenizer, aborted.append)
    processor.add("r", SamplingParams(stop=stop))
    sent = [processor.process(_raw(t, count=i + 1)) for i, t in enumerate(ids)]
    last = next(i for i, out in enumerate(sent) if out is not None and out.finished)
    assert all(out is None for out in sent[last + 1:])  # nothing past the stop
    assert [out.new_text for out in sent[:last + 1] if out is not None and "fox" in out.new_text] == []
    assert "".join(out.new_text for out in sent[:last + 1] if out is not None) == "The quick brown "
    assert sent[last].finish_reason is FinishReason.STOP and sent[last].num_output_tokens == last + 1
    assert aborted == ["r"]  # the engine is asked once to stop computing it
    assert processor.process(_raw(finished=True, reason=FinishReason.CANCELLED)) is None  # its abort's final


def test_a_stop_token_sends_no_text_of_its_own_and_flushes_the_rest(tokenizer):
    processor = OutputProcessor(tokenizer, lambda rid: pytest.fail("nothing to abort"))
    processor.add("r", SamplingParams())
    ids = tokenizer.encode("Hello world").ids
    text = "".join(processor.process(_raw(t, count=i + 1)).new_text for i, t in enumerate(ids))
    final = processor.process(_raw(1, finished=True, reason=FinishReason.STOP, count=len(ids) + 1))
    assert text + final.new_text == "Hello world" and final.finished and final.new_token_ids == [1]


def test_a_stop_token_that_is_not_special_sends_no_text_of_its_own_either(tokenizer):
    """(Token 1 above is a special token, which decodes to nothing anyway.) A stop_token_ids token that is ordinary
    text ends the output without its text, its id still reported."""
    ids = tokenizer.encode("Hello world").ids
    stop_id = ids[-1]
    processor = OutputProcessor(tokenizer, lambda rid: pytest.fail("nothing to abort"))
    processor.add("r", SamplingParams(stop_token_ids=[stop_id]))
    sent = [processor.process(_raw(t, count=i + 1)) for i, t in enumerate(ids[:-1])]
    final = processor.process(_raw(stop_id, finished=True, reason=FinishReason.STOP, count=len(ids)))
    text = "".join(out.new_text for out in sent if out is not None) + final.new_text
    assert text == tokenizer.decode(ids[:-1]) and text != tokenizer.decode(ids)
    assert final.finished and final.new_token_ids == [stop_id]


def test_a_failed_request_gets_no_held_back_text_and_a_cancelled_one_does(tokenizer):
    ids = tokenizer.encode("Привет").ids
    for reason, error, flushed in ((FinishReason.ERROR, "internal error: x", False),
                                   (FinishReason.CANCELLED, None, True)):
        processor = OutputProcessor(tokenizer, lambda rid: None)
        processor.add("r", SamplingParams(stop=["zzz"]))  # a stop string holds the tail back
        text = "".join(processor.process(_raw(t)).new_text for t in ids)
        final = processor.process(_raw(finished=True, reason=reason, error=error))
        assert (text + final.new_text == "Привет") is flushed and final.finish_reason is reason


def test_outputs_of_several_tokens_stop_where_a_stop_ends(tokenizer):
    """Speculative decoding reports several tokens at once: a stop string inside them ends the output at the token
    that completed it (later ones are neither sent nor counted), and a final stop token's text is still not sent
    while the tokens before it are."""
    from backend.request import TokenLogprobs

    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog").ids
    aborted = []
    processor = OutputProcessor(tokenizer, aborted.append)
    processor.add("r", SamplingParams(stop=["fox jumps"]))
    logprobs = [TokenLogprobs(-float(i)) for i in range(len(ids))]
    out = processor.process(RequestOutput("r", ids, "", False, None, 3, len(ids), logprobs=logprobs))
    end = next(i for i in range(len(ids)) if "fox jumps" in tokenizer.decode(ids[:i + 1]))
    assert out.finished and out.finish_reason is FinishReason.STOP and aborted == ["r"]
    assert out.new_text == "The quick brown " and out.new_token_ids == ids[:end + 1] and out.num_output_tokens == end + 1
    assert out.logprobs == logprobs[:end + 1] and end + 1 < len(ids)

    processor.add("s", SamplingParams())
    hello = tokenizer.encode("Hello world").ids
    final = processor.process(RequestOutput("s", hello + [1], "", True, FinishReason.STOP, 3, len(hello) + 1))
    assert final.new_text == "Hello world" and final.new_token_ids == hello + [1]


def test_coalesced_outputs_carry_what_the_outputs_one_by_one_carry(tokenizer):
    """A response thread behind the engine takes several outputs of a request at once and sends them as one: the same
    tokens, log-probabilities and text, stop strings and a stop token's text handled as one by one."""
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog").ids

    def outputs(request_id):
        raw = [RequestOutput(request_id, [t], "", False, None, 3, i + 1, logprobs=[TokenLogprobs(-0.5 * i)])
               for i, t in enumerate(ids)]
        return raw + [RequestOutput(request_id, [1], "", True, FinishReason.STOP, 3, len(ids) + 1,
                                    logprobs=[TokenLogprobs(-9.0)])]

    def sent(batches, stop):
        processor = OutputProcessor(tokenizer, lambda rid: None)
        for rid in ("a", "b"):
            processor.add(rid, SamplingParams(stop=stop))
        results = [processor.process(out) for batch in batches for out in coalesce(batch)]
        return {rid: ([t for r in results if r and r.request_id == rid for t in r.new_token_ids],
                      "".join(r.new_text for r in results if r and r.request_id == rid),
                      [lp.logprob for r in results if r and r.request_id == rid for lp in r.logprobs],
                      [r.finish_reason for r in results if r and r.request_id == rid and r.finished])
                for rid in ("a", "b")}

    interleaved = [out for pair in zip(outputs("a"), outputs("b")) for out in pair]
    for stop in ([], ["fox jumps"]):
        one_by_one = sent([[out] for out in interleaved], stop)
        for size in (2, 5, len(interleaved)):
            batches = [interleaved[i:i + size] for i in range(0, len(interleaved), size)]
            assert sent(batches, stop) == one_by_one
    merged = coalesce(interleaved)
    assert [out.request_id for out in merged] == ["a", "b"] and merged[0].finished


def test_an_error_output_is_never_merged_into():
    """The tokens before an engine error still go out as their own response, then the error."""
    tokens = RequestOutput("r", [5, 6], "", False, None, 3, 2)
    error = RequestOutput("r", [], "", True, FinishReason.ERROR, 3, 2, error="the engine failed")
    assert coalesce([tokens, error]) == [tokens, error]
    assert coalesce([tokens, RequestOutput("r", [7], "", False, None, 3, 3)])[0].new_token_ids == [5, 6, 7]


@pytest.mark.parametrize("ended", [FinishReason.LENGTH, FinishReason.TIMEOUT])
def test_a_stop_string_in_the_characters_the_end_releases_ends_the_request_as_stop(tokenizer, ended):
    """The last token holds "世" and the start of another character; the end releases "世", which completes the stop
    string "n世": the text stops before it and the request ends "stop" (as where a token completes a stop string),
    not "length" nor "timeout"."""
    processor = OutputProcessor(tokenizer, lambda rid: None)
    processor.add("r", SamplingParams(stop=["n世"]))
    first = processor.process(_raw(497, count=1))  # " prin"
    last = processor.process(_raw(386, finished=True, reason=ended, count=2))  # "世" + 2 bytes
    assert first.new_text + last.new_text == " pri" and last.finish_reason is FinishReason.STOP
