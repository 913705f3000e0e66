"""The command-line flags naming an engine's model, spelled once for every script that builds an engine.

    add_checkpoint_flags(parser)                         # --checkpoint, --load-format, --hf-overrides
    engine = LLMEngine(EngineConfig(**checkpoint_settings(args), device=...))

They are EngineConfig's `checkpoint`, `load_format` (`dummy`: random weights at the config's shapes and published
formats, no weight file read; the checkpoint may be a config.json file) and `hf_overrides` (a JSON object merged into
config.json), checked by the same rules as config.pbtxt's parameters.
"""

from __future__ import annotations

import argparse

from backend.config import DEFAULT_CHECKPOINT, LOAD_FORMATS, ConfigError, EngineConfig, parse_parameter


def _hf_overrides(text: str) -> dict:
    try:
        return parse_parameter("hf_overrides", text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_checkpoint_flags(parser: argparse.ArgumentParser, checkpoint: str = str(DEFAULT_CHECKPOINT)) -> None:
    parser.add_argument("--checkpoint", default=checkpoint,
                        help="checkpoint directory; with --load-format dummy also a config.json file")
    parser.add_argument("--load-format", choices=LOAD_FORMATS, default=EngineConfig.load_format,
                        help="auto: read the weights; dummy: random weights built on the device (no weight file)")
    parser.add_argument("--hf-overrides", type=_hf_overrides, default=None, metavar="JSON",
                        help='a JSON object merged into config.json, e.g. \'{"num_hidden_layers": 12}\'')


def checkpoint_settings(args: argparse.Namespace) -> dict:
    """The EngineConfig keyword arguments of the flags above."""
    return dict(checkpoint=args.checkpoint, load_format=args.load_format, hf_overrides=args.hf_overrides)
