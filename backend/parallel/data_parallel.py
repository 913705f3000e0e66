"""Data-parallel ranks, each a whole engine over its own pools; rank 0 places the requests and answers them.

    links = RankLinks()                                 # rank 0: its inbox
    links.connect({rank: inbox address})                # once the ranks are ready (they report their inboxes)
    links.send(rank, Arrival(...)) / Cancel / Wake / Stop
    batch = links.receive(timeout_s)                    # rank 0's receiving thread: a rank's OutputBatch, or None
    serve_rank(core, link)                              # every other rank's process (link: RankLink, connected
                                                        # to rank 0's inbox): its engine's loop

Every data-parallel rank's process runs the loop a single-rank engine runs (backend/engine_core.py: scheduler,
batch building, forward, sampling, grammar masks, speculative verify and drafts) over its own pools, as SGLang's
scheduler per DP rank and vLLM's EngineCore per DP rank do. Rank 0 (the engine in tritonserver's process,
backend/engine.py) places each request on a rank by load and prefix affinity and sends it there (`Arrival`: the
prompt, the sampling parameters, the stop ids, rank 0's handle for it); aborts follow it (`Cancel`). Each step a rank
sends back only what the responses need, packed in arrays (`OutputBatch`: per request its handle, its new tokens,
whether and why it ended, its prefix-cache hits; errors and log-probabilities, which only some requests carry, beside
them): 18 bytes a request for one token. Its counters, requests and pools come with it every STATS_EVERY_S.

Messages travel over ZeroMQ (PUSH/PULL, one socket from rank 0 to each rank's inbox, one from all ranks back),
pickled: every rank binds its inbox and reports its address when it is ready (the group's ready barrier gathers
them), then connects to the others'. A rank whose connection drops (its process exited or was killed, on this node or
another: its end of the TCP connection closed) is gone at once (`RankLinks.gone`, ZeroMQ's DISCONNECTED event on
rank 0's socket to it; rank 0 then fails every request), and so is rank 0 for a rank (`RankLink.rank_0_gone`: the
rank exits). The MoE exchanges keep ranks in
step where they meet (backend/parallel/sync.py, `LockStep`): every request that arrives wakes every rank (`Wake`), so
ranks that all went idle take up their agreements together again.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket as _socket
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass

import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from backend.parallel import node_count
from backend.parallel.messages import Arrival, Cancel, Stop, Wake
from backend.request import FinishReason, RequestOutput

logger = logging.getLogger(__name__)

STATS_EVERY_S = 0.2  # a rank sends its stats snapshot at most this often (and whenever it goes idle)
EARLY_CANCELS = 1024  # Cancels a rank keeps for requests it has not seen (most are of requests that ended already)
_REASONS = list(FinishReason)  # a finished row's code: its index + 1 (0: not finished)


@dataclass
class OutputBatch:
    """One rank's outputs of a step, as arrays (see the module docstring), and now and then its stats."""

    rank: int
    handles: np.ndarray  # int64 [R] (rank 0 numbers every placement: past 2^31 within weeks at a high rate)
    counts: np.ndarray  # uint8 [R]: each row's new tokens
    finished: np.ndarray  # int8 [R]: 0, or the finish reason's index + 1
    num_cached: np.ndarray  # int32 [R]: the request's prompt positions the prefix cache served
    tokens: np.ndarray  # int32 [sum(counts)]
    extras: dict[int, tuple]  # row -> (error, logprobs), for the rows that carry either
    stats: dict | None = None

    ARRAYS = ("handles", "counts", "finished", "num_cached", "tokens")
    DTYPES = (np.int64, np.uint8, np.int8, np.int32, np.int32)

    @classmethod
    def of(cls, rank: int, outputs: list[RequestOutput], handle_of: dict[str, int],
           stats: dict | None = None) -> "OutputBatch":
        tokens = [t for out in outputs for t in out.new_token_ids]
        return cls(rank, np.fromiter((handle_of[out.request_id] for out in outputs), np.int64, len(outputs)),
                   np.fromiter((len(out.new_token_ids) for out in outputs), np.uint8, len(outputs)),
                   np.fromiter((_REASONS.index(out.finish_reason) + 1 if out.finished else 0 for out in outputs),
                               np.int8, len(outputs)),
                   np.fromiter((out.num_cached_tokens for out in outputs), np.int32, len(outputs)),
                   np.array(tokens, dtype=np.int32),
                   {row: (out.error, out.logprobs) for row, out in enumerate(outputs)
                    if out.error is not None or out.logprobs is not None}, stats)

    def frames(self) -> list[bytes]:
        """What goes over the wire: a small pickled header, then each array's bytes."""
        return [pickle.dumps((self.rank, self.extras, self.stats))] + [getattr(self, a).tobytes() for a in self.ARRAYS]

    @classmethod
    def from_frames(cls, frames: list[bytes]) -> "OutputBatch":
        rank, extras, stats = pickle.loads(frames[0])
        arrays = [np.frombuffer(f, dtype=t) for f, t in zip(frames[1:], cls.DTYPES)]
        return cls(rank, *arrays, extras, stats)

    def rows(self):
        """(handle, tokens, finish reason or None, num_cached, error, logprobs) of each row."""
        ends = np.cumsum(self.counts, dtype=np.int64).tolist()
        tokens = self.tokens.tolist()
        start = 0
        for row, (handle, end, code, cached) in enumerate(zip(self.handles.tolist(), ends, self.finished.tolist(),
                                                               self.num_cached.tolist())):
            error, logprobs = self.extras.get(row, (None, None))
            yield handle, tokens[start:end], _REASONS[code - 1] if code else None, cached, error, logprobs
            start = end


