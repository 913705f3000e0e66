"""The fused mHC kernels (kernels/mhc.py) against their references on CPU under the interpreter (the references
are the model's math: the engine tests compare the model built on them with transformers)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.mhc import (hc_collapse_reference, hc_collapse_triton, hc_head_reference, hc_head_triton,
                         hc_mix_reference, hc_mix_triton)

N, EPS, HC_EPS = 4, 1e-6, 1e-6
# fp32: the kernel applies the RMSNorm factor after the product and sums in another order (ulp-level), which
# 20 Sinkhorn iterations on a 4 x 4 matrix do not amplify. bf16: outputs in bf16 are compared against the fp32
# reference on the same (bf16-valued) inputs: a bf16 rounding is 2^-8 relative, the interpreter's fp32->bf16 cast
# truncates (2^-7), and the mix rounds twice before the final sum (hyper_mix's bf16 product and matmul); post and
# comb stay fp32 and only see the fp32 reduction-order differences.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def make_inputs(num_tokens, hidden, dtype=torch.float32, seed=0, head=False):
    gen = torch.Generator().manual_seed(seed)
    mixes = N if head else 2 * N + N * N
    streams = torch.randn(num_tokens, N, hidden, generator=gen).to(dtype)
    fn = torch.randn(mixes, N * hidden, generator=gen) * 0.1  # as scripts/make_checkpoint.py draws them
    base = torch.randn(mixes, generator=gen) * 0.5
    scale = 1.0 + torch.randn(1 if head else 3, generator=gen) * 0.1
    weight = 1.0 + torch.randn(hidden, generator=gen) * 0.1
    return streams, fn, base, scale, weight


def collapse_kwargs(iters=20):
    return dict(hc_mult=N, eps=EPS, hc_eps=HC_EPS, sinkhorn_iters=iters)


def _close(actual, expected, dtype):
    torch.testing.assert_close(actual.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


# --- kernels against the references ---------------------------------------------------------------------------
@pytest.mark.parametrize("num_tokens,hidden", [(1, 64), (3, 96), (37, 200), (37, 64)])
def test_collapse_matches_reference(num_tokens, hidden):
    streams, fn, base, scale, weight = make_inputs(num_tokens, hidden, seed=num_tokens + hidden)
    expected = hc_collapse_reference(streams, fn, base, scale, weight, **collapse_kwargs())
    actual = hc_collapse_triton(streams, fn, base, scale, weight, **collapse_kwargs())
    for a, e in zip(actual, expected):
        assert a.dtype == e.dtype and a.shape == e.shape
        _close(a, e, torch.float32)


@pytest.mark.parametrize("iters", [1, 2, 20])
def test_collapse_sinkhorn_iterations_and_no_norm(iters):
    streams, fn, base, scale, _ = make_inputs(19, 96, seed=iters)
    expected = hc_collapse_reference(streams, fn, base, scale, None, **collapse_kwargs(iters))
    actual = hc_collapse_triton(streams, fn, base, scale, None, **collapse_kwargs(iters))
    for a, e in zip(actual, expected):
        _close(a, e, torch.float32)
    if iters == 20:  # near doubly stochastic by then (columns exactly, rows to within Sinkhorn's convergence)
        torch.testing.assert_close(actual[1].sum(-2), torch.ones(19, N), atol=1e-4, rtol=0)
        torch.testing.assert_close(actual[1].sum(-1), torch.ones(19, N), atol=2e-2, rtol=0)


def test_collapse_bf16_against_fp32_reference():
    streams, fn, base, scale, weight = make_inputs(37, 200, torch.bfloat16, seed=3)
    expected = hc_collapse_reference(streams.float(), fn, base, scale, weight, **collapse_kwargs())
    post, comb, x = hc_collapse_triton(streams, fn, base, scale, weight, **collapse_kwargs())
    assert post.dtype == comb.dtype == torch.float32 and x.dtype == torch.bfloat16
    for a, e in zip((post, comb, x), expected):
        _close(a, e, torch.bfloat16)


def test_collapse_strided_streams_and_tiles():
    """A token-strided view of the streams, and a BLOCK_T of 16 / BLOCK_D of 32 over 3 token blocks."""
    streams, fn, base, scale, weight = make_inputs(40, 72, seed=5)
    view = torch.randn(40, N + 2, 72)[:, 1:N + 1]
    view.copy_(streams)
    expected = hc_collapse_reference(streams, fn, base, scale, weight, **collapse_kwargs())
    actual = hc_collapse_triton(view, fn, base, scale, weight, **collapse_kwargs(),
                                config=dict(BLOCK_T=16, BLOCK_D=32, num_warps=4, num_stages=2))
    for a, e in zip(actual, expected):
        _close(a, e, torch.float32)


@pytest.mark.parametrize("num_tokens,hidden", [(1, 64), (37, 200)])
@pytest.mark.parametrize("with_norm", [False, True])
def test_head_matches_reference(num_tokens, hidden, with_norm):
    streams, fn, base, scale, weight = make_inputs(num_tokens, hidden, seed=11, head=True)
    weight = weight if with_norm else None
    expected = hc_head_reference(streams, fn, base, scale, eps=EPS, hc_eps=HC_EPS, norm_weight=weight)
    actual = hc_head_triton(streams, fn, base, scale, eps=EPS, hc_eps=HC_EPS, norm_weight=weight)
    _close(actual, expected, torch.float32)


def test_head_bf16_against_fp32_reference():
    streams, fn, base, scale, _ = make_inputs(3, 96, torch.bfloat16, seed=12, head=True)
    expected = hc_head_reference(streams.float(), fn, base, scale, eps=EPS, hc_eps=HC_EPS)
    actual = hc_head_triton(streams, fn, base, scale, eps=EPS, hc_eps=HC_EPS)
    assert actual.dtype == torch.bfloat16
    _close(actual, expected, torch.bfloat16)


def _mix_inputs(num_tokens, hidden, dtype, seed):
    streams, fn, base, scale, _ = make_inputs(num_tokens, hidden, dtype, seed=seed)
    post, comb, _ = hc_collapse_reference(streams.float(), fn, base, scale, None, **collapse_kwargs())
    gen = torch.Generator().manual_seed(seed + 1)
    return streams, torch.randn(num_tokens, hidden, generator=gen), torch.randn(num_tokens, hidden, generator=gen), \
        post, comb


@pytest.mark.parametrize("num_tokens,hidden", [(1, 64), (3, 96), (37, 200)])
@pytest.mark.parametrize("second", [False, True])
def test_mix_matches_reference(num_tokens, hidden, second):
    streams, y, y2, post, comb = _mix_inputs(num_tokens, hidden, torch.float32, seed=num_tokens)
    y2 = y2 if second else None
    expected = hc_mix_reference(streams, y, post, comb, y2)
    actual = hc_mix_triton(streams, y, post, comb, y2)
    _close(actual, expected, torch.float32)


def test_mix_bf16_fp32_block_out_and_in_place():
    """bf16 streams, the MoE's fp32 routed output plus a bf16 shared-expert output, written into streams."""
    streams, y, y2, post, comb = _mix_inputs(37, 200, torch.bfloat16, seed=4)
    y2 = y2.to(torch.bfloat16)
    expected = hc_mix_reference(streams.float(), y, post, comb, y2.float())
    actual = hc_mix_triton(streams, y, post, comb, y2, out=streams)
    assert actual.dtype == torch.bfloat16 and actual.data_ptr() == streams.data_ptr()
    _close(actual, expected, torch.bfloat16)


