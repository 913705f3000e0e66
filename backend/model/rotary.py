"""DeepSeek-V4's rotary embeddings (YaRN included): the cos / sin tables the norm_rope kernels apply.

The tables are what transformers' DeepSeek-V4 rotary embedding computes; the norms, mHC and the
shared expert's activation live in kernels/ (norm_rope.py, mhc.py, moe.py) beside their Triton kernels.
"""

from __future__ import annotations

import math

import torch

from backend.model.config import ModelConfig


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
        """(cos, sin) [T, rope_dim / 2] in dtype at `positions` [T]."""
        return cos_sin_tables([(self, positions)], dtype)[0]


def cos_sin_tables(requests: list[tuple[Rotary, torch.Tensor]],
                   dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (cos, sin) tables of each (rotary, positions) pair, computed together: the positions concatenated, each row
    times its rotary's frequencies, one cos and one sin (times each rotary's attention scaling, where one is not 1),
    and each pair's tables row slices of the results. Each value is what the pair's own product, cos, sin and
    scaling give, in a handful of launches for a step's four tables (a decode step's main and compress ropes, and
    the compress rope at each closing entry) rather than five a table."""
    sizes = [positions.shape[0] for _, positions in requests]
    if len(requests) == 1:
        (rotary, positions), = requests
        inv_freq = rotary.inv_freq  # (broadcast over the rows)
    else:
        positions = torch.cat([p for _, p in requests])
        inv_freq = torch.cat([r.inv_freq.expand(n, -1) for (r, _), n in zip(requests, sizes)])
    freqs = positions[:, None].float() * inv_freq  # [sum T, rope_dim / 2]
    cos, sin = freqs.cos(), freqs.sin()
    if any(r.scaling != 1.0 for r, _ in requests):  # (x * 1.0 is x: no launch for a scaling of 1)
        scaling = torch.cat([freqs.new_full((n, 1), r.scaling) for (r, _), n in zip(requests, sizes)])
        cos, sin = cos * scaling, sin * scaling
    return list(zip(cos.to(dtype).split(sizes), sin.to(dtype).split(sizes)))
