"""Structured outputs through the engine on the built-in random checkpoint: nothing but the mask keeps a random
model's output valid, so every output must validate. Constrained requests run beside unconstrained ones, which
must not change; preemption, the prefix cache, deadlines, cancellation and log-probabilities keep working."""

from __future__ import annotations

import ast
import json
import re
import threading

import jsonschema
import pytest
import torch
import xgrammar as xgr

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.request import RequestOutput, SamplingParams, Sequence
from structured_schemas import SCHEMAS

SCHEMA_NAMES = sorted(SCHEMAS)
REGEXES = [r"[a-z]{3,8}@[a-z]{2,6}\.(com|org)", r"\d{3}-\d{4}", r"[A-Z][a-z]{1,10}( [A-Z][a-z]{1,10}){0,2}",
           r"0x[0-9a-f]{1,8}", r"(\d{1,3}\.){3}\d{1,3}", r"(true|false)"]
CHOICES = ["positive", "negative", "neutral", "it depends"]
ARITHMETIC = """root ::= expr
expr ::= term (op term){0,3}
term ::= num | "(" num (op num){0,3} ")"
op ::= "+" | "-" | "*" | "/"
num ::= [1-9] [0-9]{0,2}
"""


def _engine(checkpoint, **overrides) -> LLMEngine:
    settings = dict(checkpoint=str(checkpoint), device="cpu", max_running_requests=8)
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings))


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    engine = _engine(tiny_checkpoint)
    yield engine
    engine.shutdown()


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 512, (int(n),), generator=g).tolist() for n in torch.randint(3, 40, (count,), generator=g)]


def _params(constraint: dict | None, temperature: float, seed: int, max_tokens: int, **extra) -> SamplingParams:
    params = {"max_tokens": max_tokens, "temperature": temperature, "seed": seed, **extra}
    if constraint is not None:
        params["guided_decoding"] = constraint
    return SamplingParams.from_dict(params)


@pytest.mark.parametrize("temperature,compact,max_tokens", [(0.0, True, 256), (1.0, False, 512), (0.0, False, 1024)],
                         ids=["greedy-compact", "sampled", "greedy"])
def test_every_json_output_validates_beside_unconstrained_requests(engine, temperature, compact, max_tokens):
    """21 schemas and 11 unconstrained requests, 8 at a time: every constrained output is a complete document of
    its schema (finish_reason "stop"), whatever whitespace the schema's grammar lets a random model emit."""
    constrained = [_params({"json": SCHEMAS[name], "disable_any_whitespace": compact}, temperature, i, max_tokens)
                   for i, name in enumerate(SCHEMA_NAMES)]
    free = [_params(None, temperature, 100 + i, 24, ignore_eos=True) for i in range(11)]
    params = [p for pair in zip(constrained, free) for p in pair] + constrained[len(free):]  # interleaved
    results = engine.generate(_prompts(len(params)), params)
    for p, r in zip(params, results):
        if p.guided_decoding is None:
            assert r["finish_reason"] == "length" and len(r["output_ids"]) == 24
            continue
        schema = json.loads(p.guided_decoding.spec)
        assert r["finish_reason"] == "stop", (schema, r)
        document = json.loads(r["text"])
        jsonschema.validate(document, schema)
        if isinstance(document, dict):  # properties come in the schema's order
            assert list(document) == [key for key in schema["properties"] if key in document]
        assert r["output_ids"][-1] in engine.eos_token_ids  # the grammar ended on the stop token
        if compact:
            assert r["text"] == json.dumps(json.loads(r["text"]), ensure_ascii=False)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regex_choice_and_grammar_outputs_are_in_their_language(engine, temperature):
    cases = ([("regex", r) for r in REGEXES] + [("choice", CHOICES)] * 3 + [("grammar", ARITHMETIC)] * 3)
    params = [_params({kind: spec}, temperature, i, 128) for i, (kind, spec) in enumerate(cases)]
    for (kind, spec), r in zip(cases, engine.generate(_prompts(len(cases), seed=1), params)):
        assert r["finish_reason"] == "stop", (kind, spec, r)
        text = r["text"]
        if kind == "regex":
            assert re.fullmatch(spec, text), (spec, text)
        elif kind == "choice":
            assert text in CHOICES
        else:
            tree = ast.parse(text, mode="eval")
            assert all(isinstance(n, (ast.Expression, ast.BinOp, ast.Constant, ast.operator)) for n in ast.walk(tree))


