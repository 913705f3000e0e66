"""Checkpoint weights: every published DeepSeek-V4 layout and format, read into the engine's tensors.

`load_weights` reads a checkpoint directory (one safetensors file, or shards listed by
model.safetensors.index.json) in any of the three layouts of backend/model/weight_names.py,
detected from its tensor names. It streams shard by shard: each tensor goes from the memory-mapped
file to its engine tensor (on the target device and dtype) before the next is read, so host memory
peaks at about the model plus one tensor, never two copies of the model. FP8 and MXFP4 weights
(backend/model/quantization.py) are dequantized on the way — exactly, into the engine dtype. The
`mtp.*` draft layer is read only when speculative decoding serves it (`draft_layers`), else skipped.
Every tensor is checked against the shape the config implies: a missing, unexpected, misshaped or
mistyped tensor raises `CheckpointError` naming the file, the tensor, and what was expected and found.

With weight_format="fp8" quantized weights stay as published instead: the FP8 linears as
`kernels.fp8_gemm.Fp8Weight` (scales as float32) and the routed experts merged into
`kernels.moe.QuantizedExperts` (FP8 or packed MXFP4 with their scales); `o_a_proj`, which DeepSeek's own
inference dequantizes for a bf16 einsum, stays FP8 too (kernels/grouped_linear.py computes the same products).

With a `ParallelLayout` of several ranks (backend/model/parallel_layout.py) each rank loads only its part:
routed experts of other ranks are never read; a dense tensor split across ranks is read as a slice
(safetensors' get_slice); an FP8/MXFP4 tensor split across ranks is read whole (one tensor at a time)
and cut on its block grid: kept FP8 needs the cut on a 128-block boundary, MXFP4 columns on a
32-column one (a clear CheckpointError otherwise), dequantized weights are cut after dequantizing.
"""

from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from backend.errors import ConfigError
from backend.model.config import CSA, HCA, SLIDING, ModelConfig
from backend.model.parallel_layout import ParallelLayout, Shard
from backend.model.quantization import (FP8_BLOCK, MXFP4_BLOCK, ROUTED_EXPERTS, dequantize_fp8, dequantize_mxfp4,
                                        fp8_block_shape, kept_quantized, published_format, scale_to_float)
from backend.model.weight_names import Target, detect_layout, draft_layer_index, engine_target, layer_index
from kernels.fp8_gemm import Fp8Weight
from kernels.moe import QuantizedExperts

WEIGHT_FORMATS = ("dequantize", "fp8")

logger = logging.getLogger(__name__)

# Parameters the reference keeps in fp32 whatever the model dtype (its _keep_in_fp32_modules_strict).
_FP32_MARKERS = ("attn_hc.", "ffn_hc.", "hc_head.", "sinks", "position_bias", "e_score_correction_bias",
                 "q_a_norm.", "kv_norm.", "input_layernorm.", "post_attention_layernorm.", "model.norm.",
                 ".enorm.", ".hnorm.", ".norm.")  # (the last three: the MTP layers' norms)


class CheckpointError(ValueError):
    """A checkpoint file is missing, or a tensor is missing, misshaped or of an unsupported dtype."""


@contextmanager
def _open(path: Path):
    """A safetensors file, open; a truncated or foreign file raises CheckpointError naming it."""
    try:
        handle = safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from None
    with handle as f:
        yield f


def expected_shapes(c: ModelConfig, draft_layers: int = 0) -> dict[str, tuple[int, ...]]:
    """The engine's tensors and their shapes; with `draft_layers`, those of the first MTP layers too."""
    d, n = c.hidden_size, c.hc_mult
    shapes = {
        "model.embed_tokens.weight": (c.vocab_size, d),
        "lm_head.weight": (c.vocab_size, d),
        "model.norm.weight": (d,),
        "model.hc_head.hc_fn": (n, n * d),
        "model.hc_head.hc_base": (n,),
        "model.hc_head.hc_scale": (1,),
    }
    for i, layer_type in enumerate(c.layer_types):
        shapes.update(_block_shapes(c, f"model.layers.{i}.", layer_type, c.mlp_layer_types[i]))
    for j in range(draft_layers):
        shapes.update(draft_layer_shapes(c, j))
    return shapes


