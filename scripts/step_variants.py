"""The ways a GPU step can be launched beside the configured one, spelled once for the scripts that run them
(`check_engine_device.py --variants`, `bench_v4.py --variants`):

    pdl              programmatic dependent launch: every kernel launched while the one before it runs (a Hopper
                     GPU; kernels/common.py)
    side_stream      a layer's independent branches on a second CUDA stream (DeepseekV4Model.use_side_stream)
    pdl+side_stream  both

Each name turns on EngineConfig settings of the same meaning (`settings`).
"""

from __future__ import annotations

# a single variant's name -> the EngineConfig setting it turns on
SETTINGS = {"pdl": "programmatic_dependent_launch", "side_stream": "side_stream"}
NAMES = ("pdl", "side_stream", "pdl+side_stream")  # what --variants takes


def settings(variant: str) -> dict[str, bool]:
    """Every setting of SETTINGS, on where `variant` ("" for none, or names joined by "+") names it."""
    named = set(filter(None, variant.split("+")))
    unknown = named - set(SETTINGS)
    if unknown:
        raise ValueError(f"unknown step variant(s) {sorted(unknown)}: known are {', '.join(NAMES)}")
    return {setting: name in named for name, setting in SETTINGS.items()}