class _PeerWatch:
    """Whether a connected socket's peer went away: ZeroMQ's DISCONNECTED event on it (the peer's end of the TCP
    connection closed: its process exited or was killed; ZeroMQ would reconnect, but a rank never comes back). Set up
    before the socket connects; polled from one thread."""

    def __init__(self, socket: zmq.Socket):
        self._socket = socket
        self._monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.gone = False

    def poll(self) -> bool:
        while not self.gone and self._monitor.poll(0):
            self.gone = recv_monitor_message(self._monitor)["event"] == zmq.EVENT_DISCONNECTED
        return self.gone

    def close(self) -> None:
        """Before the socket closes (a monitor left open holds its context's term())."""
        self._socket.disable_monitor()
        self._monitor.close(linger=0)


class RankLinks:
    """Rank 0's sockets: one PULL from every other rank (bound before they start: its address goes to them), and one
    PUSH to each rank's own inbox (connected once they are ready, `connect`: a connected socket queues what it is
    sent until the rank takes it). Sends may come from any thread (under a lock) and never wait: what a rank's full
    inbox refuses (a rank busy with a long step while requests keep coming) is kept, in order, and sent when it
    takes messages again (`flush`, from the receiving thread). A rank that never does is the engine's to fail: it
    sends nothing either (`LLMEngine._silent_rank`), or its process is gone. `receive` from one thread only."""

    def __init__(self):
        self._context = zmq.Context()
        self._inbox = self._context.socket(zmq.PULL)
        self.address = _bind(self._inbox)
        self._to: dict[int, zmq.Socket] = {}
        self._watches: dict[int, _PeerWatch] = {}  # per rank, whether its inbox's connection dropped
        self._unsent: dict[int, deque] = {}  # per rank, the messages its inbox refused, oldest first
        self._lock = threading.Lock()

    def connect(self, inboxes: dict[int, str]) -> None:
        """Each rank's inbox, as the ranks reported them when ready."""
        for rank, address in inboxes.items():
            socket = self._context.socket(zmq.PUSH)
            socket.setsockopt(zmq.LINGER, 0)
            self._watches[rank] = _PeerWatch(socket)
            socket.connect(address)
            self._to[rank] = socket

    def gone(self) -> list[int]:
        """The ranks whose inbox's connection dropped (from the receiving thread)."""
        return [rank for rank, watch in self._watches.items() if watch.poll()]

    def send(self, rank: int, message) -> None:
        """`message` to `rank`, now or, behind what its inbox refused before, once it takes messages again."""
        with self._lock:
            unsent = self._unsent.setdefault(rank, deque())
            unsent.append(message)
            self._send_unsent(rank, unsent)

    def flush(self) -> int:
        """Send what the ranks' inboxes refused, as far as they take it now; the messages still unsent."""
        with self._lock:
            for rank, unsent in self._unsent.items():
                self._send_unsent(rank, unsent)
            return sum(len(unsent) for unsent in self._unsent.values())

    def _send_unsent(self, rank: int, unsent: deque) -> None:
        socket = self._to[rank]
        while unsent:
            try:
                socket.send_pyobj(unsent[0], zmq.NOBLOCK)
            except zmq.Again:
                return
            unsent.popleft()

    def wake_all(self, but: int | None = None) -> None:
        self._tell_all(Wake(), but)

    def stop_all(self) -> None:
        self._tell_all(Stop())

    def _tell_all(self, message, but: int | None = None) -> None:
        """`message` to every rank but `but` that takes it (a rank gone is left out)."""
        with self._lock:
            for rank, socket in self._to.items():
                if rank != but:
                    try:
                        socket.send_pyobj(message, zmq.NOBLOCK)
                    except zmq.Again:
                        pass

    def receive(self, timeout_s: float) -> OutputBatch | None:
        if not self._inbox.poll(int(timeout_s * 1000)):
            return None
        return OutputBatch.from_frames(self._inbox.recv_multipart(copy=True))

    def close(self) -> None:
        with self._lock:
            self._inbox.close(linger=0)
            for watch in self._watches.values():
                watch.close()
            for socket in self._to.values():
                socket.close(linger=0)
            self._context.term()