def draft_layer_shapes(c: ModelConfig, j: int) -> dict[str, tuple[int, ...]]:
    """MTP layer j (`mtp.j.*`; DeepSeek's MTPBlock): a sliding-window block with top-k routing, plus the projections
    of the next token's embedding (e_proj, after enorm) and of the main model's residual streams (h_proj, after
    hnorm, per stream), its own hyper-head and final norm; the embedding and the LM head are the main model's."""
    d, n, p = c.hidden_size, c.hc_mult, f"model.mtp.{j}."
    shapes = _block_shapes(c, p, SLIDING, "moe")
    shapes.update({p + "e_proj.weight": (d, d), p + "h_proj.weight": (d, d), p + "enorm.weight": (d,),
                   p + "hnorm.weight": (d,), p + "norm.weight": (d,), p + "hc_head.hc_fn": (n, n * d),
                   p + "hc_head.hc_base": (n,), p + "hc_head.hc_scale": (1,)})
    return shapes


def _block_shapes(c: ModelConfig, p: str, layer_type: str, mlp_type: str) -> dict[str, tuple[int, ...]]:
    """One decoder block's tensors under prefix `p`."""
    d, n, heads, dh, q = c.hidden_size, c.hc_mult, c.num_attention_heads, c.head_dim, c.q_lora_rank
    e, inter = c.n_routed_experts, c.moe_intermediate_size
    shapes = {
        p + "self_attn.sinks": (heads,),
        p + "self_attn.q_a_proj.weight": (q, d),
        p + "self_attn.q_a_norm.weight": (q,),
        p + "self_attn.q_b_proj.weight": (heads * dh, q),
        p + "self_attn.kv_proj.weight": (dh, d),
        p + "self_attn.kv_norm.weight": (dh,),
        p + "self_attn.o_a_proj.weight": (c.o_groups * c.o_lora_rank, heads * dh // c.o_groups),
        p + "self_attn.o_b_proj.weight": (d, c.o_groups * c.o_lora_rank),
        p + "mlp.gate.weight": (e, d),
        p + "mlp.experts.gate_up_proj": (e, 2 * inter, d),
        p + "mlp.experts.down_proj": (e, d, inter),
        p + "mlp.shared_experts.gate_proj.weight": (inter, d),
        p + "mlp.shared_experts.up_proj.weight": (inter, d),
        p + "mlp.shared_experts.down_proj.weight": (d, inter),
        p + "input_layernorm.weight": (d,),
        p + "post_attention_layernorm.weight": (d,),
    }
    for hc in ("attn_hc", "ffn_hc"):
        shapes.update({p + f"{hc}.fn": ((2 + n) * n, n * d), p + f"{hc}.base": ((2 + n) * n,), p + f"{hc}.scale": (3,)})
    if mlp_type == "hash_moe":
        shapes[p + "mlp.gate.tid2eid"] = (c.vocab_size, c.num_experts_per_tok)
    else:
        shapes[p + "mlp.gate.e_score_correction_bias"] = (e,)
    cp = p + "self_attn.compressor."
    if layer_type == HCA:
        shapes.update({cp + "position_bias": (c.hca_rate, dh), cp + "kv_proj.weight": (dh, d),
                       cp + "gate_proj.weight": (dh, d), cp + "kv_norm.weight": (dh,)})
    elif layer_type == CSA:
        di, hi = c.index_head_dim, c.index_n_heads
        shapes.update({cp + "position_bias": (c.csa_rate, 2 * dh), cp + "kv_proj.weight": (2 * dh, d),
                       cp + "gate_proj.weight": (2 * dh, d), cp + "kv_norm.weight": (dh,)})
        ip = cp + "indexer."
        shapes.update({ip + "position_bias": (c.csa_rate, 2 * di), ip + "kv_proj.weight": (2 * di, d),
                       ip + "gate_proj.weight": (2 * di, d), ip + "kv_norm.weight": (di,),
                       ip + "q_b_proj.weight": (hi * di, q), ip + "scorer.weights_proj.weight": (hi, d)})
    return shapes


def _weight_files(checkpoint: Path) -> dict[str, Path]:
    """Tensor name -> file, from model.safetensors.index.json or by listing the safetensors files."""
    index = checkpoint / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
        except (ValueError, AttributeError) as exc:
            raise CheckpointError(f"{index}: not a JSON object ({exc})") from None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no weight_map object (tensor name -> file)")
        if odd := [name for name, fname in weight_map.items() if not isinstance(fname, str) or not fname]:
            raise CheckpointError(f"{index}: weight_map[{odd[0]!r}] is {weight_map[odd[0]]!r}, not a file name")
        return {name: checkpoint / fname for name, fname in weight_map.items()}
    files = sorted(checkpoint.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {checkpoint}")
    out: dict[str, Path] = {}
    for path in files:  # (without an index every file is read: two holding one tensor leave the choice to nobody)
        with _open(path) as f:
            for name in f.keys():
                if name in out:
                    raise CheckpointError(f"{checkpoint}: {out[name].name} and {path.name} both hold {name!r} (a "
                                          "file left from another version of the checkpoint?); without "
                                          "model.safetensors.index.json every *.safetensors file is read")
                out[name] = path
    return out


def tensor_names(checkpoint: str | Path) -> list[str]:
    """The tensors a checkpoint's files hold, from its index or the files' headers (no weight is read)."""
    return list(_weight_files(Path(checkpoint)))


def load_weights(checkpoint: str | Path, config: ModelConfig, dtype: torch.dtype, device,
                 weight_format: str = "dequantize", layout: ParallelLayout | None = None,
                 draft_layers: int = 0) -> dict[str, torch.Tensor]:
    """The engine's tensors (names of backend/model/checkpoint.expected_shapes) from `checkpoint`: this rank's
    parts of them under `layout` (backend/model/parallel_layout.py; None: one rank holds everything).
    `draft_layers`: how many of the checkpoint's MTP layers to load (speculative decoding); the others are
    skipped."""
    from tqdm import tqdm

    checkpoint, parallel = Path(checkpoint), layout
    files = _weight_files(checkpoint)
    try:
        layout = detect_layout(files)
    except ValueError as exc:
        raise CheckpointError(f"{checkpoint}: {exc}") from None
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format must be one of {WEIGHT_FORMATS}, got {weight_format!r}")
    cut = range(config.num_hidden_layers, _declared_layers(checkpoint, config))
    loader = _Loader(expected_shapes(config, draft_layers), layout, dtype, device, files,
                     keep_quantized=weight_format == "fp8", parallel=parallel or ParallelLayout(), cut_layers=cut)
    by_file: dict[Path, list[str]] = {}
    skipped: dict[str, int] = {}
    for name, path in files.items():  # every name checked before a weight is read: a wrong one fails at once
        reason = loader.skips(name)
        if reason is None:
            loader.check(name, path)
            by_file.setdefault(path, []).append(name)
        else:
            skipped[reason] = skipped.get(reason, 0) + 1
    paths = set(files.values())
    for path in paths:
        if not path.is_file():
            raise CheckpointError(f"{path}: file listed in the index does not exist")
    _check_headers(files, by_file, loader)
    total_bytes = sum(p.stat().st_size for p in paths)
    with tqdm(total=sum(map(len, by_file.values())), desc="loading weights", unit="tensor",
              disable=total_bytes < 2**30) as bar:
        for path, names in by_file.items():
            with _open(path) as f:
                for name in names:
                    try:
                        loader.take(name, f, path)
                    except torch.cuda.OutOfMemoryError:
                        raise weights_do_not_fit(f"the weights of {checkpoint}", device, name, loader.weights,
                                                 config) from None
                    bar.update()
    weights = loader.finish(checkpoint)
    if loader.num_quantized and config.quantization_config is None:
        logger.warning("%s: config.json has no quantization_config, yet %d tensors are FP8 or MXFP4: they were "
                       "dequantized, and the numerics and formats are those of an unquantized checkpoint (a "
                       "config.json from another copy of the model?)", checkpoint, loader.num_quantized)
    notes = {"draft": f"the {skipped.get('draft')} tensors of mtp.* draft layers not served",
             "cut": f"the {skipped.get('cut')} tensors of layers {cut.start}-{cut.stop - 1}, cut by hf_overrides"}
    logger.info("loaded %s (%s layout): %d tensors%s", checkpoint, layout, len(weights),
                "".join(f"; skipped {note}" for reason, note in notes.items() if skipped.get(reason)))
    return weights


def _check_headers(files: dict[str, Path], by_file: dict[Path, list[str]], loader: _Loader) -> None:
    """From the files' headers, before a weight is read: each file holds what the index places in it (block scales
    included), and a weight with block scales is a quantized one (scales beside weights a converter already
    multiplied out would be dropped unseen)."""
    scales = {name[: -len(".scale")] + ".weight": name for name in files if loader.skips(name) == "scale"}
    wanted: dict[Path, list[str]] = {}
    for path, names in by_file.items():
        for name in names:
            wanted.setdefault(path, []).append(name)
            if name in scales:
                wanted.setdefault(files[scales[name]], []).append(scales[name])
    for path, names in wanted.items():
        with _open(path) as f:
            held = set(f.keys())
            if missing := [name for name in names if name not in held]:
                raise CheckpointError(f"{path}: the index places {missing[0]!r} in this file, which does not hold it "
                                      f"({len(missing)} such tensor(s))")
            for name in names:
                if name in scales and _dtype_of(f, name) is None:
                    raise CheckpointError(
                        f"{path}: {name!r} is {f.get_slice(name).get_dtype()} beside block scales {scales[name]!r}: "
                        "a weight with scales is FP8 (e4m3) or MXFP4 (int8 or uint8 codes); dequantized weights "
                        "carry no scales")


def weight_bytes(weight) -> int:
    """The bytes of a weight: a tensor, or the tensors of a quantized one (a named tuple of them)."""
    if isinstance(weight, torch.Tensor):
        return weight.numel() * weight.element_size()
    return sum(weight_bytes(part) for part in weight if isinstance(part, torch.Tensor))


def weights_do_not_fit(what: str, device, name: str, weights: dict, config: ModelConfig) -> ConfigError:
    """What to say when a device runs out of memory at tensor `name` with `weights` built: what to change. (The
    weights built are freed here, not with the error's traceback, which keeps their frame.)"""
    built = sum(weight_bytes(w) for w in weights.values()) / 2**30
    weights.clear()
    return ConfigError(f"{what} do not fit {device}: out of memory at {name} after {built:.1f} GiB of tensors; fewer "
                       f"layers (hf_overrides num_hidden_layers, now {config.num_hidden_layers}; "
                       "scripts/plan_memory.py sizes them), smaller pools (num_tokens) or more devices")


def _declared_layers(checkpoint: Path, config: ModelConfig) -> int:
    """The layers the checkpoint's own config.json declares (hf_overrides may have lowered config's: the layers past
    it are then not read)."""
    try:
        declared = json.loads((checkpoint / "config.json").read_text(encoding="utf-8")).get("num_hidden_layers")
    except (OSError, ValueError):
        declared = None
    return declared if isinstance(declared, int) and declared > config.num_hidden_layers else config.num_hidden_layers


class _Loader:
    """Fills the engine's tensors from checkpoint tensors as they are read, one at a time."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], layout: str, dtype: torch.dtype, device,
                 files: dict[str, Path], keep_quantized: bool = False, parallel: ParallelLayout = ParallelLayout(),
                 cut_layers: range = range(0)):
        self.layout, self.dtype, self.device, self.files = layout, dtype, device, files
        self.full_shapes, self.shapes = shapes, parallel.local_shapes(shapes)  # whole tensors, this rank's parts
        self.parallel = parallel
        self.keep_quantized = keep_quantized
        self.cut_layers = cut_layers
        self.num_quantized = 0  # the quantized tensors read
        self.weights: dict[str, torch.Tensor] = {}
        self.expert_parts: dict[str, set[tuple[int, str | None]]] = {}  # merged tensor -> (expert, half) filled
        # engine tensor -> (expert, half) -> the checkpoint tensor that fills it ((None, None): all of it)
        self.sources: dict[str, dict[tuple[int | None, str | None], str]] = {}

    def skips(self, name: str) -> str | None:
        """Why a checkpoint tensor is not taken: "draft" (an MTP layer not served), "cut" (a layer past the config's
        layers, which hf_overrides lowered), "scale" (read with its weight); None: it is taken."""
        if draft_layer_index(name) is not None and engine_target(name, self.layout).name not in self.shapes:
            return "draft"
        if layer_index(name) in self.cut_layers:
            return "cut"
        if self._is_scale_of_a_weight(name):
            return "scale"
        return None

    def check(self, name: str, path: Path) -> None:
        """A tensor to take must fill one of the engine's."""
        target = engine_target(name, self.layout)
        if target.name not in self.shapes:
            weight = name[: -len(".scale")] + ".weight"
            if name.endswith(".scale") and engine_target(weight, self.layout).name in self.shapes:
                raise CheckpointError(f"{path}: block scales {name!r} without their weight {weight!r}")
            raise CheckpointError(f"{path}: unexpected tensor {name!r} (read as {target.name!r}, which this model "
                                  "config does not have)")
        filled = self.sources.setdefault(target.name, {})
        part = (target.expert, target.half)
        other = filled.get(part) or filled.get((None, None)) or (next(iter(filled.values()), None)
                                                                  if part == (None, None) else None)
        if other is not None:  # (two names, two layouts mixed: which one the load kept would be chance)
            raise CheckpointError(f"{path}: {name!r} and {other!r} both fill the engine's {target.name!r}"
                                  + (f" (expert {target.expert})" if target.expert is not None else ""))
        filled[part] = name

    def take(self, name: str, f, path: Path) -> None:
        """Reads a tensor `skips` does not skip and `check` passed into the engine's (this rank's part of it)."""
        target = engine_target(name, self.layout)
        if target.expert is not None:
            first, count = self.parallel.expert_range(self.full_shapes[target.name][0])
            if not first <= target.expert < first + count:
                return  # another rank's expert: never read
            target = Target(target.name, target.expert - first, target.half)
        full = self._source_shape(target, self.full_shapes)
        part = self._source_part(target, full)
        if not self._is_quantized(name, _dtype_of(f, name), full):
            found = tuple(f.get_slice(name).get_shape())
            if found != full:
                raise CheckpointError(f"{path}: tensor {name!r} has shape {found}, expected {full}")
            self._store(target, _convert(target.name, _read_part(f, name, part), self.dtype, self.device))
            return
        raw = f.get_tensor(name)  # quantized: read whole, cut on its block grid below
        self.num_quantized += 1
        scale = self._scale_of(name, raw, full, path)
        if self.keep_quantized and self._keeps(target, name, raw):
            self._keep(name, target, *_cut_quantized(name, raw, scale, part))
            return
        tensor = _cut(self._dequantize(raw, scale), part)
        self._store(target, _convert(target.name, tensor, self.dtype, self.device))

    def _source_part(self, target: Target, full: tuple[int, ...]) -> Shard | None:
        """This rank's part of the checkpoint tensor behind `target` (None: all of it)."""
        if target.expert is None:
            return self.parallel.shard(target.name, full)
        return expert_part(self.parallel, target.name, self.full_shapes[target.name])

    def finish(self, checkpoint: Path) -> dict[str, torch.Tensor]:
        experts = self.shapes  # merged expert tensors must have every expert's every part
        for merged, parts in self.expert_parts.items():
            count = experts[merged][0] * (2 if merged.endswith("gate_up_proj") else 1)
            if len(parts) != count:
                raise CheckpointError(f"{checkpoint}: {merged!r} got {len(parts)} of its {count} expert tensors")
        missing = [name for name in self.shapes if name not in self.weights]
        if missing:
            raise CheckpointError(f"{checkpoint}: missing tensor {missing[0]!r} ({len(missing)} missing in all)")
        for name in self.weights:
            if name.endswith(".tid2eid"):
                self._check_expert_ids(name, checkpoint)
        return self.weights

    def _check_expert_ids(self, name: str, checkpoint: Path) -> None:
        """A hash layer's token -> expert table names experts of the layer (an id past them would fail every step
        that routes its token, or read out of bounds on a GPU)."""
        table, experts = self.weights[name], self.full_shapes[name[: -len("tid2eid")] + "weight"][0]
        if table.numel() and not (0 <= int(table.min()) and int(table.max()) < experts):
            raise CheckpointError(f"{checkpoint}: {name!r} holds expert ids {int(table.min())}..{int(table.max())}; "
                                  f"the layer has experts 0..{experts - 1}")

    def _is_scale_of_a_weight(self, name: str) -> bool:
        return name.endswith(".scale") and name[: -len(".scale")] + ".weight" in self.files

    def _source_shape(self, target: Target, shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
        """The shape of the checkpoint tensor: the engine tensor's, or one expert's part of it (in `shapes`)."""
        shape = shapes[target.name]
        if target.expert is None:
            return shape
        rows = shape[1] // 2 if target.half is not None else shape[1]
        return rows, shape[2]

    def _is_quantized(self, name: str, dtype: torch.dtype, expected: tuple[int, ...]) -> bool:
        return dtype in (torch.float8_e4m3fn, torch.int8, torch.uint8) and len(expected) == 2 and (
            dtype == torch.float8_e4m3fn or name[: -len(".weight")] + ".scale" in self.files)

    def _keeps(self, target: Target, name: str, tensor: torch.Tensor) -> bool:
        """Whether weight_format=fp8 keeps this tensor quantized (FP8 linears, routed experts)."""
        return (self._is_quantized(name, tensor.dtype, self._source_shape(target, self.full_shapes))
                and kept_quantized(target.name))

    def _keep(self, name: str, target: Target, tensor: torch.Tensor, scale: torch.Tensor) -> None:
        if target.expert is None:
            self.weights[target.name] = Fp8Weight(tensor.to(self.device).contiguous(),
                                                  scale_to_float(scale).to(self.device).contiguous())
            return
        merged = self.weights.get(target.name)
        if merged is None:
            merged = self.weights[target.name] = empty_quantized_experts(self.shapes[target.name], tensor.dtype,
                                                               halves=1 if target.half is None else 2,
                                                               device=self.device)
        if (merged.format == "fp8") != (tensor.dtype == torch.float8_e4m3fn):  # (one format per merged tensor)
            raise CheckpointError(f"{self.files[name]}: {name!r} is {tensor.dtype}, while {target.name!r} holds "
                                  f"{merged.format} experts")
        rows, up = merged.rows_per_half, target.half == "up"
        merged.data[target.expert, rows * up:rows * up + rows] = tensor.to(self.device)
        scale_rows = scale.shape[0]
        if merged.format == "fp8":
            merged.scale[target.expert, scale_rows * up:scale_rows * up + scale_rows] = scale_to_float(scale)
        else:
            merged.scale[target.expert, rows * up:rows * up + rows] = scale.view(torch.uint8)
        self.expert_parts.setdefault(target.name, set()).add((target.expert, target.half))

    def _scale_of(self, name: str, tensor: torch.Tensor, expected: tuple[int, ...], path: Path) -> torch.Tensor:
        """The block scales of a quantized weight, checked against its shape."""
        scale_name = name[: -len(".weight")] + ".scale"
        if not name.endswith(".weight") or scale_name not in self.files:
            raise CheckpointError(f"{path}: FP8 tensor {name!r} has no block scales {scale_name!r}")
        scale = self._read(scale_name)
        if scale.dtype not in (_MXFP4_SCALE_DTYPES if tensor.dtype != torch.float8_e4m3fn else _FP8_SCALE_DTYPES):
            kinds = "e8m0 (float8_e8m0fnu or uint8)" + (" or float" if tensor.dtype == torch.float8_e4m3fn else "")
            raise CheckpointError(f"{self.files[scale_name]}: scales {scale_name!r} are {scale.dtype}; those of "
                                  f"{tensor.dtype} weights are {kinds}")
        n, k = expected
        if tensor.dtype == torch.float8_e4m3fn:
            if tuple(tensor.shape) != expected:
                raise CheckpointError(f"{path}: FP8 tensor {name!r} has shape {tuple(tensor.shape)}, expected {expected}")
            want = fp8_block_shape((n, k))
            kind = "FP8 block scales"
        else:
            want = (n, k // MXFP4_BLOCK)
            kind = "MXFP4 scales"
            if tuple(tensor.shape) != (n, k // 2):
                raise CheckpointError(f"{path}: MXFP4 tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                                      f"{(n, k // 2)} (two e2m1 codes per byte of {expected})")
        if tuple(scale.shape) != want:
            raise CheckpointError(f"{self.files[scale_name]}: {kind} {scale_name!r} have shape {tuple(scale.shape)}, "
                                  f"expected {want} for weight {expected}")
        return scale

    @staticmethod
    def _dequantize(tensor: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """FP8 (e4m3 + block scales) and MXFP4 (packed int8 + e8m0 scales) weights as float32."""
        if tensor.dtype == torch.float8_e4m3fn:
            return dequantize_fp8(tensor, scale)
        return dequantize_mxfp4(tensor, scale)

    def _read(self, name: str) -> torch.Tensor:
        with safe_open(str(self.files[name]), framework="pt") as f:
            return f.get_tensor(name)

    def _store(self, target: Target, tensor: torch.Tensor) -> None:
        if target.expert is None:
            self.weights[target.name] = tensor
            return
        merged = self.weights.get(target.name)
        if merged is None:
            merged = self.weights[target.name] = torch.empty(self.shapes[target.name], dtype=tensor.dtype,
                                                             device=tensor.device)
        rows = tensor.shape[0]
        offset = rows if target.half == "up" else 0
        merged[target.expert, offset:offset + rows] = tensor
        self.expert_parts.setdefault(target.name, set()).add((target.expert, target.half))


# What block scales may be stored as: e8m0 exponents (V4-Flash, V4-Pro) or, for FP8 weights, float multipliers (V3's
# float32). An integer tensor would be read as multipliers, silently.
_MXFP4_SCALE_DTYPES = (torch.float8_e8m0fnu, torch.uint8)
_FP8_SCALE_DTYPES = _MXFP4_SCALE_DTYPES + (torch.float32, torch.bfloat16, torch.float16)

_SAFETENSORS_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "I8": torch.int8, "U8": torch.uint8}


def _dtype_of(f, name: str) -> torch.dtype | None:
    """The dtype of a tensor in an open safetensors file, without reading it (None: not a quantized kind)."""
    return _SAFETENSORS_DTYPES.get(f.get_slice(name).get_dtype())


def _read_part(f, name: str, part: Shard | None) -> torch.Tensor:
    """The tensor, or only its `part`, read from the file (safetensors slicing: nothing else is read)."""
    if part is None:
        return f.get_tensor(name)
    view = f.get_slice(name)
    lead = (slice(None),) * part.dim
    pieces = [view[lead + (slice(start, stop),)] for start, stop in part.ranges]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=part.dim)


def _cut(tensor: torch.Tensor, part: Shard | None, dim_scale: int = 1) -> torch.Tensor:
    """`part` of an in-memory tensor; dim_scale divides the ranges (packed or block-scaled columns)."""
    if part is None:
        return tensor
    pieces = [tensor.narrow(part.dim, start // dim_scale, -(-stop // dim_scale) - start // dim_scale)
              for start, stop in part.ranges]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=part.dim)


def expert_part(parallel: ParallelLayout, merged_name: str, merged_shape: tuple[int, ...]) -> Shard | None:
    """This rank's part of one expert's checkpoint tensor (a half of gate_up [I, D], or down [D, I]) under `parallel`:
    None with whole experts (each rank holds its own), else its slice of the intermediate columns."""
    if not parallel.experts_sliced:
        return None
    start, stop = parallel.shard(merged_name, merged_shape).ranges[0]  # the merged tensor's
    return Shard(0 if merged_name.endswith("gate_up_proj") else 1, ((start, stop),))  # gate / up rows, down columns


def check_quantized_part(name: str, part: Shard, fp8: bool, size: int) -> None:
    """CheckpointError unless `part` of a 2-D weight kept quantized (`size` values along its dimension) is on the grid
    of its scales: FP8 on its 128 x 128 blocks, MXFP4 rows anywhere and columns on its 32-column scale groups."""
    block = FP8_BLOCK if fp8 else (MXFP4_BLOCK if part.dim == 1 else 1)
    for start, stop in part.ranges:
        if start % block or (stop % block and stop != size):
            raise CheckpointError(f"{name!r}: this rank's part [{start}, {stop}) of dimension {part.dim} is not on the "
                                  f"{block}-wide block grid of its scales; serve it with weight_format=dequantize or "
                                  "choose a layout that splits on block boundaries")


def check_quantized_parts(config: ModelConfig, parallel: ParallelLayout, draft_layers: int = 0) -> None:
    """The refusal a load with weight_format=fp8 gives when rank `parallel.rank`'s part of a weight kept quantized is
    off the block grid of its scales, from the config alone: before anything is allocated or read."""
    full = expected_shapes(config, draft_layers)
    for name, shape in full.items():
        stored = published_format(name, config)
        if not stored or not kept_quantized(name):
            continue
        if name.endswith(ROUTED_EXPERTS):
            part = expert_part(parallel, name, shape)
            # (the size along the cut: a gate / up half's rows, or down's columns)
            size = None if part is None else shape[1] // 2 if part.dim == 0 else shape[2]
        else:
            part = parallel.shard(name, shape)
            size = None if part is None else shape[part.dim]
        if part is not None:
            check_quantized_part(name, part, stored == "fp8", size)


def _cut_quantized(name: str, data: torch.Tensor, scale: torch.Tensor, part: Shard | None):
    """(data, scale) of `part` of a weight kept quantized: FP8 cut on its 128 x 128 blocks, MXFP4 rows anywhere
    and columns on its 32-column scale groups (packed two per byte)."""
    if part is None:
        return data, scale
    fp8 = data.dtype == torch.float8_e4m3fn
    check_quantized_part(name, part, fp8, data.shape[part.dim] * (1 if fp8 or part.dim == 0 else 2))
    if fp8:
        return _cut(data, part), _cut(scale, part, FP8_BLOCK)
    packed = 2 if part.dim == 1 else 1
    return _cut(data, part, packed), _cut(scale, part, MXFP4_BLOCK if part.dim == 1 else 1)


def empty_quantized_experts(shape: tuple[int, int, int], dtype: torch.dtype, halves: int, device) -> QuantizedExperts:
    """Room for merged experts [E, N, K] as published: FP8 (e4m3, float32 block scales per half) or MXFP4."""
    num_experts, n, k = shape
    rows = n // halves
    if dtype == torch.float8_e4m3fn:
        scale = torch.empty(num_experts, halves * -(-rows // 128), -(-k // 128), dtype=torch.float32, device=device)
        return QuantizedExperts("fp8", torch.empty(shape, dtype=dtype, device=device), scale, shape, rows)
    data = torch.empty(num_experts, n, k // 2, dtype=torch.int8, device=device)
    scale = torch.empty(num_experts, n, k // MXFP4_BLOCK, dtype=torch.uint8, device=device)
    return QuantizedExperts("mxfp4", data, scale, shape, rows)


_INTEGER_TENSORS = (".tid2eid",)  # token id -> expert ids, the hash MoE's table: the only integer tensor


def is_fp32_parameter(name: str) -> bool:
    """Kept in fp32 whatever the engine dtype, as the reference keeps it."""
    return any(marker in name for marker in _FP32_MARKERS)


def _convert(name: str, tensor: torch.Tensor, dtype, device) -> torch.Tensor:
    if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise CheckpointError(f"tensor {name!r} is {tensor.dtype} without block scales")
    if name.endswith(_INTEGER_TENSORS):
        if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
            raise CheckpointError(f"tensor {name!r} is {tensor.dtype}, expected an integer dtype")
        return tensor.to(device=device, dtype=torch.long)
    if not tensor.dtype.is_floating_point:  # (an integer tensor read as weights would be their integer parts)
        raise CheckpointError(f"tensor {name!r} is {tensor.dtype}, expected a floating-point dtype (quantized "
                              "weights come with their block scales)")
    target = torch.float32 if is_fp32_parameter(name) else dtype
    return tensor.to(device=device, dtype=target).contiguous()
