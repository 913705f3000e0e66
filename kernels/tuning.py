"""Tile configurations tuned per device, read by the kernels' launch plans.

vLLM's convention for tuned Triton kernels (benchmark_moe.py --tune): scripts/tune_kernels.py sweeps candidate tiles
on a GPU at DeepSeek-V4-Flash's shapes and writes kernels/configs/<device name>.json, one file per device:

    {"device": "NVIDIA H200", "triton": "3.6.0", "torch": "2.11.0+cu130",
     "kernels": {"attention": {"dtype=bfloat16,head_dim=512,heads=64,kv=fp8,mode=csa":
                                   {"1": {"BLOCK_H": 32, "BLOCK_N": 16, "num_warps": 8, "num_stages": 1}, ...}}}}

A kernel's table maps a shape key (its fields, sorted, "name=value" joined by commas) to configurations by count
(tokens, or (token, expert) pairs for the MoE): a plan asks with `tuned(kernel, shape_key, default)` and gets the
configuration of the count nearest its own (vLLM picks the closest M), laid over its default. A device without a
file, a shape not tuned, the CPU and the interpreter all get the default: today's choice.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import torch

from kernels.common import is_interpreting

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
COUNT_FIELDS = ("tokens", "pairs")  # the one field of a shape key matched to the nearest tuned count

_table: dict | None = None  # kernel -> shape key -> count -> config; None: not read yet
_requests: list | None = None  # while recording: (kernel, shape key, count, default) of each tuned() call


def device_file(device_name: str) -> Path:
    """kernels/configs/<the device's name, runs of other characters than letters and digits as one _>.json."""
    return CONFIG_DIR / (re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_") + ".json")


def read_table(path: Path) -> dict:
    """The kernels' table of a configuration file, its counts as ints."""
    kernels = json.loads(Path(path).read_text())["kernels"]
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
    return read_table(path) if path.is_file() else {}


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
    """The tuned configuration of `kernel` at `shape` (the nearest tuned count's) over `default`, or `default`."""
    global _table
    if _table is None:
        _table = _device_table()
    key, count = shape_key(shape)
    if _requests is not None:
        _requests.append((kernel, key, count, default))
    by_count = _table.get(kernel, {}).get(key)
    if not by_count:
        return default
    nearest = min(by_count, key=lambda tuned_count: (abs(tuned_count - (count or 0)), tuned_count))
    return {**default, **by_count[nearest]}
