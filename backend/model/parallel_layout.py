"""How one model is split across ranks: which tensors each rank holds, and where partial sums meet.

    layout = ParallelLayout(tensor_parallel_size=2, expert_parallel_size=2, rank=1)
    layout.check(model_config)                # ConfigError naming the parameter when it cannot split
    shard = layout.shard("model.layers.0.self_attn.q_b_proj.weight", (4096, 1024))

World size W = max(tensor_parallel_size, expert_parallel_size, data_parallel_size); each is 1 or W:
  attention     tensor_parallel_size = W: query heads, the sinks and the grouped output projection's groups
                (o_a rows, o_b columns) split W ways; o_b's partial sums are all-reduced. 1: every rank runs
                the whole attention (the same on each). The single shared K=V head, q_a, the compressors and
                the indexer are replicated on every rank: each rank keeps the same KV pools and computes the
                same entries (no communication; costs their weights and the pools once per rank).
  routed MoE    expert_parallel_size = W: rank r holds experts [r E / W, (r + 1) E / W) whole and computes
                only the (token, expert) pairs routed to them. Otherwise (tensor_parallel_size = W) every
                expert's intermediate columns are split W ways (gate and up rows, down columns).
  shared expert split like a dense MLP when tensor_parallel_size = W, else replicated.
                The routed and (split) shared partial sums meet in ONE all-reduce per MoE layer.
  LM head       vocabulary-parallel whenever W > 1 (rows of lm_head split), logits all-gathered; whole on every
                rank under data parallelism (each rank's rows are its own requests').
  replicated    embeddings, mHC, norms, router, q_a, kv, compressors, indexer.
  data parallel data_parallel_size = W (with tensor_parallel_size 1): every rank runs the whole attention for its own
                requests, over its own pools; each rank's batch is different. With expert_parallel_size = W the
                ranks meet at every MoE layer: the routed experts' inputs and routings are all-gathered (padded to
                the largest rank's tokens), every rank computes its experts' pairs of all of them, and the partial
                sums are reduce-scattered back to the rank the tokens came from (`moe_exchange`). Without it every
                rank holds every expert and the ranks never meet in a forward.
"""

from __future__ import annotations

from dataclasses import dataclass

from backend.errors import ConfigError


@dataclass(frozen=True)
class Shard:
    """The local part of a tensor: along `dim`, the concatenation of `ranges` [(start, stop), ...]."""

    dim: int
    ranges: tuple[tuple[int, int], ...]

    def local_size(self) -> int:
        return sum(stop - start for start, stop in self.ranges)


