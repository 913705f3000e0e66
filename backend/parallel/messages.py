"""What rank 0 sends its worker ranks besides a step's batch: small typed messages, pickled.

`Stop` ends any worker's loop (a tensor/expert-parallel follower's, over the control group; a data-parallel rank's,
over its inbox). A data-parallel rank also gets each request rank 0 placed on it (`Arrival`), its aborts (`Cancel`),
and a `Wake` whenever a request arrives anywhere (backend/parallel/data_parallel.py, backend/parallel/sync.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from backend.request import FinishReason, SamplingParams, Sequence


@dataclass(frozen=True, slots=True)
class Stop:
    """A worker's last message."""


@dataclass(frozen=True, slots=True)
class Arrival:
    """A request for the rank rank 0 placed it on: `handle` is rank 0's number for it (what its outputs carry).
    Its deadline (timeout_ms) is rank 0's to keep, by rank 0's clock from its arrival there: the rank is sent the
    request without one, and a `Cancel` with reason TIMEOUT when it passes."""

    handle: int
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    priority: int
    stop_ids: frozenset[int]

    def sequence(self) -> Sequence:
        return Sequence(self.request_id, list(self.prompt_ids), self.sampling, priority=self.priority)


@dataclass(frozen=True, slots=True)
class Cancel:
    """End a request: cancelled by its client, or past the deadline rank 0 keeps for it. `handle`: its Arrival's (a
    Cancel may overtake its Arrival: rank 0 places a request before it sends it)."""

    request_id: str
    reason: FinishReason = FinishReason.CANCELLED
    handle: int | None = None


@dataclass(frozen=True, slots=True)
class Wake:
    """A request arrived somewhere: ranks that all went idle agree on their steps again (LockStep)."""
