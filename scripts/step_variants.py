"""The ways a GPU step can be launched beside the configured one, spelled once for the scripts that run them
(`check_engine_device.py --variants`, `bench_v4.py --variants`):

    pdl              programmatic dependent launch: every kernel launched while the one before it runs (a Hopper
                     GPU; kernels/common.py), the weight-streaming kernels asking L2 for their first weight lines
                     while they wait
    side_stream      a layer's independent branches on a second CUDA stream (DeepseekV4Model.use_side_stream)
    pdl+side_stream  both
    pdl+no_prefetch  programmatic dependent launch without the weight prefetch (bench_v4 only: what the prefetch
                     adds, timed beside `pdl`)

`pdl` and `side_stream` are EngineConfig settings of the same meaning (`settings`); `no_prefetch` is a switch of the
kernels' launches (`prefetches_weights`).
"""

from __future__ import annotations

# a variant's part -> the EngineConfig setting it turns on
SETTINGS = {"pdl": "programmatic_dependent_launch", "side_stream": "side_stream"}
NAMES = ("pdl", "side_stream", "pdl+side_stream")  # what an engine runs (check_engine_device.py --variants)
TIMED = (*NAMES, "pdl+no_prefetch")  # what bench_v4.py --variants times
_PARTS = {*SETTINGS, "no_prefetch"}


def _parts(variant: str) -> set[str]:
    parts = set(filter(None, variant.split("+")))
    if not parts <= _PARTS:
        raise ValueError(f"unknown step variant part(s) {sorted(parts - _PARTS)} in {variant!r}: known are "
                         f"{', '.join(TIMED)}")
    return parts


def settings(variant: str) -> dict[str, bool]:
    """Every setting of SETTINGS, on where `variant` ("" for none, or parts joined by "+") names it."""
    parts = _parts(variant)
    return {setting: name in parts for name, setting in SETTINGS.items()}


def prefetches_weights(variant: str) -> bool:
    """Whether the kernels, launched with programmatic dependent launch, prefetch their weights while they wait."""
    return "no_prefetch" not in _parts(variant)
