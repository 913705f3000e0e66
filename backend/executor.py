"""Where steps run: the forward and the sampler (or the verifier and the drafts), strictly in step order.

    executor = StepExecutor(runner, kernels, asynchronous=True)
    handle = executor.submit(job)       # asynchronous: returns at once; else after running the step
    output = handle.result()            # StepOutput: the tokens of each sampling row, or the error

Asynchronous (the engine's `overlap_scheduling`), one thread, `dsv4-device`, runs the jobs one after
another: on CUDA it is the thread that launches the kernels (the host thread only enqueues the next
step's metadata copy, so it schedules step N+1 while step N runs), on CPU it is the stand-in for the
CUDA stream (the forward really runs beside the scheduling thread). Otherwise `submit` runs the step
on the caller's thread.

One step path for every layout: the job's `Forward` goes to the runner (backend/runner.py: this process's model,
eager or from a CUDA graph, or every rank of a group; it makes the prefix cache's copies around the forward and
feeds decodes the previous step's tokens), then the sampler draws one token per sampling row and the runner keeps
them for the next step, or, with speculative decoding, the verifier settles each row's drafts and the drafter
proposes the next ones. What runs here is what a GPU step costs the host beside the kernels, so it is kept small: a
step whose rows all decode greedily samples with one argmax. On CUDA the tokens then travel to the host
asynchronously (pinned memory and an event), and `result()` waits for that copy, not for the executor.

Every job runs in the order it was submitted, on one stream: what a step writes is in place before the
next step reads it, and a page or slot freed by the scheduler while a step is in flight is written by
a later step only after that one is done.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from backend.model.comm import RankGroupError
from backend.runner import Forward, ModelRunner
from backend.sampler import HeldStops, Sampler, SamplerState
from backend.scheduler import StepOutput, StepTiming
from backend.speculative import Drafter, SpecJob, Verifier

logger = logging.getLogger(__name__)

# Steps with fewer tokens (decodes, small mixed steps) are thousands of tiny ops: one intra-op thread
# runs them as fast as two on the main thread, while two in a worker thread (a second OpenMP team)
# made them 3.0-3.3x slower (docs/host-loop.md#threads); prefill chunks gain from the cores.
SMALL_STEP_TOKENS = 64


@dataclass
class StepJob:
    forward: Forward  # the batch (on the device, or host tensors for a group), its copies, its static shape
    samplers: list[SamplerState]  # one per sampling row: the batch's first logits rows
    plain_sampling: bool = False  # every row greedy, without penalties or log-probabilities: one argmax
    held_stops: dict[int, HeldStops] = field(default_factory=dict)  # sampling row -> its stop tokens held (min_tokens)
    spec: SpecJob | None = None  # speculative decoding: verify rows, and the draft layer proposes the next drafts
    timing: StepTiming = field(default_factory=StepTiming)  # the step's record of times (its plan's), filled here
    decodes_only: bool = False  # no prefill chunk: its size for the intra-op threads is its rows (not its drafts)


class StepHandle:
    """A submitted step; `result()` blocks until its output is on the host."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._output: StepOutput | None = None
        self._finish = None  # CUDA: waits for the token copy and reads the timing events
        self.exception: BaseException | None = None

    @classmethod
    def failed(cls, exception: BaseException) -> "StepHandle":
        """The handle of a step that could not even be launched (its requests fail like a failed forward's)."""
        handle = cls()
        handle._fail(exception)
        return handle

    def _fail(self, exception: BaseException) -> None:
        self._set(StepOutput(error=f"internal error: {exception}"), exception=exception)

    def _set(self, output: StepOutput | None, finish=None, exception: BaseException | None = None) -> None:
        self._output, self._finish, self.exception = output, finish, exception
        self._done.set()

    def result(self) -> StepOutput:
        self._done.wait()
        if self._finish is not None:
            self._output, self._finish = self._finish(), None
        return self._output