def test_deepseeks_fp32_mix_rounds_once():
    """fp32_mix (DeepSeek's hc_post): in bf16 the kernel's result is the fp32 mix rounded once (the reference's, up
    to a rounding flip in the last bf16 place where the fp32 sums differ in order), closer to the fp32 mix than
    transformers' mix with its bf16 post, comb and terms."""
    streams, y, _, post, comb = _mix_inputs(37, 200, torch.bfloat16, seed=6)
    y = y.to(torch.bfloat16)
    exact = hc_mix_reference(streams.float(), y.float(), post, comb)  # fp32 throughout
    expected = hc_mix_reference(streams, y, post, comb, fp32_mix=True)
    actual = hc_mix_triton(streams, y, post, comb, fp32_mix=True)
    ulp = exact.abs().clamp(min=2.0 ** -126) * 2.0 ** -7
    assert ((actual.float() - expected.float()).abs() <= ulp).all()
    assert ((expected.float() - exact).abs() <= ulp / 2 * 1.001).all()  # one rounding: within half a bf16 ulp
    transformers = hc_mix_reference(streams, y, post, comb)
    assert (transformers.float() - exact).abs().mean() > 1.5 * (expected.float() - exact).abs().mean()


def test_no_tokens():
    streams, fn, base, scale, weight = make_inputs(0, 64)
    post, comb, x = hc_collapse_triton(streams, fn, base, scale, weight, **collapse_kwargs())
    assert post.shape == (0, N) and comb.shape == (0, N, N) and x.shape == (0, 64)
    assert hc_mix_triton(streams, x, post, comb).shape == (0, N, 64)
    head = make_inputs(0, 64, head=True)
    assert hc_head_triton(*head[:4], eps=EPS, hc_eps=HC_EPS).shape == (0, 64)


