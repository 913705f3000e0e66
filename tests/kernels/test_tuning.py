"""kernels/tuning.py: per-device tuned configurations, the nearest tuned count, and the default everywhere else."""

from __future__ import annotations

import pytest

from kernels import tuning

TABLE = {"attention": {"dtype=bfloat16,head_dim=512,mode=csa": {1: dict(BLOCK_N=16), 64: dict(BLOCK_N=32),
                                                                256: dict(BLOCK_N=64)}}}
DEFAULT = dict(BLOCK_N=8, num_warps=4)


def _asked(tokens, **shape):
    return tuning.tuned("attention", dict(dtype="bfloat16", head_dim=512, mode="csa", tokens=tokens, **shape), DEFAULT)


def test_the_nearest_tuned_count_by_ratio_over_the_default():
    with tuning.using(TABLE):
        assert _asked(1) == dict(BLOCK_N=16, num_warps=4)
        assert _asked(100)["BLOCK_N"] == 32 and _asked(160)["BLOCK_N"] == 64 and _asked(4096)["BLOCK_N"] == 64
        assert _asked(128)["BLOCK_N"] == 64  # (as near 64 as 256: the larger)
    assert [tuning.nearest_count([1, 64, 256, 4096], c) for c in (1, 7, 9, 100, 192, 2000)] == [1, 1, 64, 64, 256, 4096]


def test_a_change_is_written_as_what_it_changes_and_laid_over_the_plans_own_default():
    """A table holds what tuning changed of a count's default ({}: nothing), so a plan at another count keeps what its
    own count decides where the change does not touch it."""
    default = dict(BLOCK_M=16, SPLIT_K=3, gate_up=dict(BLOCK_N=64, num_warps=4))
    tuned = dict(BLOCK_M=16, SPLIT_K=3, gate_up=dict(BLOCK_N=128, num_warps=4))
    change = tuning.difference(tuned, default)
    assert change == {"gate_up": {"BLOCK_N": 128}} and tuning.overlay(default, change) == tuned
    assert tuning.difference(default, default) == {}
    with tuning.using({"k": {"n=1": {1: {"SPLIT_K": 1}, 256: {}}}}):
        own = dict(BLOCK_M=64, SPLIT_K=2)
        assert tuning.tuned("k", dict(n=1, tokens=2), own) == dict(BLOCK_M=64, SPLIT_K=1)
        assert tuning.tuned("k", dict(n=1, tokens=300), own) == own


def test_an_untuned_shape_or_kernel_gets_the_default():
    with tuning.using(TABLE):
        assert _asked(64, heads=8) == DEFAULT
        assert tuning.tuned("indexer", dict(head_dim=128, tokens=1), DEFAULT) == DEFAULT


def test_off_a_gpu_the_default():
    tuning.load(None)
    assert _asked(64) == DEFAULT


def test_the_file_round_trip_and_its_name(tmp_path):
    path = tmp_path / "device.json"
    tuning.write_table(path, TABLE, device="NVIDIA H200")
    assert tuning.read_table(path) == TABLE
    assert tuning.device_file("NVIDIA H200").name == "NVIDIA_H200.json"
    assert tuning.device_file("NVIDIA H100 80GB HBM3").name == "NVIDIA_H100_80GB_HBM3.json"


def test_a_plan_is_recorded_with_its_key_and_default():
    with tuning.recording() as requests:
        _asked(7)
    assert requests == [("attention", "dtype=bfloat16,head_dim=512,mode=csa", 7, DEFAULT)]


def test_a_malformed_file_is_refused_naming_it(tmp_path):
    """A configuration file edited by hand or written by another tool: a clear error that names it, at its reading
    (not a KeyError or AttributeError at a kernel's first launch)."""
    path = tmp_path / "device.json"
    for text in ("{not json", "[]", '{"device": "x"}', '{"kernels": {"attention": {"k=1": {"many": {}}}}}',
                 '{"kernels": {"attention": {"k=1": {"1": null}}}}', '{"kernels": {"attention": []}}'):
        path.write_text(text)
        with pytest.raises(ValueError, match=f"{path}: not a kernel configuration file"):
            tuning.read_table(path)
