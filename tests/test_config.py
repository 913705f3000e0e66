"""EngineConfig: every rule, cross-field ones included, checked once at construction, naming the parameter."""

from __future__ import annotations

import pytest

from backend.config import ConfigError, EngineConfig


@pytest.mark.parametrize("kwargs, name", [
    ({"policy": "decode_first"}, "policy"),
    ({"decode_interleave_every": 0}, "decode_interleave_every"),
    ({"policy": "mixed", "decode_interleave_every": 8}, "decode_interleave_every"),
    ({"prefill_chunk_tokens": 0}, "prefill_chunk_tokens"),
    ({"prefill_chunk_tokens": 9000, "max_num_batched_tokens": 8192}, "prefill_chunk_tokens"),
    ({"itl_target_ms": 0}, "itl_target_ms"),
    ({"max_running_requests": 0}, "max_running_requests"),
    ({"max_running_requests": 64, "max_num_batched_tokens": 32}, "max_num_batched_tokens"),
    ({"max_running_requests": 2.5}, "max_running_requests"),
    ({"num_tokens": 0}, "num_tokens"),
    ({"swa_full_tokens_ratio": 1.5}, "swa_full_tokens_ratio"),
    ({"page_size": 48}, "page_size"),
    ({"device": "tpu"}, "device"),
    ({"dtype": "float64"}, "dtype"),
    ({"max_tokens_limit": 0}, "max_tokens_limit"),
    ({"prefix_cache_entries": 0}, "prefix_cache_entries"),
    ({"prefix_cache_end_entries": -1}, "prefix_cache_end_entries"),
    ({"prefix_cache_entries": 16, "prefix_cache_end_entries": 17}, "prefix_cache_end_entries"),
])
def test_bad_values_name_the_parameter(kwargs, name):
    with pytest.raises(ConfigError, match=f"'{name}'"):
        EngineConfig(**kwargs)


@pytest.mark.parametrize("params, name", [
    ({"policy": "mixed", "decode_interleave_every": "2"}, "decode_interleave_every"),
    ({"prefill_chunk_tokens": "9000"}, "prefill_chunk_tokens"),
    ({"max_running_requests": "64", "max_num_batched_tokens": "32"}, "max_num_batched_tokens"),
    ({"page_size": "sixteen"}, "page_size"),
    ({"polcy": "mixed"}, "polcy"),
])
def test_string_parameters_are_parsed_then_checked_by_the_same_rules(params, name):
    with pytest.raises(ConfigError, match=f"'{name}'"):
        EngineConfig.from_parameters(params)


def test_good_parameters_parse_and_empty_means_default():
    config = EngineConfig.from_parameters({"policy": "mixed", "itl_target_ms": "40", "max_running_requests": "8",
                                           "max_num_batched_tokens": "1024", "prefill_chunk_tokens": "",
                                           "use_reference_kernels": "true"})
    assert (config.policy, config.itl_target_ms, config.max_running_requests) == ("mixed", 40.0, 8)
    assert config.prefill_chunk_tokens is None and config.use_reference_kernels is True
