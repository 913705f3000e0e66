"""The grammar service (backend/structured/grammar.py) with real XGrammar: parsing refuses bad grammars with
XGrammar's message, compilation is cached and shared, a constraint the tokenizer cannot produce is refused, and
the compiled grammars never admit invalid UTF-8 or raw control characters in JSON strings."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import xgrammar as xgr

from backend.structured.grammar import (NO_TOKEN_CAN_FOLLOW, GrammarBatch, GrammarLookahead, GrammarService,
                                       choice_grammar)
from backend.structured.params import GuidedDecoding

from .conftest import TINY_TOKENIZER, guided


@pytest.fixture
def service():
    grammars = GrammarService(TINY_TOKENIZER, vocab_size=512, stop_token_ids=[1])
    yield grammars
    grammars.close()


@pytest.mark.parametrize("constraint,message", [
    ({"json": {"type": "foo"}}, 'invalid JSON schema: Unsupported type "foo"'),
    ({"json": {"$ref": "#/nowhere"}}, "invalid JSON schema"),
    ({"regex": "a(b"}, "invalid regex: Regex parsing error at position"),
    ({"grammar": "root ::= missing"}, 'invalid grammar: EBNF parser error at line 1, column 10: Rule "missing"'),
    ({"grammar": 'start ::= "a"'}, "invalid grammar"),
    ({"structural_tag": {"format": {"type": "sequence", "elements": []}}}, "invalid structural tag: "),
    ({"structural_tag": {"structures": [{"begin": "<a>", "end": "</a>"}], "triggers": ["<a"]}},
     'invalid structural tag: the older form takes {"structures": [{"begin": ..., "schema": ..., "end": ...}'),
])
def test_an_invalid_grammar_is_refused_at_once_with_xgrammars_message(service, constraint, message):
    with pytest.raises(ValueError) as error:
        service.prepare(guided(constraint))
    assert str(error.value).startswith(message) and ".cc:" not in str(error.value)
    assert service.stats()["compiled"] == 0


def test_a_repeated_constraint_compiles_once_and_concurrent_requests_share_it(service):
    schema = guided({"json": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}})
    start = threading.Barrier(8)
    grammars = []

    def arrive():
        start.wait()
        grammars.append(service.prepare(schema))

    threads = [threading.Thread(target=arrive) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(g.future) for g in grammars}) == 1
    grammars[0].future.result(timeout=30)
    assert service.stats() == {"compiled": 1, "cache_hits": 7, "cached": 1}  # one compiles, seven share it
    assert service.prepare(schema).ready  # a hit on a finished compilation is ready at once


def test_the_cache_keeps_the_most_recently_used_entries(tmp_path):
    service = GrammarService(TINY_TOKENIZER, vocab_size=512, stop_token_ids=[1], cache_entries=2)
    try:
        first, second, third = (guided({"regex": r}) for r in ("a+", "b+", "c+"))
        for constraint in (first, second, first, third):  # `second` is the least recently used when `third` comes
            service.prepare(constraint).future.result(timeout=30)
        service.prepare(first)
        assert service.stats() == {"compiled": 3, "cache_hits": 2, "cached": 2}
        service.prepare(second).future.result(timeout=30)  # evicted: compiled again
        assert service.stats()["compiled"] == 4
    finally:
        service.close()


def test_a_constraint_the_tokenizer_cannot_produce_fails_and_is_then_refused_at_once(tmp_path):
    """A word-level tokenizer with the tokens "a", "b": nothing can start "c"."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    path = tmp_path / "tokenizer.json"
    Tokenizer(WordLevel({"a": 0, "b": 1, "</s>": 2}, unk_token="</s>")).save(str(path))
    service = GrammarService(path, vocab_size=3, stop_token_ids=[2])
    try:
        grammar = service.prepare(guided({"regex": "c"}))
        with pytest.raises(ValueError, match=NO_TOKEN_CAN_FOLLOW):
            grammar.future.result(timeout=30)
        assert grammar.error == NO_TOKEN_CAN_FOLLOW
        with pytest.raises(ValueError, match=NO_TOKEN_CAN_FOLLOW):
            service.prepare(guided({"regex": "c"}))
        assert service.prepare(guided({"regex": "ab"})).future.result(timeout=30) is not None
    finally:
        service.close()