class RankLink:
    """A data-parallel rank's sockets: its inbox (bound: its address goes to rank 0 when the rank is ready), and a
    PUSH to rank 0's."""

    def __init__(self):
        self._context = zmq.Context()
        self._inbox = self._context.socket(zmq.PULL)
        self.address = _bind(self._inbox)
        self._outbox = self._context.socket(zmq.PUSH)
        self._outbox.setsockopt(zmq.LINGER, 5000)  # (its last outputs still reach rank 0 when it exits)
        self._rank_0 = _PeerWatch(self._outbox)

    def connect(self, rank_0: str) -> None:
        """Rank 0's inbox, as the ranks' ready barrier gave it."""
        self._outbox.connect(rank_0)

    def receive(self, timeout_s: float | None) -> list:
        """Every message waiting, after waiting up to `timeout_s` for the first (None: as long as it takes)."""
        messages = []
        if self._inbox.poll(None if timeout_s is None else int(timeout_s * 1000)):
            while True:
                try:
                    messages.append(self._inbox.recv_pyobj(zmq.NOBLOCK))
                except zmq.Again:
                    break
        return messages

    def send(self, batch: OutputBatch) -> None:
        self._outbox.send_multipart(batch.frames(), copy=False)

    def rank_0_gone(self) -> bool:
        """Whether the connection to rank 0's inbox dropped (its process, on this node or another, is gone)."""
        return self._rank_0.poll()

    def close(self) -> None:
        self._inbox.close(linger=0)
        self._rank_0.close()
        self._outbox.close()
        self._context.term()


def _bind(socket: zmq.Socket) -> str:
    """Bind `socket` to a free port of this host; the address other nodes reach it at (on one node: loopback). Only
    on that one interface: what comes in is unpickled, so nothing beyond the group's network should reach it."""
    if node_count() == 1:
        return f"tcp://127.0.0.1:{socket.bind_to_random_port('tcp://127.0.0.1')}"
    with _socket.socket(_socket.AF_INET, _socket.SOCK_DGRAM) as probe:  # the interface that reaches rank 0's host
        probe.connect((os.environ["MASTER_ADDR"], 9))
        address = probe.getsockname()[0]
    return f"tcp://{address}:{socket.bind_to_random_port(f'tcp://{address}')}"


MAX_STEP_FAULTS = 10  # a worker rank's steps faulting in a row before it gives up