def test_unconstrained_requests_are_identical_with_and_without_constrained_neighbours(engine):
    free = [_params(None, t, i, 20, ignore_eos=True) for i, t in enumerate([0.0, 1.0, 0.0, 0.7])]
    prompts = _prompts(8, seed=2)
    alone = engine.generate(prompts[:4], free)
    neighbours = [_params({"json": SCHEMAS[n]}, 1.0, i, 256) for i, n in enumerate(SCHEMA_NAMES[:4])]
    mixed = engine.generate(prompts[:4] + prompts[4:], free + neighbours)
    assert [r["output_ids"] for r in mixed[:4]] == [r["output_ids"] for r in alone]


def test_a_constrained_request_that_is_preempted_resumes_its_grammar(tiny_checkpoint):
    """Tight pools force recompute preemption: outputs equal those of a roomy engine, and still match."""
    regex = "[a-z ]{120}"
    params = [_params({"regex": regex}, 1.0, i, 512) for i in range(4)]  # seeded: reproducible
    prompts = [torch.randint(2, 512, (110,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(4)]
    pools = dict(page_size=16, prefill_chunk_tokens=64, max_running_requests=4)
    roomy = _engine(tiny_checkpoint, **pools, num_tokens=8192)
    tight = _engine(tiny_checkpoint, **pools, num_tokens=512, swa_full_tokens_ratio=1.0)
    try:
        expected, got = roomy.generate(prompts, params), tight.generate(prompts, params)
        assert tight.stats()["num_preemptions"] > 0
        assert [r["output_ids"] for r in got] == [r["output_ids"] for r in expected]
        assert all(r["finish_reason"] == "stop" and re.fullmatch(regex, r["text"]) for r in got)
    finally:
        roomy.shutdown()
        tight.shutdown()


def test_a_repeated_constrained_prompt_is_served_from_the_prefix_cache(engine):
    prompt = torch.randint(2, 512, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    params = _params({"json": SCHEMAS["tool_call"], "disable_any_whitespace": True}, 0.0, 0, 256)
    first, second = (engine.generate([prompt], params)[0] for _ in range(2))
    assert second["num_cached_tokens"] > 0 and second["output_ids"] == first["output_ids"]
    jsonschema.validate(json.loads(second["text"]), SCHEMAS["tool_call"])


def test_log_probabilities_are_those_of_the_masked_distribution(engine):
    """Every top token with a finite log-probability is one the grammar allowed at that point."""
    params = _params({"choice": CHOICES}, 1.0, 5, 32, logprobs=8)
    result = engine.generate(_prompts(1, seed=4), params)[0]
    matcher = xgr.GrammarMatcher(engine.grammars.prepare(params.guided_decoding).future.result())
    mask = xgr.allocate_token_bitmask(1, engine.vocab_size)
    for token, logprobs in zip(result["output_ids"], result["logprobs"]):
        matcher.fill_next_token_bitmask(mask, 0)
        allowed = {t for t in range(engine.vocab_size) if (int(mask[0, t // 32]) >> (t % 32)) & 1}
        assert logprobs.logprob > float("-inf") and token in allowed
        assert {t for t, lp in logprobs.top if lp > float("-inf")} <= allowed
        assert matcher.accept_token(token)
    assert result["text"] in CHOICES


def test_deadlines_and_cancellation_end_constrained_requests(engine):
    timed = engine.generate(_prompts(1), _params({"json": SCHEMAS["nested"]}, 1.0, 0, 4096, timeout_ms=1))[0]
    assert timed["finish_reason"] == "timeout"
    outputs: list[RequestOutput] = []
    seq = Sequence("cancel-me", _prompts(1)[0], _params({"regex": "[a-z]{500}"}, 0.0, 0, 1000))

    def on_output(out: RequestOutput):
        outputs.append(out)
        if len(outputs) == 3:
            engine.abort("cancel-me")

    engine.submit(seq, on_output)
    while not (outputs and outputs[-1].finished):
        engine.step()
    engine.drain()
    assert outputs[-1].finish_reason.value == "cancelled" and len(outputs) <= 5
    assert all(held == 0 for held in engine.kv.pages_held_by_requests().values())


@pytest.mark.parametrize("constraint,message", [
    ({"json": {"type": "nope"}}, "invalid JSON schema"),
    ({"regex": "(("}, "invalid regex"),
    ({"grammar": "root ::= ("}, "invalid grammar"),
])
def test_an_invalid_constraint_is_refused_at_submit_and_nothing_is_queued(engine, constraint, message):
    with pytest.raises(ValueError, match=message):
        engine.submit(Sequence("bad", [5, 6, 7], _params(constraint, 0.0, 0, 8)), lambda out: None)
    assert engine.scheduler.num_waiting == 0
    assert engine.generate([[5, 6, 7]], _params(None, 0.0, 0, 4))[0]["finish_reason"] in ("length", "stop")


@pytest.mark.parametrize("fails", [False, True], ids=["compiles", "fails"])
def test_a_request_waits_for_its_grammar_while_the_batch_goes_on(tiny_checkpoint, monkeypatch, fails):
    """A compilation held back (a fake slow compile): the unconstrained request finishes meanwhile; once the
    grammar is ready the constrained one runs, or ends with the compilation's error."""
    engine = _engine(tiny_checkpoint)
    release = threading.Event()
    compile_for_real = engine.grammars._compile

    def slow_compile(grammar, key):
        assert release.wait(30)
        if fails:
            raise ValueError("the output constraint failed to compile: boom")
        return compile_for_real(grammar, key)

    monkeypatch.setattr(engine.grammars, "_compile", slow_compile)
    outputs: dict[str, list[RequestOutput]] = {"constrained": [], "free": []}
    try:
        engine.submit(Sequence("constrained", [7, 8, 9], _params({"choice": CHOICES}, 0.0, 0, 32)),
                      outputs["constrained"].append)
        engine.submit(Sequence("free", [7, 8, 9], _params(None, 0.0, 0, 16, ignore_eos=True)), outputs["free"].append)
        while not (outputs["free"] and outputs["free"][-1].finished):
            assert engine.step() or engine.scheduler.wait_for_work(1.0)
        assert not outputs["constrained"] and engine.scheduler.num_awaiting_grammar == 1
        release.set()
        while not (outputs["constrained"] and outputs["constrained"][-1].finished):
            engine.step() or engine.scheduler.wait_for_work(1.0)
        last = outputs["constrained"][-1]
        if fails:
            assert last.finish_reason.value == "error" and "boom" in last.error
            assert len(outputs["constrained"]) == 1
        else:
            text = engine.tokenizer.decode([t for o in outputs["constrained"] for t in o.new_token_ids][:-1])
            assert last.finish_reason.value == "stop" and text in CHOICES
    finally:
        release.set()
        engine.shutdown()


def test_a_grammar_compiling_past_the_deadline_fails_its_request_and_the_engine_goes_on(tiny_checkpoint, monkeypatch):
    """grammar_compile_timeout_s: a compilation that never ends (a fake) fails its request with the deadline's message
    while the engine keeps serving, another constraint's request included."""
    engine = _engine(tiny_checkpoint, grammar_compile_timeout_s=0.3)
    release, compile_for_real = threading.Event(), engine.grammars._compile
    stuck_key = _params({"regex": "a+"}, 0.0, 0, 8).guided_decoding.key
    monkeypatch.setattr(engine.grammars, "_compile", lambda grammar, key: release.wait(30) if key == stuck_key
                        else compile_for_real(grammar, key))
    try:
        results = engine.generate([[7, 8, 9]] * 3, [_params({"regex": "a+"}, 0.0, 0, 8),
                                                    _params({"choice": CHOICES}, 0.0, 0, 32), _params(None, 0.0, 0, 8)])
        assert results[0]["finish_reason"] == "error" and "did not compile within 0.3 s" in results[0]["error"]
        assert results[1]["finish_reason"] == "stop" and results[2]["finish_reason"] in ("length", "stop")
        engine.kv.check()
    finally:
        release.set()
        engine.shutdown()


def test_without_overlap_scheduling_too(tiny_checkpoint):
    engine = _engine(tiny_checkpoint, overlap_scheduling=False)
    try:
        params = [_params({"json": SCHEMAS[n], "disable_any_whitespace": True}, 1.0, i, 256)
                  for i, n in enumerate(SCHEMA_NAMES[:6])]
        for name, r in zip(SCHEMA_NAMES, engine.generate(_prompts(6), params)):
            assert r["finish_reason"] == "stop"
            jsonschema.validate(json.loads(r["text"]), SCHEMAS[name])
    finally:
        engine.shutdown()
