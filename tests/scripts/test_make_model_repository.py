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


def test_writes_parameters_checkpoint_and_repo_root(tmp_path, tiny_checkpoint):
    ckpt = tmp_path / "ckpt"
    ckpt.symlink_to(tiny_checkpoint)
    config = mmr.make_repository(tmp_path / "repo", {"policy": "mixed", "step_log": 'a "quoted" \\ path'}, str(ckpt))
    params = mmr.read_parameters(config.read_text())
    assert params["policy"] == "mixed"
    assert params["step_log"] == 'a "quoted" \\ path'
    assert params["checkpoint"] == str(ckpt)
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


@pytest.mark.parametrize("argv, message", [
    (["--model-name", ".."], "--model-name '..'"),  # (OUT/<name> is replaced whole: OUT's parent, before)
    (["--model-name", ""], "--model-name ''"),  # (OUT itself)
    (["--model-name", "a/b"], "--model-name 'a/b'"),
    (["--checkpoint", "/nonexistent"], "parameter 'checkpoint': no config.json at /nonexistent"),
    (["--set", "checkpoint=/nonexistent"], "parameter 'checkpoint': no config.json at /nonexistent"),
])
def test_a_name_or_checkpoint_that_cannot_serve_is_refused_and_nothing_is_removed(tmp_path, capsys, argv, message):
    (tmp_path / "out" / "keep").mkdir(parents=True)
    (tmp_path / "beside").mkdir()
    assert mmr.main(["--out", str(tmp_path / "out"), *argv]) == 2
    assert message in capsys.readouterr().err
    assert (tmp_path / "out" / "keep").is_dir() and (tmp_path / "beside").is_dir()


def test_an_out_that_is_a_file_is_refused(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert mmr.main(["--out", str(tmp_path / "file")]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err


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


def test_a_value_with_line_breaks_is_written_as_protobufs_text_format_reads_it(tmp_path):
    """Pretty-printed JSON in hf_overrides (`--set "hf_overrides=$(cat overrides.json)"`): the line breaks are
    escaped, so tritonserver's parser (protobuf's text format) reads the value back whole."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    overrides = '{\n  "num_hidden_layers": 2\n}\t'
    config = mmr.make_repository(tmp_path, {"load_format": "dummy", "hf_overrides": overrides}, str(FLASH))
    parsed = text_format.Parse(config.read_text(), model_config_pb2.ModelConfig())
    assert parsed.parameters["hf_overrides"].string_value == overrides
    assert mmr.read_parameters(config.read_text())["hf_overrides"] == overrides


def test_a_symlinked_config_file_is_written_as_given(tmp_path):
    """A hub snapshot's config.json is a link into its blobs: the repository names the snapshot's file, beside which
    its tokenizer is, not the blob."""
    (tmp_path / "blobs").mkdir()
    (tmp_path / "blobs" / "0a1b").write_bytes(FLASH.read_bytes())
    (tmp_path / "snapshot").mkdir()
    (tmp_path / "snapshot" / "config.json").symlink_to(tmp_path / "blobs" / "0a1b")
    linked = tmp_path / "snapshot" / "config.json"
    config = mmr.make_repository(tmp_path / "repo", {"load_format": "dummy"}, str(linked))
    assert mmr.read_parameters(config.read_text())["checkpoint"] == str(linked)


@pytest.mark.parametrize("edit, message", [
    ({"hidden_size": "64"}, "'checkpoint'.*hidden_size='64' is not of type int"),
    ({"num_hidden_layers": 4.0}, "'checkpoint'.*num_hidden_layers=4.0 is not of type int"),
    ({"rope_parameters": "x"}, "'checkpoint'.*rope_parameters='x' is not of type dict"),
    ({"mlp_layer_types": ["moe"]}, "'checkpoint'.*len\\(mlp_layer_types\\)=1 != num_hidden_layers=4"),
    ({"max_position_embeddings": 0}, "'checkpoint'.*max_position_embeddings=0: must be at least 1"),
    ({"layer_types": None, "compress_ratios": [0, 0, 4, 8]}, "'checkpoint'.*compress_ratios \\[8\\] are none of"),
    (None, "'checkpoint'.*config.json is not valid JSON"),
])
def test_a_config_json_with_values_of_the_wrong_kind_fails_naming_the_key(tmp_path, tiny_checkpoint, edit, message):
    """What config.json holds is checked before a repository is written, naming the file and the key (these were
    Python errors from deep inside the model's construction, or from a later model load)."""
    import json
    import shutil

    checkpoint = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, checkpoint)
    raw = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text("{" if edit is None else json.dumps({**raw, **edit}))
    with pytest.raises(ConfigError, match=message):
        mmr.make_repository(tmp_path / "repo", {}, str(checkpoint))
    assert not (tmp_path / "repo" / "dsv4").exists()


def test_a_draft_layer_that_the_weights_lack_fails_with_a_message(tmp_path, capsys):
    """num_speculative_tokens on a directory with a config.json and no weight file: refused with the checkpoint's
    error, exit status 2 (a traceback before)."""
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_bytes(FLASH.read_bytes())
    argv = ["--out", str(tmp_path / "repo"), "--checkpoint", str(tmp_path / "ckpt"),
            "--set", "num_speculative_tokens=1"]
    assert mmr.main(argv) == 2
    assert "safetensors" in capsys.readouterr().err
