"""The collectives a sharded forward needs, over torch.distributed (NCCL on CUDA, gloo on CPU).

`Communicator()` is the single-rank one: every collective returns its input. `DistributedCommunicator`
runs them in a torch.distributed process group; the model calls only these methods
(backend/model/parallel_layout.py says where).
"""

from __future__ import annotations

import torch


class RankGroupError(RuntimeError):
    """A worker died or a collective failed: this model instance cannot run another step."""


class Communicator:
    rank = 0
    world_size = 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over ranks (in place where the backend reduces in place)."""
        return tensor

    def all_gather_last(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's tensor concatenated along the last dimension, in rank order."""
        return tensor

    def all_gather_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's tensor (the same shape on each) concatenated along the first dimension, in rank order."""
        return tensor

    def reduce_scatter_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of `tensor` [W * n, ...], this rank's block of n rows of it."""
        return tensor


class DistributedCommunicator(Communicator):
    """The collectives over a process group. A collective that fails (a rank died, or stayed silent past the group's
    timeout) raises RankGroupError, as the rank group's own messages do: whoever runs the step then knows the group
    is broken, not merely that one step failed."""

    def __init__(self, group=None):
        import torch.distributed as dist

        self._dist, self.group = dist, group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.contiguous()
        self._call(self._dist.all_reduce, tensor, group=self.group)
        return tensor

    def all_gather_last(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.cat(self._gathered(tensor), dim=-1)

    def all_gather_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.cat(self._gathered(tensor), dim=0)

    def reduce_scatter_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.contiguous()
        rows = tensor.shape[0] // self.world_size
        if self._dist.get_backend(self.group) == "nccl":
            out = tensor.new_empty((rows, *tensor.shape[1:]))
            self._call(self._dist.reduce_scatter_tensor, out, tensor, group=self.group)
            return out
        # gloo has no reduce-scatter: the whole sum, then this rank's rows (W times the traffic; CPU only)
        self._call(self._dist.all_reduce, tensor, group=self.group)
        return tensor[self.rank * rows:(self.rank + 1) * rows]

    def _gathered(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self._call(self._dist.all_gather, parts, tensor, group=self.group)
        return parts

    @staticmethod
    def _call(collective, *args, **kwargs) -> None:
        try:
            collective(*args, **kwargs)
        except Exception as exc:
            raise RankGroupError(f"a collective of the rank group failed: {exc}") from exc