@settings(max_examples=5, deadline=None, derandomize=True)
@given(num_tokens=st.integers(1, 20), hidden=st.sampled_from([16, 48, 80, 136]), iters=st.integers(1, 20),
       seed=st.integers(0, 100))
def test_random_shapes(num_tokens, hidden, iters, seed):
    """Collapse then mix, as a layer runs them, against the references."""
    streams, fn, base, scale, weight = make_inputs(num_tokens, hidden, seed=seed)
    post, comb, x = hc_collapse_triton(streams, fn, base, scale, weight, **collapse_kwargs(iters))
    e_post, e_comb, e_x = hc_collapse_reference(streams, fn, base, scale, weight, **collapse_kwargs(iters))
    for a, e in ((post, e_post), (comb, e_comb), (x, e_x)):
        _close(a, e, torch.float32)
    block_out = torch.randn(num_tokens, hidden)
    _close(hc_mix_triton(streams, block_out, post, comb), hc_mix_reference(streams, block_out, e_post, e_comb),
           torch.float32)


@pytest.mark.parametrize("splits,head", [(2, False), (3, False), (8, False), (3, True)])
def test_split_inputs(splits, head):
    """The decode path: each token block's N * D inputs split over programs (3 splits of 8 steps: uneven), the
    last to finish reducing the partials; twice, as the counters must be left at zero for the next launch."""
    streams, fn, base, scale, weight = make_inputs(21, 200, seed=splits, head=head)
    cfg = dict(BLOCK_T=16, BLOCK_D=64 if splits == 8 else 128, SPLITS=splits, num_warps=4, num_stages=2)
    for _ in range(2):
        if head:
            expected = (hc_head_reference(streams, fn, base, scale, eps=EPS, hc_eps=HC_EPS, norm_weight=weight),)
            actual = (hc_head_triton(streams, fn, base, scale, eps=EPS, hc_eps=HC_EPS, norm_weight=weight,
                                     config=cfg),)
        else:
            expected = hc_collapse_reference(streams, fn, base, scale, weight, **collapse_kwargs())
            actual = hc_collapse_triton(streams, fn, base, scale, weight, **collapse_kwargs(), config=cfg)
        for a, e in zip(actual, expected):
            _close(a, e, torch.float32)
        streams = streams.flip(0).contiguous()


def test_default_config_splits_at_decode():
    from kernels.mhc import collapse_config

    assert collapse_config(1, 4096, 4)["SPLITS"] == 128  # 128 steps of 128 columns, one per program
    assert collapse_config(256, 4096, 4)["SPLITS"] == 16  # 16 blocks x 16 splits
    assert collapse_config(4096, 4096, 4)["SPLITS"] == 1
    assert collapse_config(1, 64, 4)["SPLITS"] == 4


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype,second,fp32_mix", [(torch.float32, False, False), (torch.bfloat16, True, False),
                                                   (torch.bfloat16, True, True)])