def _matches(service, constraint: GuidedDecoding, text: bytes) -> bool:
    matcher = xgr.GrammarMatcher(service.prepare(constraint).future.result(timeout=30))
    return matcher.accept_string(text) and matcher.is_completed()


def test_json_strings_never_hold_surrogates_or_raw_control_characters(service):
    """XGrammar 0.2.8 and 0.2.9 admit both (surrogates in every string, control characters in length-bounded ones);
    the service narrows its grammars so that outputs are valid UTF-8 and valid JSON."""
    for schema in ({"type": "string"}, {"type": "string", "maxLength": 5}, {"type": "string", "minLength": 1}):
        constraint = guided({"json": schema})
        assert _matches(service, constraint, '"ok é"'.encode())
        assert not _matches(service, constraint, b'"\xed\xa1\xad"')  # U+D86D, a surrogate
        assert not _matches(service, constraint, b'"a\x01"')
    assert _matches(service, guided({"json": {"type": "string"}}), b'"\\n"')  # escapes stay allowed
    # (a range across the surrogates too, its ends printed as characters or escapes)
    for regex in ("[^a]+", ".+", "[\u0100-\uffff]+", "[a\u00e0-\uffff]+", r"[\u0000-\uffff]+", r"[\n-\uffff]+"):
        constraint = guided({"regex": regex})
        assert _matches(service, constraint, "Āā".encode()) and not _matches(service, constraint, b"\xed\xa1\xad")
    pattern = guided({"json": {"type": "string", "pattern": "^[\u0100-\uffff]$"}})
    assert _matches(service, pattern, '"Ā"'.encode()) and not _matches(service, pattern, b'"\xed\xa0\x80"')


def test_choice_grammar_matches_exactly_the_choices_escapes_included(service):
    choices = ['say "hi"', "back\\slash", "two\nlines", "tab\t", "plain"]
    assert choice_grammar(["a", 'b"c']) == 'root ::= "a" | "b\\"c"'
    constraint = guided({"choice": choices})
    for choice in choices:
        assert _matches(service, constraint, choice.encode())
    assert not _matches(service, constraint, b"plai") and not _matches(service, constraint, b"plainer")


def test_a_failure_that_is_not_the_constraints_is_not_cached(service, monkeypatch):
    """A compilation that fails for another reason than the constraint (here: the compiler itself) fails its
    requests, and the next request with the constraint compiles it again."""
    constraint = guided({"regex": "[0-9]{3}"})
    real = service._build_compiler
    monkeypatch.setattr(service, "_build_compiler", lambda: (_ for _ in ()).throw(RuntimeError("out of memory")))
    failed = service.prepare(constraint)
    with pytest.raises(RuntimeError):
        failed.future.result(timeout=30)
    assert failed.error == "the output constraint failed to compile: out of memory"
    monkeypatch.setattr(service, "_build_compiler", real)
    again = service.prepare(constraint)  # not the cached failure: compiled anew
    assert again.future.result(timeout=30) is not None and service.stats()["compiled"] == 1
    assert len(service.take_compile_seconds()) == 1 and service.take_compile_seconds() == []


def test_requests_whose_compilation_was_cancelled_at_shutdown_get_a_message(service):
    blocker = threading.Event()
    for _ in range(service._pool._size):  # every compile thread busy: the next compilations wait in the queue
        service._pool.submit(lambda future: blocker.wait(30))
    waiting = service.prepare(guided({"regex": "[a-f]{2}"}))
    service.close()
    blocker.set()
    assert waiting.future.cancelled() and waiting.error.startswith("the engine is shutting down")


def test_a_compilation_past_its_deadline_fails_its_requests_and_gives_its_place_to_the_next(tmp_path, monkeypatch):
    """XGrammar cannot be interrupted: a compilation still running after compile_timeout_s fails its requests with a
    message, its constraint fails at once from then on, and the next compilations run meanwhile (two slots: two
    slow ones do not hold up a third); the slow one's thread finishes on its own."""
    service = GrammarService(TINY_TOKENIZER, vocab_size=512, stop_token_ids=[1], compile_timeout_s=0.3)
    compile_, release = service._compile, threading.Event()
    slow = {guided({"regex": "a+"}).key, guided({"regex": "b+"}).key}
    monkeypatch.setattr(service, "_compile", lambda grammar, key: release.wait(30) if key in slow
                        else compile_(grammar, key))
    try:
        started = time.monotonic()
        stuck = [service.prepare(guided({"regex": "a+"})), service.prepare(guided({"regex": "b+"}))]
        quick = service.prepare(guided({"regex": "[0-9]{3}"}))
        while not stuck[0].ready and time.monotonic() < started + 30:  # (the scheduler asks at every step)
            time.sleep(0.01)
        assert time.monotonic() - started >= 0.3
        assert quick.future.result(timeout=30) is not None  # (its slot: one of the two given back)
        assert all(g.ready and "did not compile within 0.3 s" in g.error for g in stuck)
        with pytest.raises(ValueError, match="did not compile within"):
            service.prepare(guided({"regex": "a+"}))  # at once
        assert service.num_abandoned == 2
    finally:
        release.set()
        service.close()
    deadline = time.monotonic() + 10
    while service.num_abandoned and time.monotonic() < deadline:
        time.sleep(0.01)
    assert service.num_abandoned == 0 and service._running == {}


