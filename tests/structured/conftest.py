"""Shared by the structured-output tests: the built-in checkpoint's tokenizer and a constraint builder."""

from __future__ import annotations

from pathlib import Path

from backend.request import SamplingParams
from backend.structured.params import GuidedDecoding

TINY_TOKENIZER = Path(__file__).resolve().parents[2] / "checkpoints" / "dsv4-tiny" / "tokenizer.json"


def guided(constraint: dict) -> GuidedDecoding:
    """The GuidedDecoding of a `guided_decoding` object, as a request would carry it."""
    return SamplingParams.from_dict({"guided_decoding": constraint}).guided_decoding