def serve_rank(core, link: RankLink) -> None:
    """A data-parallel rank's loop (every rank but 0): take in what rank 0 sent, step its engine, send back the step's
    outputs; until `Stop` (or, in lock-step, rank 0's stop agreement), or until its group is broken. Waits for
    messages while it has nothing to do (in lock-step: while every rank is idle)."""
    outbox: list[RequestOutput] = []
    core.send = outbox.extend
    handles: dict[str, int] = {}  # request id -> rank 0's handle
    early: OrderedDict[int, FinishReason] = OrderedDict()  # Cancels of requests whose Arrival has not come (by handle)
    parent, stats_due, faults = os.getppid(), 0.0, 0
    while os.getppid() == parent and not link.rank_0_gone():  # (whose rank 0 is gone, on this node or another, exits)
        for message in link.receive(_wait_s(core)):
            match message:
                case Arrival() as arrival:
                    _admit(core, arrival, handles, outbox)
                    if arrival.handle in early:  # (cancelled before it came: it ends at the next step)
                        core.abort(arrival.request_id, early.pop(arrival.handle))
                    core.sync.wake()
                case Wake():
                    core.sync.wake()
                case Cancel(request_id=request_id, reason=reason, handle=handle):  # (ended meanwhile: nothing to do)
                    if not core.abort(request_id, reason) and handle is not None and request_id not in handles:
                        early[handle] = reason
                        if len(early) > EARLY_CANCELS:
                            early.popitem(last=False)
                case Stop():
                    return
        if not core.sync.ready():
            continue
        active, faults = _step(core, faults)
        if core.stopped:
            return
        now = time.monotonic()
        idle = not active and not core.scheduler.num_awaiting_grammar  # (a compile polls every few ms: not idle)
        stats = core.snapshot() if now >= stats_due or idle else None
        if stats is not None:  # (its grammars: this rank compiles its own requests')
            grammars = core.grammars
            stats |= {"grammars": grammars.stats(), "grammar_compile_seconds": grammars.take_compile_seconds()}
        if outbox or stats is not None:
            link.send(OutputBatch.of(core.rank, outbox, handles, stats))
            for out in outbox:
                if out.finished:
                    handles.pop(out.request_id, None)
            outbox.clear()
            stats_due = now + STATS_EVERY_S if stats is not None else stats_due
        if core.unavailable:  # its group is broken: no step can run again
            return


def _step(core, faults: int) -> tuple[bool, int]:
    """One iteration of the rank's engine, and the faults in a row since: a fault is logged here and the rank serves
    on, as rank 0's loop does (the step's own failures were reported to its requests; the rank's process ending fails
    every rank's). A rank whose every step faults is broken: the MAX_STEP_FAULTS-th in a row ends it (its requests
    would otherwise hang, the rank still answering rank 0)."""
    try:
        return core.step(), 0
    except Exception:
        logger.exception("engine step failed (rank %d)", core.rank)
        if faults + 1 >= MAX_STEP_FAULTS:
            raise
        return True, faults + 1


def _admit(core, arrival: Arrival, handles: dict[str, int], outbox: list[RequestOutput]) -> None:
    seq = arrival.sequence()
    handles[seq.request_id] = arrival.handle
    try:
        core.prepare(seq, arrival.stop_ids)
        core.add(seq)
    except Exception as exc:  # (rank 0 checked it; a grammar this rank cannot compile still ends it here)
        if not isinstance(exc, ValueError):
            logger.exception("admitting request %r failed (rank %d)", seq.request_id, core.rank)
        seq.finish(FinishReason.ERROR)
        outbox.append(RequestOutput.of(seq, [], finished=True,
                                       error=str(exc) if isinstance(exc, ValueError) else f"internal error: {exc}"))


def _wait_s(core) -> float | None:
    """How long the loop may wait for a message: not at all while it has steps to run, a little while a grammar it
    needs compiles, else until one comes (checking now and then that rank 0 lives)."""
    if core.sync.lock_step:
        return 0.0 if core.sync.ready() else 1.0
    if core.busy:
        return 0.0
    return 0.002 if core.scheduler.num_awaiting_grammar else 1.0
