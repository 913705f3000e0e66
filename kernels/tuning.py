"""Tile configurations tuned per device, read by the kernels' launch plans.

vLLM's convention for tuned Triton kernels (benchmark_moe.py --tune): scripts/tune_kernels.py sweeps candidate tiles
on a GPU at DeepSeek-V4-Flash's shapes and writes kernels/configs/<device name>.json, one file per device:

    {"device": "NVIDIA H200", "triton": "3.6.0", "torch": "2.11.0+cu130",
     "kernels": {"attention": {"dtype=bfloat16,head_dim=512,heads=64,kv_cache=fp8,mode=csa":
                                   {"1": {"BLOCK_N": 16, "num_stages": 1}, "8": {}, ...}}}}

A kernel's table maps a shape key (its fields, sorted, "name=value" joined by commas) to what the tuning changed of
the plan's default, by count (tokens, or (token, expert) pairs for the MoE; {}: the default won there): a plan asks
with `tuned(kernel, shape_key, default)` and gets the change of the count nearest its own (vLLM picks the closest M;
nearest by ratio here: 2,000 tokens take 4,096's, not 256's) laid over its own default, which keeps what its count
decides (the orientation, the split of K, the tiles a count needs) unless the tuning changed that very field. A
device without a file, a shape not tuned, the CPU and the interpreter all get the default: today's choice. A table
written under another Triton than this one's is still read, with a warning (tiles valid under one may spill under
the other: scripts/check_kernels_compile.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
from pathlib import Path

import torch

from kernels.common import is_interpreting

logger = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
COUNT_FIELDS = ("tokens", "pairs")  # the one field of a shape key matched to the nearest tuned count

_table: dict | None = None  # kernel -> shape key -> count -> config; None: not read yet
_requests: list | None = None  # while recording: (kernel, shape key, count, default) of each tuned() call


def device_file(device_name: str) -> Path:
    """kernels/configs/<the device's name, runs of other characters than letters and digits as one _>.json."""
    return CONFIG_DIR / (re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_") + ".json")


def read_table(path: Path) -> dict:
    """The kernels' table of a configuration file, its counts as ints."""
    return _table_of(_read(path), path)


def _read(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except ValueError as exc:
        raise ValueError(f"{path}: not a kernel configuration file (invalid JSON: {exc})") from None


def _table_of(written, path: Path) -> dict:
    """The kernels' table of a configuration file's contents, its counts as ints; a file of another shape is refused
    naming it (kernel -> shape key -> token count -> the launch's settings)."""
    def is_map(value) -> bool:
        return isinstance(value, dict)

    kernels = written.get("kernels") if is_map(written) else None
    valid = is_map(kernels) and all(
        is_map(shapes) and all(is_map(by_count) and all(
            str(count).isdigit() and is_map(config) for count, config in by_count.items())
            for by_count in shapes.values())
        for shapes in kernels.values())
    if not valid:
        raise ValueError(f"{path}: not a kernel configuration file: expected {{\"kernels\": {{kernel: {{shape key: "
                         "{token count: {setting: value}}}}}} (as scripts/tune_kernels.py writes)")
    return {kernel: {key: {int(count): config for count, config in by_count.items()}
                     for key, by_count in shapes.items()}
            for kernel, shapes in kernels.items()}


def write_table(path: Path, table: dict, **meta) -> None:
    """A configuration file: meta (device, versions) and the kernels' table."""
    kernels = {kernel: {key: {str(count): config for count, config in sorted(by_count.items())}
                        for key, by_count in sorted(shapes.items())}
               for kernel, shapes in sorted(table.items())}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    partial = Path(path).with_suffix(".json.partial")  # (renamed over it: a run cut while writing leaves it whole)
    partial.write_text(json.dumps({**meta, "kernels": kernels}, indent=1) + "\n")
    partial.replace(path)


def _device_table() -> dict:
    if is_interpreting() or not torch.cuda.is_available():
        return {}
    path = device_file(torch.cuda.get_device_name())
    if not path.is_file():
        return {}
    import triton

    written = _read(path)
    table = _table_of(written, path)
    written_under = str(written.get("triton", ""))
    if written_under.split(".")[:2] != triton.__version__.split(".")[:2]:
        logger.warning("%s was tuned under Triton %s, this is %s: its tiles are used, but were not compiled here",
                       path.name, written_under or "(not said)", triton.__version__)
    return table


def overlay(config: dict, patch: dict) -> dict:
    """config with patch laid over it, nested dicts (the MoE's per-GEMM tiles) merged key by key."""
    out = dict(config)
    for key, value in patch.items():
        nested = isinstance(value, dict) and isinstance(config.get(key), dict)
        out[key] = overlay(config[key], value) if nested else value
    return out


def difference(config: dict, default: dict) -> dict:
    """What config changes of default (nested dicts key by key): the patch `overlay(default, patch) == config`."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict) and isinstance(default.get(key), dict):
            if changed := difference(value, default[key]):
                out[key] = changed
        elif key not in default or default[key] != value:
            out[key] = value
    return out


def load(path: Path | None) -> None:
    """Use the configuration file at path from now on (None: the device's own, read again at the next plan)."""
    global _table
    _table = read_table(path) if path is not None else None


@contextlib.contextmanager
def using(table: dict):
    """Plans get their configurations from `table` (kernel -> shape key -> count -> config) while inside: how the
    tuner launches a candidate through the kernels' own wrappers."""
    global _table
    saved, _table = _table, table
    try:
        yield
    finally:
        _table = saved


@contextlib.contextmanager
def recording():
    """The (kernel, shape key, count, default) of every tuned() call while inside, in a list: how the tuner learns
    the key and default a plan asks for by running it."""
    global _requests
    saved, _requests = _requests, []
    try:
        yield _requests
    finally:
        _requests = saved


def shape_key(shape: dict | tuple) -> tuple[str, int | None]:
    """(the key string of a shape without its count, the count or None)."""
    if isinstance(shape, tuple):
        return ",".join(map(str, shape)), None
    count = next((shape[f] for f in COUNT_FIELDS if f in shape), None)
    return ",".join(f"{k}={v}" for k, v in sorted(shape.items()) if k not in COUNT_FIELDS), count


def dtype_name(dtype: torch.dtype) -> str:
    """A torch dtype as shape keys spell it: "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def tuned(kernel: str, shape: dict | tuple, default: dict) -> dict:
    """`default` with the change tuned for `kernel` at `shape` laid over it (the nearest tuned count's), or
    `default`."""
    global _table
    if _table is None:
        _table = _device_table()
    key, count = shape_key(shape)
    if _requests is not None:
        _requests.append((kernel, key, count, default))
    by_count = _table.get(kernel, {}).get(key)
    if not by_count:
        return default
    return overlay(default, by_count[nearest_count(by_count, count)])


def nearest_count(counts, count: int | None) -> int:
    """The tuned count nearest `count` by ratio (the larger of two as near)."""
    at = math.log2(max(count or 1, 1))
    return min(counts, key=lambda tuned_count: (abs(math.log2(max(tuned_count, 1)) - at), -tuned_count))
