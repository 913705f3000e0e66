"""A data-parallel rank's loop (backend/parallel/data_parallel.py `serve_rank`) over a fake link and a fake engine core:
what it does with rank 0's messages, whatever order they come in, and with its own faults; and rank 0's side of the
links over fakes: noticing a lost rank, delivering the ranks' outputs, closing the links at shutdown."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import pytest

from backend.parallel.data_parallel import serve_rank
from backend.parallel.messages import Arrival, Cancel, Stop
from backend.parallel.sync import ALONE
from backend.request import FinishReason, SamplingParams


class FakeLink:
    """Hands the loop one list of messages per receive, then Stop."""

    def __init__(self, *batches: list):
        self.batches, self.sent = deque(batches), []

    def receive(self, timeout_s):
        return self.batches.popleft() if self.batches else [Stop()]

    def send(self, batch) -> None:
        self.sent.append(batch)

    def rank_0_gone(self) -> bool:
        return False


class FakeCore:
    """An engine core that admits every request and records what it is asked to abort (a live request's abort is
    taken, an unknown one's refused, as the scheduler's)."""

    rank, stopped, unavailable, busy, sync = 1, False, None, False, ALONE
    scheduler = SimpleNamespace(num_awaiting_grammar=0)

    def __init__(self):
        self.live, self.aborted = set(), []

    def prepare(self, seq, stop_ids) -> None:
        pass

    def add(self, seq, max_waiting=None) -> bool:
        self.live.add(seq.request_id)
        return True

    def abort(self, request_id: str, reason: FinishReason) -> bool:
        if request_id not in self.live:
            return False
        self.aborted.append((request_id, reason))
        return True

    def step(self) -> bool:
        return False

    def snapshot(self):
        return None


def _arrival(handle: int, request_id: str) -> Arrival:
    return Arrival(handle, request_id, [5, 6, 7], SamplingParams(max_tokens=4), 0, frozenset())


def test_a_cancel_that_overtakes_its_arrival_still_ends_the_request():
    """Rank 0 places a request before it sends it, so a client's abort (or a deadline) can send its Cancel first."""
    core = FakeCore()
    serve_rank(core, FakeLink([Cancel("late", FinishReason.TIMEOUT, handle=7)], [_arrival(7, "late")]))
    assert core.aborted == [("late", FinishReason.TIMEOUT)]


def test_a_cancel_of_a_request_that_ended_ends_no_later_one_of_the_same_id():
    """(Kept by the handle rank 0 gave the request it cancelled, not by its id, which a client may use again.)"""
    core = FakeCore()
    serve_rank(core, FakeLink([Cancel("reused", handle=3)], [_arrival(4, "reused")]))
    assert core.aborted == [] and core.live == {"reused"}


def test_rank_0_notices_a_lost_rank_while_another_keeps_sending_outputs():
    """Rank 0's receiving thread asks the group whether a worker is gone on a clock, not only when no rank's outputs
    come: under steady load from the ranks alive, the requests of one that died would otherwise never end."""
    import threading
    import time

    from backend.config import EngineConfig
    from backend.engine import LLMEngine

    class BusyLinks:  # another rank's outputs, every time
        def receive(self, timeout_s):
            return "a batch"

        def flush(self):
            return 0

        def gone(self):
            return []

    class Group:
        links, broken, checks = BusyLinks(), None, 0

        def check(self):
            self.checks += 1
            self.broken = "data-parallel rank 2 exited" if self.checks >= 3 else None
            return self.broken

    engine = object.__new__(LLMEngine)  # (the receiving loop alone, over fakes)
    engine.group, engine._stop, engine._with_deadline, failed = Group(), threading.Event(), set(), []
    engine.config, engine.ranks, engine._placement_lock = EngineConfig(), [], threading.Lock()  # (none silent)
    engine._take_outputs = lambda batch: time.sleep(0.01)
    engine._fail_everywhere = failed.append
    loop = threading.Thread(target=engine._receive_loop, daemon=True)
    loop.start()
    loop.join(timeout=5)
    engine._stop.set()
    assert failed == ["data-parallel rank 2 exited"]


def test_a_fault_in_a_step_or_an_admission_is_logged_and_the_rank_serves_on(caplog):
    """The rank's step raises once, and preparing one request raises something other than a request error: both are
    logged, that request ends with an internal error, and the loop goes on to take the next message and step again
    (the rank's process ending would fail the requests of every rank)."""

    class FaultyCore(FakeCore):
        steps = 0

        def step(self) -> bool:
            FaultyCore.steps += 1
            if FaultyCore.steps == 1:
                raise RuntimeError("injected step fault")
            return False

        def prepare(self, seq, stop_ids) -> None:
            if seq.request_id == "bad":
                raise KeyError("injected admission fault")

    core, link = FaultyCore(), FakeLink([_arrival(1, "good")], [_arrival(2, "bad")], [_arrival(3, "later")])
    core.send = None
    serve_rank(core, link)
    assert FaultyCore.steps >= 3 and core.live == {"good", "later"}
    (failed,) = [(batch.handles[row], batch.extras[row][0]) for batch in link.sent
                 for row in range(len(batch.handles)) if batch.finished[row]]
    assert failed == (2, "internal error: 'injected admission fault'")
    assert "engine step failed (rank 1)" in caplog.text and "injected step fault" in caplog.text
    assert "admitting request 'bad' failed (rank 1)" in caplog.text


