"""backend/request.py: SamplingParams built and coerced once; RequestLimits, the engine's one gate."""

from __future__ import annotations

import pytest

from backend.memory.kv_manager import KVCacheManager
from backend.request import RequestLimits, SamplingParams, Sequence

LIMITS = RequestLimits(vocab_size=8, max_tokens_limit=100, max_request_positions=16)


def test_from_dict_coerces_what_clients_send():
    params = SamplingParams.from_dict({"max_tokens": "12", "temperature": 1, "top_k": 3.0, "min_tokens": "12"})
    assert params == SamplingParams(max_tokens=12, temperature=1.0, top_k=3, min_tokens=12)
    assert isinstance(params.temperature, float)
    assert SamplingParams.from_dict({"stop": "fox"}).stop == ["fox"]


def test_min_tokens_above_max_tokens_is_max_tokens():
    """vLLM refuses it; it was taken as ignore_eos here before min_tokens held stops, and genai-perf may send a
    max_tokens below its output length: the request runs to max_tokens."""
    assert SamplingParams.from_dict({"max_tokens": 12, "min_tokens": 20}).min_tokens == 12
    assert SamplingParams.from_dict({"min_tokens": 20}).min_tokens == SamplingParams.max_tokens


def test_null_means_not_given_where_vllm_takes_none():
    """Clients written for Triton's vLLM backend send explicit nulls for these (vLLM's SamplingParams takes None)."""
    nulls = {"seed": None, "logprobs": None, "stop": None, "stop_token_ids": None, "timeout_ms": None,
             "ignore_eos": None}
    assert SamplingParams.from_dict({"max_tokens": 5, **nulls}) == SamplingParams(max_tokens=5)
    with pytest.raises(ValueError, match="max_tokens must be an integer"):  # (as the vLLM backend's int() refuses it)
        SamplingParams.from_dict({"max_tokens": None})


def test_vllm_parameters_at_the_values_this_engine_applies_are_accepted():
    """Clients that send vLLM's whole parameter set send these at vLLM's defaults, which is what the engine does;
    another value is refused naming it, not ignored."""
    defaults = {"skip_special_tokens": True, "spaces_between_special_tokens": True, "include_stop_str_in_output": False}
    assert SamplingParams.from_dict({"max_tokens": 5, **defaults}) == SamplingParams(max_tokens=5)
    for key, value in defaults.items():
        with pytest.raises(ValueError, match=f"{key}={str(not value).lower()} is not supported"):
            SamplingParams.from_dict({key: not value})


def test_what_older_triton_openai_frontends_send_is_taken_as_the_vllm_backend_takes_it():
    """Triton's OpenAI frontend dumps the OpenAI request without its None fields: up to 25.11 a chat request carries
    its boolean `logprobs` (false unless asked for), up to 25.12 a completion carries `best_of` 1. false asks for
    nothing, true for one log-probability (the vLLM backend's int()); best_of is accepted at 1 (n is 1) only."""
    chat = {"frequency_penalty": 0, "ignore_eos": False, "logprobs": False, "max_tokens": 8, "n": 1,
            "presence_penalty": 0, "temperature": 0.7, "top_p": 1}
    assert SamplingParams.from_dict(chat) == SamplingParams(max_tokens=8, temperature=0.7)
    assert SamplingParams.from_dict({**chat, "logprobs": True}).logprobs == 1
    assert SamplingParams.from_dict({"best_of": 1, "max_tokens": 8, "n": 1}) == SamplingParams(max_tokens=8)
    assert SamplingParams.from_dict({"best_of": None}) == SamplingParams()
    with pytest.raises(ValueError, match="best_of=2 is not supported here"):
        SamplingParams.from_dict({"best_of": 2})


def test_booleans_may_come_as_the_strings_true_and_false_as_numbers_come_as_numeric_strings():
    """The vLLM backend's parser takes strings for its boolean keys, and clients built for it send them so."""
    assert SamplingParams.from_dict({"ignore_eos": "true"}).ignore_eos is True
    assert SamplingParams.from_dict({"ignore_eos": " False "}).ignore_eos is False
    assert SamplingParams.from_dict({"skip_special_tokens": "TRUE", "include_stop_str_in_output": "false"}) == \
        SamplingParams()
    with pytest.raises(ValueError, match="skip_special_tokens=false is not supported"):
        SamplingParams.from_dict({"skip_special_tokens": "false"})
    with pytest.raises(ValueError, match="ignore_eos must be a boolean"):
        SamplingParams.from_dict({"ignore_eos": "1"})