@dataclass(frozen=True)
class ParallelLayout:
    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1
    rank: int = 0
    data_parallel_size: int = 1

    @property
    def world_size(self) -> int:
        return max(self.tensor_parallel_size, self.expert_parallel_size, self.data_parallel_size)

    @classmethod
    def from_config(cls, config, rank: int = 0) -> "ParallelLayout":
        """Rank `rank`'s layout of an EngineConfig."""
        return cls(config.tensor_parallel_size, config.expert_parallel_size, rank, config.data_parallel_size)

    @property
    def data_parallel(self) -> bool:
        """Each rank runs its own requests (its own batch and pools)."""
        return self.data_parallel_size > 1

    @property
    def moe_exchange(self) -> bool:
        """Data-parallel ranks exchange tokens at every MoE layer (their experts are split)."""
        return self.data_parallel and self.experts_split

    @property
    def vocabulary_parallel(self) -> bool:
        """lm_head's rows split over the ranks, the logits all-gathered (every rank has the same rows)."""
        return self.world_size > 1 and not self.data_parallel

    @property
    def attention_split(self) -> bool:
        return self.tensor_parallel_size > 1

    @property
    def experts_split(self) -> bool:
        """Whole experts per rank (expert parallelism)."""
        return self.expert_parallel_size > 1

    @property
    def experts_sliced(self) -> bool:
        """Every expert's intermediate columns split (tensor parallelism of the routed experts)."""
        return self.tensor_parallel_size > 1 and not self.experts_split

    def check(self, model) -> None:
        """ConfigError naming the parameter when the model cannot be split this way."""
        w, tp, ep, dp = self.world_size, self.tensor_parallel_size, self.expert_parallel_size, self.data_parallel_size
        for name, value in (("tensor_parallel_size", tp), ("expert_parallel_size", ep), ("data_parallel_size", dp)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"parameter {name!r}: invalid value {value!r} (expected an integer >= 1)")
            if value not in (1, w):
                raise ConfigError(f"parameter {name!r}: invalid value {value} (expected 1 or the world size {w}: "
                                  "each kind of parallelism spans every rank or none)")
        if dp > 1 and tp > 1:
            raise ConfigError(f"parameter 'data_parallel_size': {dp} with tensor_parallel_size {tp} (data-parallel "
                              "attention keeps whole heads on each rank; combine it with expert_parallel_size)")
        if not 0 <= self.rank < w:
            raise ConfigError(f"rank {self.rank} outside the world of {w}")
        needs = [("tensor_parallel_size", tp, "num_attention_heads", model.num_attention_heads),
                 ("tensor_parallel_size", tp, "o_groups", model.o_groups),
                 ("expert_parallel_size", ep, "n_routed_experts", model.n_routed_experts),
                 ("tensor_parallel_size", tp, "moe_intermediate_size", model.moe_intermediate_size),
                 ("tensor_parallel_size and expert_parallel_size", w if self.vocabulary_parallel else 1,
                  "vocab_size", model.vocab_size)]
        for parameter, size, field, value in needs:
            if value % size:
                raise ConfigError(f"parameter {parameter!r}: {size} ranks cannot split the model's {field} "
                                  f"({value}): it must be a multiple of {size}")

    # --- which part of each tensor this rank holds ------------------------------------------------
    def expert_range(self, num_experts: int) -> tuple[int, int]:
        """(first, count) of the routed experts this rank holds."""
        if not self.experts_split:
            return 0, num_experts
        count = num_experts // self.world_size
        return self.rank * count, count

    def _part(self, size: int) -> tuple[int, int]:
        part = size // self.world_size
        return self.rank * part, (self.rank + 1) * part

    def shard(self, name: str, shape: tuple[int, ...]) -> Shard | None:
        """The local part of engine tensor `name` of full `shape`, or None when the rank holds all of it."""
        if self.world_size == 1:
            return None
        if name == "lm_head.weight":
            return Shard(0, (self._part(shape[0]),)) if self.vocabulary_parallel else None
        attention = ("self_attn.q_b_proj.weight", "self_attn.sinks", "self_attn.o_a_proj.weight")
        if self.attention_split and name.endswith(attention):
            return Shard(0, (self._part(shape[0]),))
        if self.attention_split and name.endswith("self_attn.o_b_proj.weight"):
            return Shard(1, (self._part(shape[1]),))
        if self.attention_split and name.endswith(("shared_experts.gate_proj.weight", "shared_experts.up_proj.weight")):
            return Shard(0, (self._part(shape[0]),))
        if self.attention_split and name.endswith("shared_experts.down_proj.weight"):
            return Shard(1, (self._part(shape[1]),))
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            return self._expert_shard(name, shape)
        return None

    def _expert_shard(self, name: str, shape: tuple[int, ...]) -> Shard | None:
        """Merged routed experts [E, 2I, D] (gate_up) / [E, D, I] (down)."""
        if self.experts_split:
            first, count = self.expert_range(shape[0])
            return Shard(0, ((first, first + count),))
        if not self.experts_sliced:
            return None
        if name.endswith("gate_up_proj"):
            inter = shape[1] // 2
            start, stop = self._part(inter)
            return Shard(1, ((start, stop), (inter + start, inter + stop)))  # gate rows, then up rows
        return Shard(2, (self._part(shape[2]),))

    def local_shapes(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        out = {}
        for name, shape in shapes.items():
            shard = self.shard(name, shape)
            if shard is None:
                out[name] = shape
            else:
                local = list(shape)
                local[shard.dim] = shard.local_size()
                out[name] = tuple(local)
        return out
