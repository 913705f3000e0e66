"""EngineConfig: every rule, cross-field ones included, checked once at construction, naming the parameter."""

from __future__ import annotations

import logging
import re

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
    ({"load_format": "safetensors"}, "load_format"),
    ({"draft_sampling": "greedy"}, "draft_sampling"),
    ({"checkpoint": "docs/configs/deepseek-v4-flash.config.json"}, "checkpoint"),  # a config file holds no weights
    ({"hf_overrides": [1]}, "hf_overrides"),
    ({"hf_overrides": {"num_hidden_layer": 2}}, "hf_overrides"),  # not a key of config.json
    ({"hf_overrides": {"num_hidden_layers": "2"}}, "hf_overrides"),
    ({"hf_overrides": {"num_hidden_layers": 2.0}}, "hf_overrides"),
    ({"hf_overrides": {"norm_topk_prob": 1}}, "hf_overrides"),
    ({"hf_overrides": {"compress_ratios": 4}}, "hf_overrides"),  # a legacy key, of its own type
    ({"programmatic_dependent_launch": True, "device": "cpu"}, "programmatic_dependent_launch"),  # CUDA kernels only
    ({"side_stream": True, "device": "cpu"}, "side_stream"),
    ({"priority_aging_s": float("inf")}, "priority_aging_s"),  # (inf * 0 ordered the queue by NaN)
    ({"priority_aging_s": float("nan")}, "priority_aging_s"),
    ({"itl_target_ms": float("inf")}, "itl_target_ms"),
    ({"collective_timeout_s": float("inf")}, "collective_timeout_s"),  # (a timedelta overflowed at a collective)
    ({"collective_timeout_s": 1e300}, "collective_timeout_s"),
    ({"stop_grace_s": -1}, "stop_grace_s"),
    ({"stop_grace_s": float("nan")}, "stop_grace_s"),
    ({"hf_overrides": {"rope_theta": float("inf")}}, "hf_overrides"),
    ({"step_log": "/nonexistent-directory/steps.jsonl"}, "step_log"),  # (failed when the scheduler started)
    ({"step_log": "/tmp"}, "step_log"),
    ({"grammar_compile_timeout_s": 0}, "grammar_compile_timeout_s"),
    ({"device": "cuda", "cuda_graphs": True, "use_reference_kernels": True}, "cuda_graphs"),  # (a capture fails)
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
    ({"hf_overrides": "{num_hidden_layers: 2}"}, "hf_overrides"),  # not JSON
    ({"hf_overrides": "[2]"}, "hf_overrides"),  # not an object
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


def test_the_python_backends_own_parameters_are_left_to_it():
    """EXECUTION_ENV_PATH (a packed environment for the stub, how a stock Triton container gets torch) and
    FORCE_CPU_ONLY_INPUT_TENSORS sit beside the engine's parameters in config.pbtxt; they must not fail the load."""
    config = EngineConfig.from_parameters({"EXECUTION_ENV_PATH": "$$TRITON_MODEL_DIRECTORY/env.tar.gz",
                                           "FORCE_CPU_ONLY_INPUT_TENSORS": "no", "max_running_requests": "8"})
    assert config.max_running_requests == 8


def test_hf_overrides_parse_from_json_and_keep_config_json_types():
    config = EngineConfig.from_parameters({"load_format": "dummy", "checkpoint": "docs/configs/x.config.json",
                                           "hf_overrides": '{"num_hidden_layers": 12, "rms_norm_eps": 1, '
                                                           '"eos_token_id": [1, 2], "rope_scaling": null}'})
    assert config.load_format == "dummy"
    assert config.hf_overrides == {"num_hidden_layers": 12, "rms_norm_eps": 1, "eos_token_id": [1, 2],
                                   "rope_scaling": None}  # an int where config.json has a float is a number too


def test_draft_sampling_auto_drafts_the_argmax_only_where_the_draft_chain_is_static():
    """auto: argmax drafts with static decode steps (the chain a graph: no host draw between its passes), else a
    draw from the draft distribution; an explicit choice holds either way."""
    assert EngineConfig(device="cpu", cuda_graphs=True).resolved_draft_sampling() == "argmax"
    assert EngineConfig(device="cpu").resolved_draft_sampling() == "sample"
    assert EngineConfig(device="cpu", draft_sampling="argmax").resolved_draft_sampling() == "argmax"
    assert EngineConfig(device="cpu", cuda_graphs=True, draft_sampling="sample").resolved_draft_sampling() == "sample"


def test_pools_the_memory_cannot_hold_are_refused_naming_their_parameters():
    """(A bare MemoryError with no message, or torch's allocation error, before.)"""
    import torch

    from backend.deployment import plan_deployment

    with pytest.raises(ConfigError, match="'num_tokens' \\(99999999999999\\).*do not fit the cpu memory"):
        plan_deployment(EngineConfig(num_tokens=99999999999999), "cpu", torch.bfloat16)


def test_more_running_requests_than_the_window_pool_holds_are_a_warning_naming_what_fits(caplog):
    """Each decoding request holds its sliding window's pages: with more running requests than the window pool holds
    windows for, long decodes evicted each other every step and prefills got one-page chunks, with only an INFO line.
    (A warning, not a refusal: short requests hold fewer pages.)"""
    from backend.deployment import check_deployment

    with caplog.at_level(logging.WARNING, logger="backend.scheduler.policies"):  # 256 pages of 64, 3 a request
        assert check_deployment(EngineConfig(device="cpu", max_running_requests=84)) == 128  # 4 left, 2 for its window
        assert "prompts prefill a page a step" not in caplog.text
        assert check_deployment(EngineConfig(device="cpu", max_running_requests=85)) == 64  # one page: said
        assert "prompts prefill a page a step" in caplog.text
    assert "decodes evict each other" not in caplog.text
    with caplog.at_level(logging.WARNING, logger="backend.deployment"):
        check_deployment(EngineConfig(device="cpu", max_running_requests=86))
    assert re.search(r"max_running_requests=86 decoding requests hold 258 window pages \(3 each.*more than the window "
                     r"pool's 256.*Lower max_running_requests to 85 or raise num_tokens", caplog.text)
    with pytest.raises(ConfigError, match="fewer than one sliding window needs.*, or lower page_size"):
        check_deployment(EngineConfig(device="cpu", page_size=65536, swa_full_tokens_ratio=1.0))


def test_cuda_graphs_are_off_by_default_with_the_reference_kernels():
    """The torch references read values back (`.tolist()`, `.item()`): a step capturing them fails on CUDA."""
    assert EngineConfig(device="cuda").resolved_cuda_graphs()
    assert not EngineConfig(device="cuda", use_reference_kernels=True).resolved_cuda_graphs()


def test_settings_the_machine_cannot_serve_are_refused_naming_them_before_a_weight_is_read(monkeypatch):
    """device=cuda without a CUDA device; more ranks on a node than its GPUs (two would share one); a prefix cache
    whose snapshots do not fit memory: each a ConfigError naming the parameters, not torch's own error."""
    import torch

    from backend.engine import LLMEngine

    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="parameter 'device': cuda, but torch sees no CUDA device"):
            LLMEngine(EngineConfig(device="cuda"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match="'tensor_parallel_size'.*2 ranks on this node.*1 CUDA device$"):
        LLMEngine(EngineConfig(device="cuda", tensor_parallel_size=2))
    monkeypatch.undo()
    with pytest.raises(ConfigError, match="'prefix_cache_entries' \\(100000000\\).*do not fit the cpu memory"):
        LLMEngine(EngineConfig(device="cpu", prefix_cache_entries=100_000_000))