def test_any_64_bit_seed_is_taken_as_openai_allows_and_repeats():
    """OpenAI's seed is any int64 (Triton's OpenAI frontend passes it through); torch's generators take negatives."""
    from backend.sampler import SamplerState

    draws = [[SamplerState(SamplingParams(temperature=1.0, seed=seed), [1]).uniform() for _ in range(2)]
             for seed in (-7, -7, 7)]
    assert draws[0] == draws[1] != draws[2]
    assert SamplingParams.from_dict({"seed": -2**63}).seed == -2**63


@pytest.mark.parametrize("params, message", [
    ({"max_tokens": 0}, "max_tokens must be a positive"),
    ({"max_tokens": "many"}, "max_tokens must be an integer"),
    ({"temperature": float("nan")}, "finite"),
    ({"top_p": 0}, "top_p"),
    ({"stop": [""]}, "stop"),
    ({"stop": [f"s{i}" for i in range(65)]}, "stop takes at most 64 strings"),  # (each searched every token)
    ({"stop": ["x" * 1025]}, "of at most 1024 characters"),
    ({"ignore_eos": "yes"}, "ignore_eos must be a boolean"),
    ({"min_tokens": -1}, "min_tokens must be a non-negative integer"),
    ({"min_tokens": "some"}, "min_tokens must be an integer"),
    ({"temp": 1}, "unknown key"),
    ({"logit_bias": {"x": 1}}, "a logit_bias token id must be an integer"),
    ({"logit_bias": {"5": "much"}}, "logit_bias\\['5'\\] must be a finite number"),
    ({"logit_bias": {"5": 150}}, "logit_bias must map token ids to numbers in \\[-100, 100\\]"),
])
def test_from_dict_refuses_bad_values_naming_them(params, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams.from_dict(params)


@pytest.mark.parametrize("prompt, params, message", [
    ([], {}, "the prompt is empty"),
    ([1, 8], {}, "token id 8 is out of the vocabulary"),
    ([-1], {}, "token id -1 is out of the vocabulary"),
    ([1], {"max_tokens": 101}, "max_tokens must be at most 100"),
    ([1], {"stop_token_ids": [9]}, "stop_token_ids outside the vocabulary"),
    ([1], {"logit_bias": {2: 1.0, 8: -1.0}}, "logit_bias outside the vocabulary \\[0, 8\\): \\[8\\]"),
    ([1], {"allowed_token_ids": [3, 12]}, "allowed_token_ids outside the vocabulary"),
    ([1] * 10, {"max_tokens": 8}, "needs 17 positions, more than the 16"),
])
def test_limits_refuse_what_the_deployment_cannot_serve(prompt, params, message):
    with pytest.raises(ValueError, match=message):
        LIMITS.check(prompt, SamplingParams(**params))


def test_limits_accept_exactly_the_positions_the_memory_holds():
    LIMITS.check([1] * 10, SamplingParams(max_tokens=7))  # 10 + 7 - 1 = 16: the last token is never fed back


def test_the_capacity_rule_is_the_memory_managers(tiny_checkpoint):
    """The limit the gate uses is what one request can really reach running alone."""
    import torch

    from backend.model.config import load_model_config

    kv = KVCacheManager(load_model_config(tiny_checkpoint), num_tokens=512, swa_full_tokens_ratio=1.0, page_size=16,
                        max_running_requests=1, dtype=torch.float32, device="cpu")
    positions = kv.max_request_positions()
    seq = Sequence("alone", [1] * (positions + 1))
    while seq.num_computed_tokens < positions:  # chunked prefill, as the scheduler runs it alone
        n = min(16, positions - seq.num_computed_tokens)
        assert kv.can_extend(seq, n)
        kv.extend(seq, n)
        seq.num_computed_tokens += n
        kv.release_slid_out(seq)
    assert not kv.can_extend(seq, 1)  # one position more does not fit
    kv.free(seq)
    kv.check()
