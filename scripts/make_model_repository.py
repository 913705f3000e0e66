#!/usr/bin/env python3
r"""Write a Triton model repository serving this checkout's engine, with chosen parameters.

    .venv/bin/python scripts/make_model_repository.py --out /tmp/repo --checkpoint checkpoints/dsv4-tiny \
        --set policy=mixed --set max_running_requests=8

copies model_repository/dsv4 to OUT/<model-name>/ and rewrites the `parameters` of its
config.pbtxt. Values are validated through EngineConfig.from_parameters, cross-field rules included,
and against the checkpoint's config.json (which must be there: write the repository where the checkpoint is) and
the pool sizes (the derived chunk budget): a bad key or value fails here, naming the parameter, instead of at model
load. The
`repo_root` parameter is set to this checkout, so a repository anywhere on disk still imports
`backend`.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from backend.config import ConfigError, EngineConfig  # noqa: E402
from backend.deployment import check_deployment  # noqa: E402
from backend.model.checkpoint import CheckpointError  # noqa: E402
from backend.model.config import UnsupportedCheckpoint, config_path as model_config_path  # noqa: E402

SOURCE = REPO_ROOT / "model_repository" / "dsv4"
PARAM_RE = re.compile(r'(\{\s*key:\s*"(?P<key>[^"]+)",\s*value:\s*\{\s*string_value:\s*)"(?P<value>(?:[^"\\]|\\.)*)"')
NON_ENGINE_KEYS = ("repo_root",)


def read_parameters(pbtxt: str) -> dict[str, str]:
    return {m["key"]: _unescape(m["value"]) for m in PARAM_RE.finditer(pbtxt)}


def rewrite_parameters(pbtxt: str, values: dict[str, str]) -> str:
    def replace(match: re.Match) -> str:
        key = match["key"]
        value = values[key] if key in values else _unescape(match["value"])
        return f'{match.group(1)}"{_escape(value)}"'

    return PARAM_RE.sub(replace, pbtxt)


# protobuf's text format: a string value holds no raw line break (pretty-printed JSON in hf_overrides has them)
_ESCAPES = {"\\": "\\", '"': '"', "n": "\n", "r": "\r", "t": "\t"}  # escape letter -> the character


def _escape(value: str) -> str:
    escaped = {character: "\\" + letter for letter, character in _ESCAPES.items()}
    return "".join(escaped.get(character, character) for character in value)


def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", lambda m: _ESCAPES.get(m[1], m[1]), value)


def parse_sets(items: list[str], known: list[str]) -> dict[str, str]:
    values = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        if key not in known:
            raise ConfigError(f"unknown parameter {key!r} in --set; known: {', '.join(sorted(known))}")
        values[key] = value
    return values


# A served model's name: its directory in the repository, and a URL path segment (what tritonserver serves it as).
MODEL_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def make_repository(out: Path, sets: dict[str, str], checkpoint: str | None, model_name: str = "dsv4") -> Path:
    """Write OUT/<model_name>/ and return its config.pbtxt path."""
    if not MODEL_NAME_RE.fullmatch(model_name):  # (OUT/<name> is replaced whole: never "", "." or "..")
        raise ConfigError(f"--model-name {model_name!r}: letters, digits, '_', '.' and '-', not starting with '.' "
                          "or '-'")
    pbtxt = (SOURCE / "config.pbtxt").read_text(encoding="utf-8")
    values = dict(sets)
    if checkpoint is not None:
        values["checkpoint"] = os.path.abspath(Path(checkpoint).expanduser())  # (a symlink kept: a hub snapshot's
        # config.json links into its blobs, where its tokenizer is not)
    values["repo_root"] = str(REPO_ROOT)
    engine_params = {k: v for k, v in {**read_parameters(pbtxt), **values}.items() if k not in NON_ENGINE_KEYS}
    config = EngineConfig.from_parameters(engine_params)  # raises ConfigError naming the parameter
    if not Path(config.checkpoint).is_absolute():
        config.checkpoint = str(REPO_ROOT / config.checkpoint)
    if not model_config_path(config.checkpoint).is_file():  # (found at model load only, minutes later)
        raise ConfigError(f"parameter 'checkpoint': no config.json at {config.checkpoint} (a checkpoint directory, "
                          "or a config.json file with load_format=dummy)")
    try:
        check_deployment(config)
    except (UnsupportedCheckpoint, CheckpointError) as exc:  # config.json's, hf_overrides' (the message names
        # which), or the weight files' (the MTP layer num_speculative_tokens needs)
        raise ConfigError(f"parameter {'hf_overrides' if config.hf_overrides else 'checkpoint'!r}: {exc}") from exc
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a directory")

    target = out / model_name
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(SOURCE, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    pbtxt = rewrite_parameters(pbtxt, values)
    pbtxt = re.sub(r'^name:\s*"[^"]*"', f'name: "{model_name}"', pbtxt, count=1, flags=re.M)
    config_path = target / "config.pbtxt"
    config_path.write_text(pbtxt)
    return config_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path, help="model repository directory to write")
    parser.add_argument("--checkpoint", help="checkpoint directory (written as an absolute path)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="set a config.pbtxt parameter (repeatable)")
    parser.add_argument("--model-name", default="dsv4", help="served model name (default: dsv4)")
    args = parser.parse_args(argv)
    try:
        known = list(read_parameters((SOURCE / "config.pbtxt").read_text(encoding="utf-8")))
        sets = parse_sets(args.sets, [k for k in known if k not in NON_ENGINE_KEYS])
        config_path = make_repository(args.out, sets, args.checkpoint, args.model_name)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(config_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
