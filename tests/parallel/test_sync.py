"""LockStep's idle and wake protocol (backend/parallel/sync.py), its gather over threads instead of gloo: ranks that
found every rank idle stop agreeing until woken, and however a wake falls around an agreement every rank comes to the
same answer (one waiting alone in the next agreement would wait until collective_timeout_s)."""

from __future__ import annotations

import threading

from backend.parallel.sync import LockStep


class ThreadLockStep(LockStep):
    """A rank of `world` whose all-gather is a table shared with the other threads."""

    def __init__(self, rank: int, barrier: threading.Barrier, table: list):
        self.world_size, self.rank, self._barrier, self._table = len(table), rank, barrier, table
        self._lock = threading.Lock()
        self._wakes, self._idle_at, self._agreed_wakes, self.broken = 0, 0, 0, None

    def _gather(self, values: list[int]) -> list[list[int]]:
        self._table[self.rank] = list(values)
        self._barrier.wait(timeout=5)
        out = [list(row) for row in self._table]
        self._barrier.wait(timeout=5)
        return out


def _ranks(world: int = 2) -> list[ThreadLockStep]:
    barrier, table = threading.Barrier(world), [None] * world
    return [ThreadLockStep(rank, barrier, table) for rank in range(world)]


def _agree_all(ranks, has_work: list[bool], before=lambda rank: None):
    """Every rank agrees at once (rank r on its own thread, `before(r)` first); each rank's Agreement."""
    agreed = [None] * len(ranks)

    def run(r):
        before(r)
        agreed[r] = ranks[r].agree(0, has_work[r])

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(ranks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    return agreed


def test_idle_ranks_stop_agreeing_until_woken():
    ranks = _ranks()
    for rank in ranks:
        rank.wake()
    assert all(rank.ready() for rank in ranks)
    assert [a.has_work for a in _agree_all(ranks, [True, False])] == [True, True]
    assert not any(a.has_work for a in _agree_all(ranks, [False, False]))
    assert not any(rank.ready() for rank in ranks)
    for rank in ranks:  # a request arrives: rank 0 wakes itself and every other rank
        rank.wake()
    assert all(rank.ready() for rank in ranks)


def test_a_wake_on_either_side_of_an_agreement_leaves_every_rank_ready_alike():
    """Rank 0 takes its agreement's look at the wakes, then a request arrives: rank 0 is woken during the agreement,
    rank 1 (its Wake message read first) before its own look. The agreement counts rank 1's wake as work, so both go
    on agreeing (before: rank 0 ready, rank 1 idle and waiting for a Wake, rank 0 alone in the next agreement)."""
    ranks = _ranks()
    _agree_all(ranks, [True, True])
    looked = threading.Event()

    def before(r):
        if r == 0:
            looked.set()  # (its look happens at once, in agree; the wakes come after)
        else:
            assert looked.wait(5)
            ranks[0].wake()
            ranks[1].wake()

    agreed = _agree_all(ranks, [False, False], before)
    assert [a.has_work for a in agreed] == [True, True]
    assert [rank.ready() for rank in ranks] == [True, True]
    after = _agree_all(ranks, [True, False])  # rank 0 has the request: both take part
    assert all(a is not None and a.has_work for a in after)


def test_a_step_that_fails_breaks_the_group_and_ends_it_once():
    """(A worker's `end_group` exits its process, rank 0's ends its workers: tests/parallel/test_data_parallel.py.) A
    group that a collective already broke is not ended again: its ranks are gone or going."""
    from backend.model.comm import RankGroupError

    rank, ended = _ranks()[0], []
    rank.end_group = lambda: ended.append(1)
    first = rank.step_failed(RuntimeError("out of memory"))
    assert isinstance(first, RankGroupError) and "out of memory" in str(first) and "lock-step" in str(first)
    assert rank.broken == str(first) and ended == [1]
    assert str(rank.step_failed(ValueError("later"))) == str(first) and ended == [1]
    other = _ranks()[1]
    other.end_group = lambda: ended.append(2)
    gone = RankGroupError("worker process gone: rank 1")
    assert other.step_failed(gone) is gone and other.broken == str(gone) and ended == [1]