def test_a_rank_waiting_for_a_grammar_sends_its_stats_on_the_clock_not_at_every_poll():
    """While its only request waits for its grammar, a rank polls every few milliseconds; it is not idle, so its stats
    go to rank 0 every STATS_EVERY_S (the first at once), not at each of 20 polls. Idle, it sends them each time it
    finds itself so (rank 0 then sees its last counts)."""

    class CompilingCore(FakeCore):
        grammars = SimpleNamespace(stats=dict, take_compile_seconds=list)

        def snapshot(self):
            return {"num_running": 0}

    core = CompilingCore()
    core.scheduler = SimpleNamespace(num_awaiting_grammar=1)
    link = FakeLink(*[[] for _ in range(20)])
    serve_rank(core, link)
    assert sum(batch.stats is not None for batch in link.sent) == 1
    core.scheduler.num_awaiting_grammar, link = 0, FakeLink(*[[] for _ in range(20)])
    serve_rank(core, link)
    assert sum(batch.stats is not None for batch in link.sent) == 20


def test_no_output_reaches_a_consumer_after_its_final():
    """Rank 0 delivers from two threads: its engine's (its own requests; every request's error when a rank is lost)
    and the one taking in other ranks' outputs. A batch whose first consumer is slow, and request P's error FINAL
    sent from the other thread meanwhile: P's tokens, looked up before, still come before its FINAL, not after."""
    import threading

    from backend.engine import LLMEngine, Placement
    from backend.request import RequestOutput

    engine = object.__new__(LLMEngine)  # (the delivery alone, over two placements)
    engine._placement_lock, engine._delivery_lock = threading.Lock(), threading.RLock()
    engine._by_handle, engine._with_deadline, engine._delivering = {}, set(), 0
    in_batch, final_sent, seen = threading.Event(), threading.Event(), []
    rank = SimpleNamespace(load=0)

    def slow(output):  # (the batch's placements are looked up by now)
        in_batch.set()
        final_sent.wait(timeout=0.5)

    engine._placed = {"q": Placement(rank, 0, slow, "q", 3, 1), "p": Placement(rank, 0, seen.append, "p", 3, 2)}

    def out(request_id, tokens, finished):
        return RequestOutput(request_id, tokens, "", finished, FinishReason.ERROR if finished else None, 3,
                             len(tokens), "rank lost" if finished else None, None, 0)

    batch = threading.Thread(target=engine._send_all, args=([out("q", [7], False), out("p", [8], False)],))
    batch.start()
    assert in_batch.wait(timeout=5)
    final_sent.set()
    engine._send_all([out("p", [], True)])
    batch.join()
    assert [(o.new_token_ids, o.finished) for o in seen] == [([8], False), ([], True)]


def test_the_links_are_not_closed_under_a_thread_still_polling_them():
    """A shutdown whose budget is spent while the thread taking in other ranks' outputs still runs leaves the ranks'
    sockets open (ZeroMQ's are not thread-safe: closing one under a poll may abort the process); a thread that ends
    within its poll gets them closed."""
    import threading

    from backend.engine import LLMEngine
    from backend.parallel.sync import ALONE

    class Group:
        broken = None

        def close(self, timeout, close_links=True):
            self.closed_links = close_links

    for stuck in (True, False):
        engine = object.__new__(LLMEngine)  # (the shutdown alone, over fakes)
        engine._stop, engine._thread, engine._froze_heap = threading.Event(), None, False
        engine._placement_lock, engine._placed = threading.Lock(), {}
        engine.core = SimpleNamespace(close=lambda timeout: True, sync=ALONE, scheduler=SimpleNamespace(wake=dict))
        engine.grammars = SimpleNamespace(close=lambda: None)
        engine.group, release = Group(), threading.Event()
        engine._receiver = threading.Thread(target=release.wait if stuck else engine._stop.wait, daemon=True)
        engine._receiver.start()
        group = engine.group
        engine.shutdown(timeout=0.0)
        release.set()
        assert group.closed_links is not stuck


def test_a_rank_whose_every_step_faults_gives_up():
    """A fault at every step is a broken rank: the tenth in a row ends its loop with the fault (its process then ends,
    and rank 0 fails its requests), where serving on would leave them hanging while the rank still answers."""
    from backend.parallel.data_parallel import MAX_STEP_FAULTS

    class BrokenCore(FakeCore):
        steps = 0

        def step(self) -> bool:
            BrokenCore.steps += 1
            raise RuntimeError("injected step fault")

    with pytest.raises(RuntimeError, match="injected step fault"):
        serve_rank(BrokenCore(), FakeLink(*[[] for _ in range(50)]))
    assert BrokenCore.steps == MAX_STEP_FAULTS
