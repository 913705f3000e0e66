"""The fused norm + rope kernel (kernels/norm_rope.py) against its reference on CPU under the interpreter (the
reference is the model's math, casts included: the engine tests compare the model built on it with transformers)."""

from __future__ import annotations

import pytest
import torch

from kernels.norm_rope import norm_rope_reference, norm_rope_triton, plan_norm_rope

EPS = 1e-6
# fp32: the same casts and operations as the reference, the sum of squares reduced in another order (ulp-level in
# the factor, amplified by nothing): outputs of magnitude <= ~5 agree to a few 1e-7.
FP32 = dict(atol=1e-6, rtol=1e-5)
# bf16 outputs against the fp32 reference on the same (bf16-valued) inputs: the reference rounds nothing, the kernel
# rounds as the model does: the unweighted factor and the normed y (2^-8 relative each with round-to-nearest, 2^-7
# under the interpreter, whose fp32 -> bf16 cast truncates), then the rotated output once more; a rotated channel
# mixes two rounded values with |cos|, |sin| <= 1.25, so its error is relative to |y| rather than to itself (atol).
BF16_VS_FP32 = dict(atol=4e-2, rtol=2e-2)
# bf16 against the bf16 reference (the same roundings): on a GPU they agree but where an ulp-level fp32 difference
# straddles a rounding boundary (one bf16 ulp); under the interpreter, whose casts truncate where torch rounds to
# nearest, by up to one ulp (<= 2^-7 relative) per rounding, three of them on a normed and rotated channel.
BF16_VS_BF16 = dict(atol=3e-2, rtol=3e-2)

MODES = {  # name: (normalize, weighted, rope, inverse)
    "weighted": (True, True, False, False),
    "unweighted": (True, False, False, False),
    "weighted+rope": (True, True, True, False),
    "unweighted+rope": (True, False, True, False),
    "rope": (False, False, True, False),
    "inverse": (False, False, True, True),
}


def rope_tables(num_tokens, half, dtype=torch.float32, seed=0, scaling=1.25):
    """cos / sin of random angles times a YaRN-like attention factor (backend/model/rotary.py), [T, half]."""
    gen = torch.Generator().manual_seed(seed)
    angles = torch.rand(num_tokens, half, generator=gen) * 100.0
    return (angles.cos() * scaling).to(dtype), (angles.sin() * scaling).to(dtype)


