"""How data-parallel ranks keep in step: one small agreement before each forward.

    agreed = sync.agree(num_tokens, has_work)     # every rank's tokens this step, and whether any rank has work
    if agreed.stepped: run this rank's batch, or (none) its part of the MoE exchanges alone

With expert parallelism the data-parallel ranks meet at every MoE layer (backend/model/deepseek_v4.py), so every
forward must run on every rank, each padded to the largest rank's tokens. `LockStep` makes them agree first, as
vLLM's data-parallel coordinator and SGLang's idle batches do: one all-gather of (tokens, has work, stop) over a gloo
group of their own (the engine thread's alone, in step order; the forwards' collectives run in the default group).
A rank without a batch then runs an idle forward; speculative decoding's k draft passes after a step are agreed on
once (`agree_passes`: every rank's tokens in each pass), so a rank may run them as one static chain. When no rank
has work they all stop agreeing (`ready()` turns False) until woken: rank 0 wakes itself and every other rank
whenever a request arrives (backend/parallel/data_parallel.py), so an idle group makes no collective at all, and none
can time out. `ALONE` is the agreement of a rank that never meets another.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch

from backend.model.comm import RankGroupError


@dataclass(frozen=True, slots=True)
class Agreement:
    counts: tuple[int, ...]  # every rank's tokens this step, in rank order (alone: its own)
    has_work: bool  # some rank has work: the ranks go on stepping
    stop: bool = False  # rank 0 is shutting down: every rank leaves its loop

    @property
    def stepped(self) -> bool:
        """Some rank runs a forward (every rank takes part)."""
        return any(self.counts)


class StepSync:
    """A rank that never meets another (one rank, or data-parallel ranks with whole experts)."""

    lock_step = False
    broken: str | None = None  # (why no rank of the group can step again)

    def agree(self, num_tokens: int, has_work: bool, stop: bool = False) -> Agreement:
        return Agreement((num_tokens,), has_work, stop)

    def agree_passes(self, counts: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
        """Every rank's tokens in each of a step's draft passes (`counts`: this rank's, one per pass; the same number
        of passes on every rank), agreed once: per pass, the ranks' counts in rank order (alone: its own)."""
        return tuple((count,) for count in counts)

    def ready(self) -> bool:
        """Whether to take part in the next agreement."""
        return True

    def wake(self) -> None:
        pass

    def step_failed(self, error: BaseException) -> BaseException:
        """What a step that failed on this rank partway leaves for its requests (alone: the error itself)."""
        return error


ALONE = StepSync()


class LockStep(StepSync):
    """Data-parallel ranks whose MoE layers exchange tokens (see the module docstring)."""

    lock_step = True

    def __init__(self, world_size: int, timeout_s: float):
        import torch.distributed as dist

        self._dist, self.world_size = dist, world_size
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self._lock = threading.Lock()
        self._wakes = 0  # wake() calls so far
        self._idle_at: int | None = 0  # the wakes seen when every rank was found idle (None: not idle); idle at first
        self._agreed_wakes = 0  # the wakes seen at this rank's last agreement
        self.broken: str | None = None
        # How this rank ends the group at once when a step fails on it (`step_failed`): rank 0 ends its node's
        # workers (backend/parallel/group.py), a worker's process exits (backend/rank_main.py).
        self.end_group: Callable[[], None] = lambda: None

    def agree(self, num_tokens: int, has_work: bool, stop: bool = False) -> Agreement:
        """A wake this rank saw since its last agreement counts as work: otherwise a wake that reaches one rank
        before an agreement finds every rank idle and another after it leaves the first idle (not ready) and the
        other ready, which would then wait in the next agreement alone."""
        with self._lock:
            wakes = self._wakes
            woken, self._agreed_wakes = wakes != self._agreed_wakes, wakes
        table = self._gather([num_tokens, int(has_work or woken), int(stop)])
        agreed = Agreement(tuple(row[0] for row in table), any(row[1] for row in table), any(row[2] for row in table))
        with self._lock:
            self._idle_at = None if agreed.has_work else wakes
        return agreed

    def agree_passes(self, counts: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
        return tuple(zip(*self._gather(list(counts))))

    def step_failed(self, error: BaseException) -> RankGroupError:
        """A step failed on this rank partway: the other ranks are still in that step's MoE exchanges (or its draft
        passes' agreement), which this rank left. Any collective it made from now on would meet theirs out of order
        (gloo then aborts whichever process has the smaller buffer, the stub too; NCCL waits out the timeout), so it
        makes none: the group is broken. It also ends the group at once (`end_group`), which fails the others'
        collectives now rather than after `collective_timeout_s`."""
        if isinstance(error, RankGroupError):
            self.broken = self.broken or str(error)
            return error
        if not self.broken:
            self.broken = (f"a step failed on a data-parallel rank in lock-step, which leaves the ranks' exchanges "
                           f"out of step: {error}")
            self.end_group()
        return RankGroupError(self.broken)

    def _gather(self, values: list[int]) -> list[list[int]]:
        """Every rank's `values` (as many on each), in rank order: one all-gather."""
        if self.broken:
            raise RankGroupError(self.broken)
        mine = torch.tensor(values, dtype=torch.long)
        every = [torch.empty(len(values), dtype=torch.long) for _ in range(self.world_size)]
        try:
            self._dist.all_gather(every, mine, group=self.group)
        except Exception as exc:  # a rank is gone or silent: no rank can step again
            self.broken = f"data-parallel ranks failed to agree on a step: {exc}"
            raise RankGroupError(self.broken) from exc
        return torch.stack(every).tolist()

    def ready(self) -> bool:
        """False once every rank was found idle, until woken since."""
        with self._lock:
            return self._idle_at is None or self._wakes != self._idle_at

    def wake(self) -> None:
        with self._lock:
            self._wakes += 1