def test_properties_are_generated_in_the_schemas_order(service):
    schema = {"type": "object", "properties": {"reasoning": {"type": "string"}, "answer": {"type": "integer"}},
              "required": ["reasoning", "answer"]}
    constraint = guided({"json": schema})
    assert _matches(service, constraint, b'{"reasoning": "because", "answer": 42}')
    assert not _matches(service, constraint, b'{"answer": 42, "reasoning": "because"}')


def test_a_structural_tag_in_either_form_constrains_what_its_tags_hold(service):
    """vLLM's structural_tag: the current form (a format tree) and the older one (free text, each structure's schema
    between its begin and end once a trigger starts it)."""
    current = guided({"structural_tag": {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "n="},
        {"type": "tag", "begin": "<v>", "content": {"type": "json_schema", "json_schema": {"type": "integer"}},
         "end": "</v>"}]}}})
    assert _matches(service, current, b"n=<v>42</v>")
    assert not _matches(service, current, b"n=<v>4.2</v>") and not _matches(service, current, b"m=<v>42</v>")
    older = guided({"structural_tag": json.dumps({"structures": [{"begin": "<f>", "schema": {
        "type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}, "end": "</f>"}],
        "triggers": ["<f"]})})
    assert _matches(service, older, b'Calling: <f>{"a": true}</f> done')
    assert not _matches(service, older, b'Calling: <f>{"a": 1}</f>')
    # (its JSON narrowed as a json constraint's: no surrogate, no raw control character in a string)
    bounded = guided({"structural_tag": {"format": {"type": "json_schema", "json_schema": {
        "type": "object", "properties": {"s": {"type": "string", "maxLength": 5}}, "required": ["s"]}}}})
    assert _matches(service, bounded, '{"s": "é"}'.encode())
    assert not _matches(service, bounded, b'{"s": "\xed\xa1\xad"}') and not _matches(service, bounded, b'{"s": "\x01"}')


def test_masks_filled_by_several_workers_equal_one_workers(service):
    """Rows at different places of different grammars (one ended, whose mask allows only stop tokens), filled on the
    persistent pool in chunks the threads take as they come free (70 rows: 3 threads, 9 chunks, the last short):
    every mask equals XGrammar's own fill of that row, and the rows no token can follow are found."""
    constraints = [guided({"json": {"type": "object", "properties": {"n": {"type": "integer"}}}}),
                   guided({"regex": "[a-c]+x"}), guided({"choice": ["yes", "no"]})]
    prefixes = [[b"", b'{"n": ', b'{"n": 12', b'{"n": 1}'], [b"", b"ab", b"abx"], [b"", b"ye", b"yes"]]
    grammars = []
    for i in range(70):
        which = i % 3
        grammar = service.prepare(constraints[which])
        grammar.future.result(timeout=30)
        assert grammar.matcher.accept_string(prefixes[which][i % len(prefixes[which])])
        grammars.append(grammar)
    one, several = GrammarBatch(workers=1), GrammarBatch(workers=3)
    try:
        expected = xgr.allocate_token_bitmask(len(grammars), 512)
        got = xgr.allocate_token_bitmask(len(grammars) + 2, 512)  # padding rows stay untouched
        got.fill_(-7)
        stuck_one = one.fill(grammars, expected)
        stuck_several = several.fill(grammars, got)
        assert torch.equal(got[:len(grammars)], expected) and (got[len(grammars):] == -7).all()
        assert stuck_several == stuck_one
        for i, grammar in enumerate(grammars[:6]):
            alone = xgr.allocate_token_bitmask(1, 512)
            grammar.matcher.fill_next_token_bitmask(alone, 0)
            assert torch.equal(alone[0], got[i])
    finally:
        one.close()
        several.close()


def test_a_lookahead_takes_drafts_tentatively_stops_where_the_grammar_does_and_rolls_back(service):
    """Speculative decoding's walk: drafts taken one by one (the mask after them differs), a draft the grammar
    cannot take stops the walk, a stop token blocks it (no mask follows), and rollback leaves the matcher where it
    was, or holding the drafts kept."""
    from tokenizers import Tokenizer

    token = {c: Tokenizer.from_file(str(TINY_TOKENIZER)).encode(c, add_special_tokens=False).ids[0] for c in "abxz"}
    grammar = service.prepare(guided({"regex": "[a-c]{2}x"}))
    grammar.future.result(timeout=30)

    def mask() -> torch.Tensor:
        out = xgr.allocate_token_bitmask(1, 512)
        grammar.matcher.fill_next_token_bitmask(out, 0)
        return out

    start, walk = mask(), GrammarLookahead()
    assert walk.take([grammar], [token["a"]]) == [True] and walk.open(grammar) and walk.taken[grammar] == 1
    assert walk.take([grammar], [token["z"]]) == [False] and not walk.open(grammar) and not walk.blocked(grammar)
    walk.rollback()
    assert torch.equal(mask(), start) and walk.open(grammar) and walk.open(None)
    for draft in (token["a"], token["b"], token["x"], 1):  # 1: the stop token, which ends the grammar
        walk.take([grammar], [draft])
    assert walk.blocked(grammar) and not walk.open(grammar) and grammar.matcher.is_terminated()
    walk.rollback({grammar: 2})  # "ab" emitted
    assert not grammar.matcher.is_terminated() and grammar.matcher.accept_token(token["x"])


def test_a_request_waiting_behind_slow_compilations_fails_at_its_own_deadline(monkeypatch):
    """Four slow compilations take every compile thread (two past their deadline are abandoned, two more fill the
    slots they gave back): a request whose grammar is still queued behind them fails when its own deadline passes,
    not when a thread frees up."""
    service = GrammarService(TINY_TOKENIZER, vocab_size=512, stop_token_ids=[1], compile_timeout_s=0.3)
    compile_, release = service._compile, threading.Event()
    slow = {guided({"regex": f"{c}+"}).key for c in "abcd"}
    monkeypatch.setattr(service, "_compile", lambda grammar, key: release.wait(30) if key in slow
                        else compile_(grammar, key))
    try:
        stuck = [service.prepare(guided({"regex": f"{c}+"})) for c in "abcd"]
        started = time.monotonic()
        queued = service.prepare(guided({"regex": "[0-9]{3}"}))
        while not queued.ready and time.monotonic() < started + 20:  # (the scheduler asks at every step)
            time.sleep(0.01)
        assert time.monotonic() - started < 5 and "did not compile within 0.3 s" in queued.error
        assert not queued.future.done()
        assert all(g.ready and "did not compile within" in g.error for g in stuck)
    finally:
        release.set()
        service.close()


def test_a_closed_service_closes_once_and_refuses_new_compilations(service):
    """close() twice (the engine's shutdown may run twice), then a compilation asked for: refused, not left waiting
    behind the compile threads' stops forever."""
    service.close()
    service.close()
    with pytest.raises(RuntimeError, match="shutting down"):
        service.prepare(guided({"regex": "[x-z]{4}"}))


def test_a_compilation_left_running_does_not_hold_the_process_exit():
    """XGrammar cannot be interrupted: a compilation abandoned past its deadline keeps its thread until it ends, and
    that thread must not hold the process (tritonserver's unload of the model) on its way out."""
    script = f"""
import time
from backend.structured.grammar import GrammarService
from backend.structured.params import GuidedDecoding
service = GrammarService({str(TINY_TOKENIZER)!r}, vocab_size=512, stop_token_ids=[1], compile_timeout_s=0.2)
service._compile = lambda grammar, key: time.sleep(60)
grammar = service.prepare(GuidedDecoding("regex", "a+"))
while not grammar.ready:
    time.sleep(0.01)
service.close()
"""
    started = time.monotonic()
    subprocess.run([sys.executable, "-c", script], check=True, cwd=Path(__file__).resolve().parents[2], timeout=50)
    assert time.monotonic() - started < 30
