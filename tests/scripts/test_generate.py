"""scripts/generate.py: a setting or prompt that cannot be served is one line naming it, exit status 2, and the
settings are checked before the model loads (minutes at V4's size)."""

import json

import generate  # scripts/ is on sys.path (tests/conftest.py)
import pytest


@pytest.mark.parametrize("flags, message", [
    (["--checkpoint", "/nonexistent"], "no config.json in checkpoint directory /nonexistent"),
    (["--max-running-requests", "0"], "parameter 'max_running_requests': invalid value 0"),
    (["--max-tokens", "-1"], "max_tokens must be a positive integer, got -1"),
    (["--temperature", "-1"], "temperature must be in [0, 100], got -1.0"),
])
def test_a_bad_setting_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch, flags, message):
    def no_load(config):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(generate, "LLMEngine", no_load)
    (tmp_path / "prompts.json").write_text(json.dumps(["hello"]))
    with pytest.raises(SystemExit) as exit_:
        generate.main(["--prompts-file", str(tmp_path / "prompts.json"), *flags])
    assert exit_.value.code == 2 and f"generate.py: error: {message}" in capsys.readouterr().err


def test_a_prompt_the_engine_refuses_is_one_line_too(tmp_path, capsys, tiny_checkpoint):
    (tmp_path / "prompts.json").write_text(json.dumps(["hello", ""]))
    with pytest.raises(SystemExit) as exit_:
        generate.main(["--checkpoint", str(tiny_checkpoint), "--prompts-file", str(tmp_path / "prompts.json")])
    assert exit_.value.code == 2 and "generate.py: error: the prompt is empty" in capsys.readouterr().err