def make_case(num_tokens, heads, channels, mode, rope_dim=16, dtype=torch.float32, seed=0, weight_dtype=None):
    """x ([T, C] when heads is None, else [T, H, C]) and the norm_rope keyword arguments of `mode`."""
    normalize, weighted, rope, inverse = MODES[mode]
    gen = torch.Generator().manual_seed(seed)
    shape = (num_tokens, channels) if heads is None else (num_tokens, heads, channels)
    x = (torch.randn(shape, generator=gen) * 3.0).to(dtype)
    weight = (1.0 + 0.2 * torch.randn(channels, generator=gen)).to(weight_dtype or dtype) if weighted else None
    kwargs = dict(normalize=normalize, inverse=inverse)
    if rope:
        kwargs["cos"], kwargs["sin"] = rope_tables(num_tokens, rope_dim // 2, dtype, seed)
    return x, weight, kwargs


def _close(actual, expected, tol):
    torch.testing.assert_close(actual.float(), expected.float(), **tol)


# --- kernel against the reference ----------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("heads,channels,rope_dim", [(None, 72, 16), (1, 72, 72), (3, 200, 64)])
@pytest.mark.parametrize("num_tokens", [1, 3, 37])
def test_matches_reference(num_tokens, heads, channels, rope_dim, mode):
    x, weight, kwargs = make_case(num_tokens, heads, channels, mode, rope_dim, seed=num_tokens + channels)
    expected = norm_rope_reference(x, weight, EPS, **kwargs)
    actual = norm_rope_triton(x, weight, EPS, **kwargs)
    assert actual.shape == x.shape and actual.dtype == x.dtype and actual.is_contiguous()
    _close(actual, expected, FP32)
    if kwargs["normalize"]:  # the test can fail: the output is normalised (and rotated) rows, not x
        assert not torch.allclose(actual, x, atol=1e-3)


@pytest.mark.parametrize("mode", ["weighted", "weighted+rope", "unweighted+rope", "inverse"])
def test_column_views(mode):
    """x = proj[:, 5:5 + C] of a wider projection, and a [T, H, C] view with strides (sT, sH, 1)."""
    x, weight, kwargs = make_case(37, None, 200, mode, 64, seed=1)
    wide = torch.randn(37, 300)
    view = wide[:, 5:205]
    view.copy_(x)
    assert view.stride() == (300, 1)
    _close(norm_rope_triton(view, weight, EPS, **kwargs), norm_rope_reference(x, weight, EPS, **kwargs), FP32)
    assert torch.equal(wide[:, 5:205], x)  # the input is left alone

    x3, weight3, kwargs3 = make_case(5, 3, 72, mode, 16, seed=2)
    wide3 = torch.randn(5, 4, 80)
    view3 = wide3[:, 1:4, 3:75]
    view3.copy_(x3)
    assert view3.stride() == (320, 80, 1)
    _close(norm_rope_triton(view3, weight3, EPS, **kwargs3), norm_rope_reference(x3, weight3, EPS, **kwargs3), FP32)


@pytest.mark.parametrize("num_tokens", [1, 3, 37])
@pytest.mark.parametrize("mode", ["weighted+rope", "unweighted"])
def test_store_into_paged_pool(num_tokens, mode):
    """kv_norm + rope of a column view written to out.view(-1, C)[out_index] of a [pages, page_size, C] pool at
    randomly permuted rows; every other row of the pool unchanged."""
    pages, page_size, channels = 6, 8, 72
    x, weight, kwargs = make_case(num_tokens, None, channels, mode, 16, seed=num_tokens)
    wide = torch.randn(num_tokens, channels + 13)
    view = wide[:, 5:5 + channels]
    view.copy_(x)
    gen = torch.Generator().manual_seed(num_tokens + 100)
    pool = torch.randn(pages, page_size, channels, generator=gen)
    before = pool.clone()
    index = torch.randperm(pages * page_size, generator=gen)[:num_tokens]
    expected = norm_rope_reference(x, weight, EPS, **kwargs, out=pool.clone(), out_index=index)
    result = norm_rope_triton(view, weight, EPS, **kwargs, out=pool, out_index=index)
    assert result is pool
    _close(pool, expected, FP32)
    flat, flat_before = pool.view(-1, channels), before.view(-1, channels)
    untouched = torch.ones(pages * page_size, dtype=torch.bool)
    untouched[index] = False
    assert torch.equal(flat[untouched], flat_before[untouched])
    assert not torch.allclose(flat[index], flat_before[index])
    _close(flat[index], norm_rope_reference(x, weight, EPS, **kwargs), FP32)


def test_out_without_index_and_int32_index():
    """out of x's shape without out_index (rows t * H + h), and an int32 out_index."""
    x, _, kwargs = make_case(7, 3, 72, "unweighted+rope", 16, seed=4)
    out = torch.full_like(x, float("nan"))
    assert norm_rope_triton(x, None, EPS, **kwargs, out=out) is out
    _close(out, norm_rope_reference(x, None, EPS, **kwargs), FP32)

    x, weight, kwargs = make_case(7, None, 72, "weighted+rope", 16, seed=5)
    pool = torch.zeros(3, 4, 72)
    index = torch.tensor([11, 0, 5, 3, 8, 1, 7], dtype=torch.int32)
    norm_rope_triton(x, weight, EPS, **kwargs, out=pool, out_index=index)
    _close(pool.view(-1, 72)[index.long()], norm_rope_reference(x, weight, EPS, **kwargs), FP32)


@pytest.mark.parametrize("mode", ["weighted+rope", "unweighted+rope", "inverse"])
def test_chunked_rows_and_head_blocks(mode):
    """Tiles smaller than the row (4 chunks of 64 channels, the rope section across a chunk boundary) and 2-head
    blocks over 3 heads (a masked head in the last block): the wide-row loop of C > 4096 at test sizes."""
    x, weight, kwargs = make_case(5, 3, 200, mode, 64, seed=6)
    expected = norm_rope_reference(x, weight, EPS, **kwargs)
    for config in (dict(BLOCK_H=1, BLOCK_C=64, num_warps=1), dict(BLOCK_H=2, BLOCK_C=64, num_warps=1),
                   dict(BLOCK_H=2, BLOCK_C=256, num_warps=2)):
        _close(norm_rope_triton(x, weight, EPS, **kwargs, config=config), expected, FP32)


def test_inverse_undoes_rope():
    """Rotations by angles: the inverse rope (by -sin) of the rope is the identity, up to cos^2 + sin^2 = 1."""
    x, _, _ = make_case(37, 3, 72, "rope", seed=7)
    cos, sin = rope_tables(37, 8, scaling=1.0, seed=7)
    rotated = norm_rope_triton(x, None, EPS, normalize=False, cos=cos, sin=sin)
    assert not torch.allclose(rotated[..., -16:], x[..., -16:], atol=1e-2)
    assert torch.equal(rotated[..., :-16], x[..., :-16])  # the nope channels pass through untouched
    back = norm_rope_triton(rotated, None, EPS, normalize=False, cos=cos, sin=sin, inverse=True)
    torch.testing.assert_close(back, x, atol=1e-5, rtol=1e-5)


# --- bf16 ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode,heads,weight_dtype", [
    ("weighted", None, torch.float32), ("weighted+rope", None, torch.bfloat16), ("weighted+rope", None, torch.float32),
    ("unweighted+rope", 3, None), ("unweighted", 3, None), ("inverse", 3, None), ("rope", 3, None)])