class StepExecutor:
    def __init__(self, runner: ModelRunner, kernels, *, asynchronous: bool, cpu_threads: int,
                 sample_drafts: bool = False, raw_logprobs: bool = True):
        self.runner = runner
        self.device = runner.device
        self.cpu_threads = cpu_threads
        self.small_step_tokens = SMALL_STEP_TOKENS  # steps below this run on one intra-op thread
        self.sampler = Sampler(kernels, raw_logprobs)
        self.verifier, self.drafter = Verifier(self.sampler), Drafter(runner, self.sampler, sample_drafts)
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._exchanged = False  # the step running made every collective it makes (its forward returned; no drafts)
        if asynchronous:
            self._queue = queue.Queue()
            self._thread = threading.Thread(target=self._loop, name="dsv4-device", daemon=True)
            self._thread.start()

    def submit(self, job: StepJob) -> StepHandle:
        handle = StepHandle()
        if self._queue is None:
            self._run(job, handle)
        else:
            self._queue.put((job, handle))
        return handle

    def close(self, timeout: float = 10.0) -> bool:
        """Finish the steps submitted, then stop the thread; False if a step was still running at the timeout."""
        stopped = True
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout)
            stopped = not self._thread.is_alive()
            self._thread = None
        self.sampler.grammars.close()
        return stopped

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            self._run(*item)

    def _run(self, job: StepJob, handle: StepHandle) -> None:
        if self.runner.sync.broken:  # (ranks in lock-step, one of whose steps failed: no collective may follow)
            handle._fail(RankGroupError(self.runner.sync.broken))
            return
        self._exchanged = False
        try:
            handle._set(*self._step(job))
        except Exception as exc:  # noqa: BLE001 (the engine fails the step's requests and keeps serving)
            logger.exception("step failed")
            # (in lock-step, a fault before the step's collectives were all made breaks the group; after, as sampling
            # faults, it is the step's alone)
            handle._fail(exc if self._exchanged else self.runner.sync.step_failed(exc))

    def _step(self, job: StepJob):
        """(the output, None), or (None, a function that waits for the tokens' copy to the host and returns it)."""
        cuda = self.device.type == "cuda"
        started = time.perf_counter()
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
        if job.forward.batch is None:  # data-parallel: the other ranks' step, this rank's part of their exchanges
            return self._idle(job), None
        size = len(job.samplers) if job.decodes_only else job.forward.batch.num_tokens
        _use_intra_op_threads(1 if size < self.small_step_tokens else self.cpu_threads)
        logits, batch = self.runner.forward(job.forward)
        self._exchanged = job.spec is None  # (a verify's draft passes exchange and agree too)
        if job.held_stops:  # (min_tokens: the holds nothing reads the logits unheld for, before anything else)
            firsts = job.spec.first_logits_rows() if job.spec is not None else range(len(job.samplers))
            self.sampler.hold_in_place(logits, list(firsts), job.held_stops)
        if job.spec is not None:
            return self._verify(job, logits, batch, started), None
        num_rows = len(job.samplers)
        output = self.sampler.step(logits[:num_rows], job.samplers, job.plain_sampling, job.timing, job.held_stops)
        tokens = output.sampled
        self.runner.keep_tokens(batch, tokens)
        if not cuda:
            job.timing.duration_s = time.perf_counter() - started
            return output.read_sampled(tokens.tolist()), None
        end.record()
        host = torch.empty(num_rows, dtype=torch.long, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()

        def finish() -> StepOutput:
            copied.synchronize()
            job.timing.duration_s = begin.elapsed_time(end) / 1e3
            return output.read_sampled(host.tolist())

        return None, finish

    def _idle(self, job: StepJob) -> StepOutput:
        self.runner.forward(job.forward)
        if job.spec is not None:
            self.drafter.idle(job.spec)
        return StepOutput(timing=job.timing)

    def _verify(self, job: StepJob, logits: torch.Tensor, batch, started: float) -> StepOutput:
        """Verify the rows' drafts, emit what they accept, propose the next drafts (backend/speculative.py); returns
        when all is done. Where the drafts can follow the verify on the device (one greedy draft a row, a static
        chain: `Drafter.chain_early`), they are launched before the host reads anything, and the host reads the
        verify's argmax, the drafts and the drafts it verified at once: one read a step, no host work between the
        verify and the draft passes; the next verify may then have been scheduled already, its tokens and drafts
        read on the device (overlapped verify steps, backend/engine_core.py)."""
        spec, drafting = job.spec, time.perf_counter()
        argmax = ready = None
        early = self.drafter.chain_early(logits, batch, spec, job.samplers, job.held_stops)
        draft_s = time.perf_counter() - drafting  # (launching it; the read waits for the verify's forward too)
        if early is not None:
            read = torch.cat(early).tolist()  # (the step's one host read)
            argmax, ready = read[:len(early[0])], read[len(early[0]):len(early[0]) + len(early[1])]
            # (a verify scheduled before the one ahead of it was taken in: its drafts were on the device only)
            job.spec = spec = spec.with_verified_drafts(read[len(early[0]) + len(early[1]):])
        output = self.verifier.verify(logits, job.samplers, spec, job.timing, argmax=argmax, held=job.held_stops)
        drafting = time.perf_counter()
        if spec.propose:
            output.drafts = self.drafter.propose(batch, spec, output, job.samplers, ready=ready, held=job.held_stops)
        elif not job.decodes_only:
            self.drafter.keep_window(batch, spec, output)
        job.timing.draft_s = draft_s + time.perf_counter() - drafting
        job.timing.duration_s = time.perf_counter() - started
        return output


_threads_before_engines: int | None = None  # torch's intra-op threads before an engine first changed them


def _use_intra_op_threads(count: int) -> None:
    global _threads_before_engines
    if torch.get_num_threads() != count:
        if _threads_before_engines is None:
            _threads_before_engines = torch.get_num_threads()
        torch.set_num_threads(count)


def default_cpu_threads() -> int:
    """torch's thread count as the process set it: not what an earlier engine's last small step left (a
    second engine in one process would otherwise run its prefills on one thread)."""
    return _threads_before_engines or torch.get_num_threads()
