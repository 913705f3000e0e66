"""Token-wise building blocks of DeepSeek-V4: norms, rotary embeddings, mHC, the shared expert.

Legend: T = tokens in the batch, N = hc_mult streams, D = hidden size, H = heads, E = experts.
Each function computes what the matching `transformers` DeepSeek-V4 module computes, in the same
dtypes (norm weights and mHC parameters stay fp32, as the reference keeps them).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from backend.model.config import ModelConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


# --- rotary embeddings --------------------------------------------------------------------------
def _yarn_inv_freq(params: dict, dim: int, base: float, max_positions: int) -> tuple[torch.Tensor, float]:
    """YaRN frequencies and attention factor, as transformers' `_compute_yarn_parameters`."""
    factor = params.get("factor") or max_positions / params["original_max_position_embeddings"]
    original = params["original_max_position_embeddings"]
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        def mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = max(math.floor(correction_dim(beta_fast)), 0), min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1.0 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


class Rotary:
    """Interleaved partial RoPE on the trailing `rope_dim` channels; one per rope label (main, compress)."""

    def __init__(self, config: ModelConfig, label: str, device):
        params = config.rope_parameters[label]
        dim = int(config.head_dim * params.get("partial_rotary_factor", 1.0))
        base = params["rope_theta"]
        if params.get("rope_type", "default") == "yarn":
            inv_freq, self.scaling = _yarn_inv_freq(params, dim, base, config.max_position_embeddings)
        else:
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
            self.scaling = 1.0
        self.inv_freq = inv_freq.to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq  # [T, rope_dim / 2]
        return (freqs.cos() * self.scaling).to(dtype), (freqs.sin() * self.scaling).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing 2 * cos.shape[-1] channels of x [T, ..., Dh] pairwise (interleaved)."""
    cos = cos.repeat_interleave(2, dim=-1)
    sin = sin.repeat_interleave(2, dim=-1)
    for _ in range(x.dim() - 2):  # broadcast over head axes
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rope_dim = cos.shape[-1]
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:]
    rotated_half = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    rotated = (rope.float() * cos + rotated_half.float() * sin).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)


# --- manifold-constrained hyper-connections ---------------------------------------------------
def hyper_connection(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                     config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, N, D] -> post [T, N], comb [T, N, N] (Sinkhorn-projected), collapsed input [T, D]."""
    n = config.hc_mult
    flat = unweighted_rms_norm(streams.flatten(1).float(), config.rms_norm_eps)
    mixes = F.linear(flat, fn.float())
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre_s, post_s, comb_s = scale.unbind(0)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + config.hc_eps
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    comb = torch.softmax(comb_w.view(-1, n, n) * comb_s + comb_b.view(n, n), dim=-1) + config.hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + config.hc_eps)
    for _ in range(config.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + config.hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + config.hc_eps)
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    return post, comb, collapsed


def hyper_mix(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """new[k] = post[k] * block_out + sum_j comb[j, k] * streams[j]."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


def hyper_head(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
               config: ModelConfig) -> torch.Tensor:
    """Final collapse of the N streams [T, N, D] -> [T, D]."""
    flat = unweighted_rms_norm(streams.flatten(1).float(), config.rms_norm_eps)
    pre = torch.sigmoid(F.linear(flat, fn.float()) * scale.float() + base.float()) + config.hc_eps
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


# --- the shared expert ------------------------------------------------------------------------
def shared_expert(x: torch.Tensor, gate, up, down, limit: float, linear=F.linear):
    """Clamped SwiGLU; `linear` multiplies by a weight (F.linear, or the engine's FP8-aware one)."""
    g = linear(x, gate).clamp(max=limit)
    u = linear(x, up).clamp(min=-limit, max=limit)
    return linear(F.silu(g) * u, down)