def test_bf16_against_fp32_reference(mode, heads, weight_dtype):
    x, weight, kwargs = make_case(37, heads, 200, mode, 64, torch.bfloat16, seed=8, weight_dtype=weight_dtype)
    actual = norm_rope_triton(x, weight, EPS, **kwargs)
    assert actual.dtype == torch.bfloat16
    float_kwargs = {k: v.float() if torch.is_tensor(v) else v for k, v in kwargs.items()}
    expected = norm_rope_reference(x.float(), weight.float() if weight is not None else None, EPS, **float_kwargs)
    _close(actual, expected, BF16_VS_FP32)
    _close(actual, norm_rope_reference(x, weight, EPS, **kwargs), BF16_VS_BF16)


@pytest.mark.parametrize("mode", ["weighted", "unweighted", "weighted+rope", "unweighted+rope", "inverse"])
def test_fp16_roundings_match_the_reference(mode):
    """The reference's casts, checked bit for bit where the interpreter rounds as torch does (fp32 -> fp16 rounds to
    nearest; its fp32 -> bf16 truncates): the unweighted factor rounded to x's dtype before the product, y rounded
    before the rotation. Only an ulp-level fp32 difference (the sum of squares' order) that straddles a rounding
    boundary may differ, by one fp16 ulp (2^-10 relative); skipping the factor's rounding alone changes ~25%."""
    x, weight, kwargs = make_case(37, 3, 200, mode, 64, torch.float16, seed=10, weight_dtype=torch.float32)
    actual, expected = norm_rope_triton(x, weight, EPS, **kwargs), norm_rope_reference(x, weight, EPS, **kwargs)
    assert actual.dtype == torch.float16
    assert (actual == expected).float().mean().item() >= 0.999
    torch.testing.assert_close(actual, expected, atol=1e-3, rtol=1e-3)


def test_bf16_store_into_pool():
    x, weight, kwargs = make_case(9, None, 72, "weighted+rope", 16, torch.bfloat16, seed=9, weight_dtype=torch.float32)
    pool = torch.randn(4, 8, 72).to(torch.bfloat16)
    before = pool.clone()
    index = torch.randperm(32, generator=torch.Generator().manual_seed(9))[:9]
    norm_rope_triton(x, weight, EPS, **kwargs, out=pool, out_index=index)
    float_kwargs = {k: v.float() if torch.is_tensor(v) else v for k, v in kwargs.items()}
    _close(pool.view(-1, 72)[index], norm_rope_reference(x.float(), weight, EPS, **float_kwargs), BF16_VS_FP32)
    untouched = torch.ones(32, dtype=torch.bool)
    untouched[index] = False
    assert torch.equal(pool.view(-1, 72)[untouched], before.view(-1, 72)[untouched])


