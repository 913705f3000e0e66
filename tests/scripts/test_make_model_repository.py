"""scripts/make_model_repository.py: parameters rewritten, validated, repo_root written."""

from pathlib import Path

import make_model_repository as mmr  # scripts/ is on sys.path (tests/conftest.py)
import pytest

from backend.config import ConfigError, EngineConfig

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_config_pbtxt_has_one_parameter_per_engine_field():
    import dataclasses

    params = mmr.read_parameters((REPO_ROOT / "model_repository" / "dsv4" / "config.pbtxt").read_text())
    assert set(params) == {f.name for f in dataclasses.fields(EngineConfig)} | {"repo_root"}
    assert all(value == "" for value in params.values()), "defaults live in backend/config.py"


def test_writes_parameters_checkpoint_and_repo_root(tmp_path):
    ckpt = tmp_path / "ckpt"
    config = mmr.make_repository(tmp_path / "repo", {"policy": "mixed", "step_log": 'a "quoted" \\ path'}, str(ckpt))
    params = mmr.read_parameters(config.read_text())
    assert params["policy"] == "mixed"
    assert params["step_log"] == 'a "quoted" \\ path'
    assert params["checkpoint"] == str(ckpt.resolve())
    assert params["repo_root"] == str(REPO_ROOT)
    assert (config.parent / "1" / "model.py").is_file()
    assert 'name: "dsv4"' in config.read_text()


def test_model_name_and_overwrite(tmp_path):
    mmr.make_repository(tmp_path, {"page_size": "16"}, None, model_name="other")
    config = mmr.make_repository(tmp_path, {}, None, model_name="other")
    assert 'name: "other"' in config.read_text()
    assert mmr.read_parameters(config.read_text())["page_size"] == ""


@pytest.mark.parametrize("items, message", [(["polcy=mixed"], "unknown parameter 'polcy'"), (["policy"], "key=value")])
def test_bad_set_arguments(items, message):
    with pytest.raises(ConfigError, match=message):
        mmr.parse_sets(items, ["policy"])


def test_bad_values_fail_naming_the_parameter(tmp_path):
    with pytest.raises(ConfigError, match="page_size"):
        mmr.make_repository(tmp_path, {"page_size": "3"}, None)
    assert not (tmp_path / "dsv4").exists()


def test_cli_exit_codes(tmp_path, capsys):
    assert mmr.main(["--out", str(tmp_path), "--set", "max_running_requests=4"]) == 0
    assert mmr.main(["--out", str(tmp_path), "--set", "max_running_requests=zero"]) == 2
    assert "max_running_requests" in capsys.readouterr().err


@pytest.mark.parametrize("sets, name", [
    ({"policy": "mixed", "decode_interleave_every": "2"}, "decode_interleave_every"),
    ({"prefill_chunk_tokens": "9000"}, "prefill_chunk_tokens"),  # above max_num_batched_tokens (8192)
    ({"max_running_requests": "64", "max_num_batched_tokens": "32"}, "max_num_batched_tokens"),
    # Checked against the checkpoint's window (128): a 128-position window pool cannot hold one window + a page.
    ({"num_tokens": "512"}, "swa_full_tokens_ratio"),
])
def test_cross_field_values_fail_before_a_repository_is_written(tmp_path, tiny_checkpoint, sets, name):
    with pytest.raises(ConfigError, match=f"'{name}'"):
        mmr.make_repository(tmp_path, sets, str(tiny_checkpoint))
    assert not (tmp_path / "dsv4").exists()


FLASH = REPO_ROOT / "docs" / "configs" / "deepseek-v4-flash.config.json"


def test_dummy_weights_of_a_published_config_file_with_overrides(tmp_path):
    config = mmr.make_repository(tmp_path, {"load_format": "dummy", "hf_overrides": '{"num_hidden_layers": 2}'},
                                 str(FLASH))
    params = mmr.read_parameters(config.read_text())
    assert (params["load_format"], params["hf_overrides"]) == ("dummy", '{"num_hidden_layers": 2}')
    assert params["checkpoint"] == str(FLASH)


@pytest.mark.parametrize("sets, message", [
    ({"load_format": "dummy", "hf_overrides": '{"num_hidden_layers": 0}'}, "'hf_overrides'.*num_hidden_layers=0"),
    ({"load_format": "dummy", "hf_overrides": '{"num_hiden_layers": 2}'}, "'hf_overrides'.*'num_hiden_layers'"),
    ({"load_format": "dummy", "hf_overrides": "num_hidden_layers=2"}, "'hf_overrides'.*not JSON"),
    ({"hf_overrides": '{"num_hidden_layers": 2}'}, "'checkpoint'.*load_format=dummy"),  # no weights in a config file
])
def test_bad_overrides_of_a_config_file_fail_before_a_repository_is_written(tmp_path, sets, message):
    with pytest.raises(ConfigError, match=message):
        mmr.make_repository(tmp_path, sets, str(FLASH))
    assert not (tmp_path / "dsv4").exists()