def test_the_mix_fused_into_the_next_collapse(splits, dtype, second, fp32_mix):
    """A decode step's mix after a block and the collapse before the next, in one launch: the new streams, post, comb
    and x of the mix kernel followed by the collapse kernel, bit for bit (the mixed tiles are the mix kernel's
    values, and the collapse reads them back); split over programs and not, twice (the split counters)."""
    from kernels.mhc import hc_mix_collapse_reference, hc_mix_collapse_triton, plan_hc_mix_collapse

    streams, fn, base, scale, weight = make_inputs(21, 200, dtype=dtype, seed=splits)
    _, y, y2, post, comb = _mix_inputs(21, 200, dtype, seed=splits + 1)
    y2 = y2.to(dtype) if second else None
    cfg = dict(BLOCK_T=16, BLOCK_D=128, SPLITS=splits, num_warps=4, num_stages=2)
    kwargs = dict(**collapse_kwargs(), fp32_mix=fp32_mix, config=cfg)
    assert len(plan_hc_mix_collapse(streams, y, post, comb, y2, fn, base, scale, weight, **kwargs)[1]) == 1
    for _ in range(2):
        fused = hc_mix_collapse_triton(streams, y, post, comb, y2, fn, base, scale, weight, **kwargs)
        new = hc_mix_triton(streams, y, post, comb, y2, fp32_mix=fp32_mix)
        apart = (new, *hc_collapse_triton(new, fn, base, scale, weight, **collapse_kwargs(), config=cfg))
        for a, b in zip(fused, apart):
            assert a.dtype == b.dtype and torch.equal(a, b)
        if dtype == torch.float32:
            for a, e in zip(fused, hc_mix_collapse_reference(streams, y, post, comb, y2, fn, base, scale, weight,
                                                             **collapse_kwargs(), fp32_mix=fp32_mix)):
                _close(a, e, dtype)
        streams = streams.flip(0).contiguous()


def test_a_prefill_chunk_mixes_apart():
    """Beyond FUSED_MIX_MAX_TOKENS the mix is its own launch (the fused pass would read the old streams N times)."""
    from kernels.mhc import FUSED_MIX_MAX_TOKENS, hc_mix_collapse_triton, plan_hc_mix_collapse

    tokens = FUSED_MIX_MAX_TOKENS + 1
    streams, fn, base, scale, weight = make_inputs(tokens, 64)
    _, y, _, post, comb = _mix_inputs(tokens, 64, torch.float32, seed=2)
    assert len(plan_hc_mix_collapse(streams, y, post, comb, None, fn, base, scale, weight, **collapse_kwargs())[1]) == 2
    new, *collapsed = hc_mix_collapse_triton(streams, y, post, comb, None, fn, base, scale, weight, **collapse_kwargs())
    assert torch.equal(new, hc_mix_triton(streams, y, post, comb))
    for a, b in zip(collapsed, hc_collapse_triton(new, fn, base, scale, weight, **collapse_kwargs())):
        assert torch.equal(a, b)


@pytest.mark.parametrize("tokens,splits", [(21, 1), (21, 3), (300, 1)])  # decode (fused mix), split; a prefill chunk
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_collapse_writes_x_act_quantized_too(tokens, splits, dtype):
    """quantize_x: the collapse before the MoE writes x as the routed experts read it under DeepSeek's numerics, e4m3
    per 128 columns with its scales, the act_quant launch's bytes of its own x (a partial last group at D = 200),
    and everything else unchanged."""
    from kernels.fp8_gemm import quantize_activations_reference
    from kernels.mhc import hc_mix_collapse_reference, hc_mix_collapse_triton

    streams, fn, base, scale, weight = make_inputs(tokens, 200, dtype=dtype, seed=tokens + splits)
    _, y, _, post, comb = _mix_inputs(tokens, 200, dtype, seed=splits)
    cfg = dict(BLOCK_T=16, BLOCK_D=128, SPLITS=splits, num_warps=4, num_stages=2)
    kwargs = dict(**collapse_kwargs(), config=cfg)
    *outputs, (x_q, x_s) = hc_mix_collapse_triton(streams, y, post, comb, None, fn, base, scale, weight, **kwargs,
                                                  quantize_x=True)
    for a, b in zip(outputs, hc_mix_collapse_triton(streams, y, post, comb, None, fn, base, scale, weight, **kwargs)):
        assert torch.equal(a, b)
    expected_q, expected_s = quantize_activations_reference(outputs[-1])
    assert x_q.dtype == torch.float8_e4m3fn and torch.equal(x_q.float(), expected_q.float())
    assert torch.equal(x_s, expected_s)
    *_, (ref_q, ref_s) = hc_mix_collapse_reference(streams, y, post, comb, None, fn, base, scale, weight,
                                                   **collapse_kwargs(), quantize_x=True)
    assert ref_q.shape == x_q.shape and ref_s.shape == x_s.shape