# --- plans ---------------------------------------------------------------------------------------------------------
def test_plan_on_meta_tensors_launches_nothing():
    """V4-Flash shapes on meta tensors: one launch each, grid from shapes alone, the same tiles at every T."""
    meta = dict(device="meta", dtype=torch.bfloat16)
    for t in (1, 4096):
        cos, sin = torch.empty(t, 32, **meta), torch.empty(t, 32, **meta)
        q, launches = plan_norm_rope(torch.empty(t, 64, 512, **meta), None, EPS, cos=cos, sin=sin)
        assert q.shape == (t, 64, 512) and q.device.type == "meta" and len(launches) == 1
        kernel, grid, args, kwargs = launches[0]
        assert grid == (t, 64 // kwargs["BLOCK_H"]) and kwargs["ROPE_DIM"] == 64 and kwargs["H"] == 64
        pool = torch.empty(4096, 64, 512, **meta)
        proj = torch.empty(t, 2048, **meta)
        result, launches = plan_norm_rope(proj[:, 1024:1536], torch.empty(512, device="meta"), EPS, cos=cos,
                                          sin=sin, out=pool, out_index=torch.empty(t, dtype=torch.int64,
                                                                                   device="meta"))
        assert result is pool and len(launches) == 1 and launches[0][1] == (t, 1)
        assert launches[0][3]["HAS_INDEX"] and launches[0][2][7] == 2048  # x's row stride: the projection's
    _, launches = plan_norm_rope(torch.empty(1, 7168, **meta), torch.empty(7168, **meta), EPS)
    assert launches[0][3]["NUM_CHUNKS"] == 2 and launches[0][3]["BLOCK_C"] == 4096


def test_no_tokens():
    x, weight, kwargs = make_case(0, None, 72, "weighted+rope")
    assert plan_norm_rope(x, weight, EPS, **kwargs)[1] == []
    assert norm_rope_triton(x, weight, EPS, **kwargs).shape == (0, 72)


def test_bad_inputs_are_refused():
    x, _, kwargs = make_case(3, 2, 72, "unweighted+rope")
    with pytest.raises(AssertionError, match="out_index"):
        norm_rope_triton(x, None, EPS, **kwargs, out=torch.empty(4, 72), out_index=torch.arange(3))
    with pytest.raises(AssertionError, match="cos"):
        norm_rope_triton(x, None, EPS, cos=kwargs["cos"][:2], sin=kwargs["sin"][:2])
    with pytest.raises(AssertionError, match="contiguous"):
        norm_rope_triton(x.transpose(1, 2), None, EPS)
    with pytest.raises(AssertionError, match="weight"):
        norm_rope_triton(x, torch.ones(71), EPS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_indexer_queries_rounded_in_the_same_launch(dtype):
    """The indexer's query rope with DeepSeek's rounding (rotation, FP4 per 32) in one launch: the rope kernel's
    values, then round_indexer's, bit for bit; against the reference on fp32."""
    from kernels.act_rounding import round_indexer_triton

    gen = torch.Generator().manual_seed(3)
    tokens, heads, channels, rope_dim = 5, 64, 128, 64
    q = (torch.randn(tokens, heads, channels, generator=gen) * 3).to(dtype)
    angles = torch.arange(tokens)[:, None].float() * torch.linspace(0.1, 1.0, rope_dim // 2)[None, :]
    rope = dict(normalize=False, cos=angles.cos().to(dtype), sin=angles.sin().to(dtype))
    fused = norm_rope_triton(q, None, 1e-6, **rope, round_indexer=True)
    apart = round_indexer_triton(norm_rope_triton(q, None, 1e-6, **rope))
    assert fused.dtype == dtype and torch.equal(fused.float().view(torch.int32), apart.float().view(torch.int32))
    if dtype == torch.float32:
        expected = norm_rope_reference(q, None, 1e-6, **rope, round_indexer=True)
        assert torch.equal(fused, expected)
    assert not torch.equal(fused, norm_rope_triton(q, None, 1e-6, **rope))  # it rounds
