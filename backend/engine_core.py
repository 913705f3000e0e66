"""One rank's engine: its scheduler over its pools, the batches it builds and the steps it runs.

    core = EngineCore(config, kv, runner, kernels, grammars, send=deliver, rank=r, sync=ALONE)
    core.add(prepared_sequence, max_waiting)     # any thread
    core.abort(request_id)                       # any thread; effective at the next step
    core.step()                                  # its loop's thread: one iteration

The single-rank engine runs one; with data-parallel attention every rank's process runs its own over its own pools
(backend/parallel/data_parallel.py), the same loop:

    schedule step N+1 -> build its batch -> (agree with the other ranks) -> launch it   while step N runs
    wait for step N's output -> the scheduler takes it in -> send its RequestOutputs

so the host's work for a step hides behind the device's work for the step before (overlap scheduling, the
default; the tokens step N samples feed step N+1 on the device: backend/runner.py). With speculative decoding a
verify's emitted count decides where the next step starts: step N+1 is scheduled ahead only where step N leaves its
rows' next tokens and drafts on the device (one greedy draft a row, its chain on the device:
`Drafter.chains_on_device`), as if N accepted every draft; a row of N+1 whose verify in N accepted fewer is void
(dropped at the take-in, backend/scheduler/scheduler.py). Any other step is taken in before the next is scheduled, as
is every step without overlap. `send` receives each step's outputs: on rank 0 the engine hands them to the requests'
consumers; another rank packs them for rank 0.

Ranks whose MoE layers exchange tokens must run every forward together: `sync` (a `LockStep`) makes them agree
before each step on every rank's token count (what the exchange pads to) and on whether any rank still has work; a
rank without a batch then runs the exchanges alone (an idle forward), and when no rank has work they all stop
stepping until rank 0 wakes them. One rank alone, or ranks that never meet, use `ALONE`.
"""

from __future__ import annotations

import copy
import json
import logging
import time
from collections import deque
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch
from tokenizers import Tokenizer

from backend.config import DEFAULT_CHECKPOINT, EngineConfig
from backend.errors import ConfigError
from backend.executor import StepExecutor, StepHandle, StepJob, default_cpu_threads
from backend.model.config import checkpoint_directory, token_ids_problem
from backend.model.forward_batch import BatchRow, build_forward_batch
from backend.model.staging import BatchStager
from backend.model.static_batch import StaticKey, row_bucket, static_key
from backend.model.comm import RankGroupError
from backend.parallel.sync import ALONE, Agreement, StepSync
from backend.request import FinishReason, RequestOutput, Sequence
from backend.runner import Forward, ModelRunner, StepCopies
from backend.sampler import HeldStops, SamplerState
from backend.scheduler import Scheduler, StepOutput, StepPlan, resolve_prefill_chunk_tokens
from backend.speculative import DraftRow, SpecJob
from backend.structured.grammar import GrammarService

logger = logging.getLogger(__name__)

WAITING_POLL_S = 0.001  # in lock-step, while every rank only waits (for a grammar), the agreements' period


class VerifyOverlap:
    """Whether a verify step scheduled before the one in flight is taken in pays, from what the last steps cost.

    With α the share of drafts accepted (one a row), a row emits 1 + α tokens a verify. One step at a time, a step
    costs the host's work h plus the step's own d (the forward, the verify, the draft pass: the executor's); overlapped
    it costs max(h, d), but a verify that rejects its draft voids the next one: (1 + α) / (2 - α) tokens a step. So it
    pays where h + d > (2 - α) max(h, d): a host-bound step (the tiny model on a GPU) gains whenever drafts are
    accepted, a device-bound one (V4-Flash at large batches) only where nearly all are. Exponential averages over the
    steps taken in; one step at a time until MIN_DRAFTS drafts have been verified."""

    MIN_DRAFTS = 16
    DECAY = 0.9  # of the averages, per step

    def __init__(self) -> None:
        self.seen = 0  # drafts verified
        self.drafted = self.accepted = self.host_s = self.device_s = 0.0

    def observe(self, host_s: float, device_s: float, drafted: int, accepted: int) -> None:
        """A verify step taken in: the host's time for it, the step's own, its drafts and those accepted."""
        keep = self.DECAY if self.seen else 0.0
        self.host_s = keep * self.host_s + (1 - keep) * host_s
        self.device_s = keep * self.device_s + (1 - keep) * device_s
        self.drafted, self.accepted = keep * self.drafted + drafted, keep * self.accepted + accepted
        self.seen += drafted

    def pays(self) -> bool:
        if self.seen < self.MIN_DRAFTS or not self.drafted:
            return False
        alpha = self.accepted / self.drafted
        return self.host_s + self.device_s > (2 - alpha) * max(self.host_s, self.device_s)


class SpeculationGate:
    """Whether a step's rows draft for the next step (adaptive_speculation): at each batch size, whichever of verify
    steps and plain decode steps emits more tokens per second, as measured on the steps taken in.

    Kept per row bucket (a static step's: 1, 2, 4, ... rows): exponential averages of each mode's tokens per second (a
    step's tokens over its time from its scheduling to the next step's, or to its take-in where that comes first). A
    bucket drafts for its first MIN_STEPS steps, decodes plainly for the next MIN_STEPS, then follows the faster mode
    (changing where the other is MARGIN faster); every PROBE_INTERVAL steps there the other mode runs MIN_STEPS steps
    again, so a change in acceptance or in cost is seen. Only steady steps are counted: a verify that
    proposes drafts (every row had drafts) or a plain step that proposes none (no row had any), and not the first of
    a mode after the other: the step changing mode costs neither mode's price, and the one after it restarts overlap
    scheduling's pipeline (the first plain step's time is its host work alone, its device time counted in the next).
    While a bucket decodes plainly the draft layer does not run (but over the positions of a step that prefills,
    `Drafter.keep_window`): its window misses those positions, and drafts after it read them stale (fewer accepted)
    until the window has passed them."""

    MIN_STEPS = 8
    PROBE_INTERVAL = 256
    DECAY = 0.8  # of the averages, per step counted
    MARGIN = 0.05  # a bucket changes mode where the other is this much faster (near a tie, changes cost both)

    def __init__(self) -> None:
        self._buckets: dict[int, _GateBucket] = {}

    def drafts(self, num_rows: int) -> bool:
        """Whether the step about to be launched with `num_rows` sampling rows proposes drafts (one decision a step)."""
        return self._bucket(num_rows).decide(self.MIN_STEPS, self.PROBE_INTERVAL, self.MARGIN)

    def will_draft(self, num_rows: int) -> bool:
        """What `drafts(num_rows)` would answer now, deciding nothing (whether to schedule a step before the one in
        flight is taken in depends on it)."""
        return copy.copy(self._bucket(num_rows)).decide(self.MIN_STEPS, self.PROBE_INTERVAL, self.MARGIN)

    def observe(self, num_rows: int, verified: bool, proposed: bool, tokens: int, seconds: float) -> None:
        """A step taken in: whether its rows carried drafts, whether it proposed the next, its tokens, its time."""
        if verified == proposed and seconds > 0:
            self._bucket(num_rows).observe(proposed, tokens / seconds, self.DECAY)

    def _bucket(self, num_rows: int) -> "_GateBucket":
        key = row_bucket(max(1, num_rows))
        if key not in self._buckets:
            self._buckets[key] = _GateBucket()
        return self._buckets[key]


class _GateBucket:
    """One row bucket's measurements and its decisions (SpeculationGate)."""

    def __init__(self) -> None:
        self.rate = {True: 0.0, False: 0.0}  # tokens per second, drafting and plain
        self.counted = {True: 0, False: 0}  # steps counted
        self.since_other = 0  # decisions since the mode not chosen last ran
        self.probe_left = 0  # decisions left of a probe of the other mode
        self.last_seen: bool | None = None  # the mode of the last steady step seen
        self.choice: bool | None = None  # the mode followed (the faster, within the margin)

    def decide(self, min_steps: int, probe_interval: int, margin: float) -> bool:
        for mode in (True, False):  # (a bucket's first steps: each mode measured)
            if self.counted[mode] < min_steps:
                return mode
        faster = self.rate[True] >= self.rate[False]
        if self.choice is None or self.rate[faster] > (1 + margin) * self.rate[self.choice]:
            self.choice = faster
        best = self.choice
        if self.probe_left == 0 and self.since_other >= probe_interval:
            self.probe_left = min_steps + 2  # (its first two steps: not counted)
        if self.probe_left:
            self.probe_left -= 1
            self.since_other = 0
            return not best
        self.since_other += 1
        return best

    def observe(self, mode: bool, rate: float, decay: float) -> None:
        first, self.last_seen = mode != self.last_seen, mode
        if first:
            return
        keep = decay if self.counted[mode] else 0.0
        self.rate[mode] = keep * self.rate[mode] + (1 - keep) * rate
        self.counted[mode] += 1


class EngineCore:
    def __init__(self, config: EngineConfig, kv, runner: ModelRunner, kernels, grammars: GrammarService, *,
                 send: Callable[[list[RequestOutput]], None], rank: int = 0, sync: StepSync = ALONE,
                 elsewhere: Callable[[], bool] = lambda: False):
        """`elsewhere()`: work of other ranks this one knows of (rank 0: the requests it placed there and has not
        had the last output of), which keeps ranks in lock-step agreeing until it is done."""
        self.config, self.kv, self.runner, self.grammars, self.send = config, kv, runner, grammars, send
        self.rank, self.sync, self.elsewhere = rank, sync, elsewhere
        self.num_speculative_tokens = config.num_speculative_tokens
        # With drafts, only one a row leaves the next step's on the device (more: every step is taken in first, but for
        # the plain steps of adaptive_speculation, whatever k), and ranks in lock-step agree on a step's draft passes
        # where it runs: on the loop's own thread
        self.overlap = config.overlap_scheduling and (not self.num_speculative_tokens or (
            not sync.lock_step and (self.num_speculative_tokens == 1 or config.adaptive_speculation)))
        self.scheduler = Scheduler(config, kv, resolve_prefill_chunk_tokens(config, kv),
                                   prefix_cache=kv.prefix_cache, max_steps_in_flight=2 if self.overlap else 1,
                                   rank=rank)
        self.executor = StepExecutor(runner, kernels, asynchronous=self.overlap,
                                     cpu_threads=config.cpu_threads or default_cpu_threads(),
                                     sample_drafts=config.resolved_draft_sampling() == "sample",
                                     raw_logprobs=config.logprobs_mode == "raw_logprobs")
        self._stager = BatchStager(runner.device, depth=2)
        self.verify_overlap = VerifyOverlap()  # whether verify steps are scheduled ahead (k = 1, chains on the device)
        # whether a step drafts at all (adaptive_speculation; ranks in lock-step agree on every draft pass: they draft)
        self.gate = (SpeculationGate() if config.adaptive_speculation and self.num_speculative_tokens
                     and not sync.lock_step else None)
        self._last_started = 0.0  # where the last step's scheduling began (the gate's step times)
        # launched, not taken in yet: each iteration's steps (its own, and its part of other ranks' when it had none)
        self._in_flight: deque[list[tuple[StepPlan | None, StepHandle]]] = deque()
        self.unavailable: str | None = None  # why this rank can no longer step (its group is broken)
        self.stopped = False  # rank 0 ended the lock-step: this rank's loop is over

    # --- any thread ---------------------------------------------------------------------------------
    def prepare(self, seq: Sequence, stop_ids: frozenset[int]) -> None:
        """What a request needs on the rank that serves it: its stop ids, its grammar (parsed now: a bad one raises
        ValueError; compiled on the grammar threads) and its sampler state."""
        seq.stop_ids = stop_ids
        if seq.sampling.guided_decoding is not None:
            seq.grammar = self.grammars.prepare(seq.sampling.guided_decoding)
        seq.sampler_state = SamplerState(seq.sampling, seq.prompt_ids, seq.grammar)

    def add(self, seq: Sequence, max_waiting: int | None = None) -> bool:
        return self.scheduler.add(seq, max_waiting=max_waiting)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.CANCELLED) -> bool:
        return self.scheduler.abort(request_id, reason)

    # --- the loop's thread ----------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """Work of its own: requests, aborts to report, steps in flight."""
        return bool(self._in_flight) or self.scheduler.has_work()

    def step(self) -> bool:
        """One iteration: schedule and launch a step, take in the output of the one launched before it (with
        overlap) or of this one. Returns whether to go on: this rank (in lock-step: some rank) had work."""
        if not self.sync.ready():  # every rank went idle: none agrees again until woken (LockStep)
            return False
        ahead = drained = stays_plain = False
        if self._in_flight and self.num_speculative_tokens:
            ahead, drained, stays_plain = self._before_scheduling()
            if drained:
                self._take_in_all(self._in_flight.popleft())
        started = time.perf_counter()
        plan = self.scheduler.schedule(ahead=ahead)
        if plan is not None:
            plan.started = self._last_started = started
            plan.proposes_drafts = not stays_plain  # (else the gate decides as the step is built: `_spec_job`)
        for seq in plan.aborted if plan is not None else ():
            self._report_end(seq)
        job, build_error = self._job(plan) if plan is not None and plan.chunks else (None, None)
        agreed, broken = self._agree(job.forward.batch.num_tokens if job is not None else 0)
        if agreed.stop:
            self.stopped = True
            return False
        launched = self._launch(plan, job, build_error or broken, agreed)
        if launched and plan is not None:
            plan.timing.host_s = time.perf_counter() - started
        took_in = bool(self._in_flight)
        if launched and self.overlap:  # (kept before any take-in: a fault there must not lose the step in flight)
            self._in_flight.append(launched)
        if took_in:
            self._take_in_all(self._in_flight.popleft())
        if launched and not self.overlap:
            self._take_in_all(launched)
        if self.sync.lock_step and agreed.has_work and not agreed.stepped and not took_in:
            time.sleep(WAITING_POLL_S)  # every rank waits (a grammar compiling): agree again a little later
        return agreed.has_work or drained

    def _before_scheduling(self) -> tuple[bool, bool, bool]:
        """With speculation and a step in flight: (the next step is a verify scheduled before that one is taken in,
        that one is taken in first, the next step stays plain).

        A verify step's output decides where the next starts: the next is scheduled ahead only as a verify that leaves
        its drafts on the device (`VerifyOverlap`, `Scheduler.can_schedule_ahead`), so only where the gate will let its
        rows draft; otherwise the verify is taken in first. After a plain step (`SpeculationGate`) the next is
        scheduled as without speculation, but a step drafting more than one token a row builds its chained passes on
        the executor's thread from its rows' pages, which the take-in of the step in flight may free: with k > 1 the
        step in flight is taken in first where the gate will have the next step draft, and otherwise the next step
        stays plain, whatever its rows' bucket would say once built."""
        rows = self.scheduler.num_running  # (a step scheduled ahead has a row for each)
        if not self._plain_in_flight():
            ahead = (self.verify_overlap.pays() and self.scheduler.can_schedule_ahead()
                     and (self.gate is None or self.gate.will_draft(rows)))
            return ahead, not ahead, False
        if self.num_speculative_tokens == 1:
            return False, False, False
        drafts = self.gate.will_draft(rows)
        return False, drafts, not drafts

    def _plain_in_flight(self) -> bool:
        """The step in flight neither verifies nor drafts (`SpeculationGate`): the next is scheduled as without
        speculation."""
        return all(plan is not None and plan.plain_decoding for plan, _ in self._in_flight[-1])

    def close(self, timeout: float) -> bool:
        """False if a step was still running at the timeout."""
        stopped = self.executor.close(timeout)
        self.scheduler.close()
        return stopped

    def fail_all(self, reason: str) -> None:
        """The rank can step no more: every live request ends with `reason` at the next step."""
        self.unavailable = reason
        self.scheduler.abort_all(FinishReason.ERROR)

    def snapshot(self) -> dict:
        """This rank's counters, requests, pools and prefix cache (what the engine's stats add up); the pages live
        requests hold only when none runs (that walks every page: not at every step of a busy rank)."""
        scheduler, kv = self.scheduler, self.kv
        return {"rank": self.rank, "counters": scheduler.counters, "num_running": scheduler.num_running,
                "num_waiting": scheduler.num_waiting, "num_steps": scheduler.counters.num_steps,
                "pool_usage": kv.usage(), "pages_used": kv.pages_used(),
                "pages_held_by_requests": None if scheduler.num_running else kv.pages_held_by_requests(),
                "prefix_cache": kv.prefix_cache.snapshot_stats() if kv.prefix_cache is not None else None}

    # --- a step ---------------------------------------------------------------------------------------
    def _agree(self, num_tokens: int) -> tuple[Agreement, RankGroupError | None]:
        """The ranks' agreement on this step (alone: this rank's own); a broken group fails every request."""
        has_work = self.busy or (self.sync.lock_step and (self.scheduler.num_awaiting_grammar > 0 or self.elsewhere()))
        try:
            return self.sync.agree(num_tokens, has_work), None
        except RankGroupError as exc:
            self.fail_all(str(exc))
            return Agreement((num_tokens,), has_work), exc

    def _launch(self, plan: StepPlan | None, job: StepJob | None, failure: Exception | None,
                agreed: Agreement) -> list[tuple[StepPlan | None, StepHandle]]:
        """What this iteration runs: its step (or, one that failed before it could run, the failure that ends its
        requests), or, other ranks in lock-step stepping without it, its part of their MoE exchanges."""
        runs = job is not None and failure is None
        launched = []
        if plan is not None and plan.chunks:
            launched.append((plan, self._submit(job, agreed.counts) if runs else StepHandle.failed(failure)))
        if not runs and agreed.stepped and self.sync.lock_step and not self.unavailable:
            idle = Forward(None, dp_token_counts=agreed.counts)
            launched.append((None, self.executor.submit(StepJob(idle, [], spec=SpecJob.idle(
                self.num_speculative_tokens)))))
        return launched

    def _submit(self, job: StepJob, counts: tuple[int, ...]) -> StepHandle:
        if len(counts) > 1:  # the MoE exchange pads every rank to the largest
            job.timing.dp_padding_tokens = len(counts) * max(counts) - sum(counts)
            job.forward = replace(job.forward, dp_token_counts=counts)
        return self.executor.submit(job)

    def _job(self, plan: StepPlan) -> tuple[StepJob | None, Exception | None]:
        """The step's job, or (the step is committed: its requests fail when it is taken in) why it could not be
        built."""
        try:
            return self._build(plan), None
        except Exception as exc:
            logger.exception("building step %s (rank %d) failed", plan.step_index, self.rank)
            return None, exc

    def _build(self, plan: StepPlan) -> StepJob:
        """The step's batch, built on the host over this rank's pages, with what the executor needs to run it."""
        rows, samplers, from_device, plain, copies_after, held = [], [], False, True, [], {}
        raw_logprobs = self.executor.sampler.raw_logprobs
        for chunk in plan.chunks:  # (once per row every step: plain local reads)
            seq, start, drafts = chunk.seq, chunk.start, chunk.drafts
            end = start + chunk.num_tokens
            # else the token of the step in flight (with drafts: the tokens a verify in flight chained)
            known = (end <= len(seq.token_ids) or bool(drafts)) and not chunk.optimistic
            from_device |= not known
            snapshots = ()
            if chunk.snapshots:  # inside the chunk: written by its plan; where it ends: copied after the forward
                snapshots = tuple((r.position, r.slot) for r in chunk.snapshots if r.copy_after is None)
                copies_after += [r.copy_after for r in chunk.snapshots if r.copy_after is not None]
            if not known:  # stand-ins, read on the device
                tokens = [0] * (1 + len(drafts))
            else:
                tokens = seq.token_ids[start:start + 1] + list(drafts) if drafts else seq.token_ids[start:end]
            rows.append(BatchRow(seq.pages, tokens, start, chunk.samples, snapshots, not known, 1 + len(drafts)))
            if chunk.samples:
                state = seq.sampler_state
                # (its logits rows draw the outputs from the one after its last token on: a verify's last token is
                # the one at `start`, any other row's the chunk's last)
                first_output = (start + 1 if drafts else end) - len(seq.prompt_ids)
                hold = HeldStops.of(state, seq.stop_ids, first_output, 1 + len(drafts), raw_logprobs)
                if hold is not None:
                    held[len(samplers)] = hold
                samplers.append(state)
                plain &= state.plain and (hold is None or hold.in_place)
        graphs = self.runner.graphs
        key = static_key(rows) if graphs is not None and graphs.accepts(rows) else None
        plan.timing.static_shape = key is not None
        spec = self._spec_job(plan, key, len(samplers)) if self.num_speculative_tokens else None
        plan.chains_on_device = (spec is not None and self.overlap
                                 and self.executor.drafter.chains_on_device(spec, samplers, held))
        # (a step scheduled ahead is its rows' verifies alone, as the one before it: its executor's work reads no
        # request's pages, which the take-in of the step before may free meanwhile)
        assert plan.chains_on_device or not any(chunk.optimistic for chunk in plan.chunks), \
            "a step scheduled ahead of the one in flight must leave its drafts on the device too"
        batch = build_forward_batch(rows, self.kv, pad_to=key)
        cache = self.kv.prefix_cache
        pending = cache.take_pending() if cache is not None else []
        try:
            forward = self._forward(batch, StepCopies(pending, copies_after), key, from_device)
        except BaseException:
            if cache is not None:  # (the snapshots of entries already made must still be saved: the next step does)
                cache.requeue_saves(pending)
            raise
        return StepJob(forward, samplers, plain, held, spec, plan.timing, decodes_only=not plan.num_prefill_tokens)

    def _forward(self, batch, copies: StepCopies, key, reads_previous_tokens: bool) -> Forward:
        """The step's Forward (backend/runner.py). A group's batch goes out as host tensors; otherwise a dynamic step's
        is packed and copied to the device from here (ordered after the steps launched before it), a static one's
        packed for the runner to copy into its graph's buffers, in step order."""
        sent = self.runner.sends_host_batches
        staged = self._stager.stage(batch) if not sent or key is not None else None
        if key is None and not sent:
            batch = self._stager.to_device(staged)
        return Forward(batch, copies, key, staged, reads_previous_tokens)

    def _spec_job(self, plan: StepPlan, key: StaticKey | None, num_rows: int) -> SpecJob | None:
        """What the draft layer needs of a step (backend/speculative.py): each position's next token where the host
        knows it (-1 where this step emits it), each sampling row's drafts, positions and pages, the step's static
        shape (`key`: its drafts may then come from one static chain), whether it proposes the next step's drafts
        (`gate`); None for a step of decodes that neither verifies nor proposes (a plain step; one that prefills keeps
        its positions in the draft layer's window: `Drafter.keep_window`)."""
        drafts = self.gate is None or self.gate.drafts(num_rows)  # (one decision a step, kept or not)
        # (False already: kept plain as it was scheduled, `_before_scheduling`; a verify scheduled ahead drafts, as the
        # gate said it would before it was scheduled)
        plan.proposes_drafts = plan.proposes_drafts and (drafts or any(chunk.optimistic for chunk in plan.chunks))
        if plan.plain_decoding:
            return None
        next_ids, rows = [], []
        for chunk in plan.chunks:
            seq = chunk.seq
            if chunk.drafts:
                next_ids += [-1] * chunk.num_tokens
            else:
                following = seq.token_ids[chunk.start + 1:chunk.end + 1]
                next_ids += following + [-1] * (chunk.num_tokens - len(following))
            if chunk.samples:
                rows.append(DraftRow(seq.request_id, seq.pages, chunk.drafts, chunk.end - 1 - len(chunk.drafts),
                                     chunk.start + chunk.allocated))
        return SpecJob(torch.tensor(next_ids, dtype=torch.long), rows, self.num_speculative_tokens, key,
                       plan.proposes_drafts)

    def _take_in_all(self, launched: list[tuple[StepPlan | None, StepHandle]]) -> None:
        for plan, handle in launched:
            self._take_in(plan, handle)

    def _take_in(self, plan: StepPlan | None, handle: StepHandle) -> None:
        """A step's output: the scheduler's accounting, then each request's tokens (or its failure). An idle step
        (`plan` None) has no output, but may have failed the group."""
        try:
            output = handle.result()
        except Exception as exc:  # (CUDA: the token copy's wait, where an asynchronous device fault surfaces)
            logger.exception("reading step %s's output failed", plan.step_index if plan is not None else "(idle)")
            output = StepOutput(error=f"internal error: {exc}")
        if isinstance(handle.exception, RankGroupError):  # no later step can run: end every request
            self.fail_all(str(handle.exception))
        if plan is None:
            return
        if output.error is not None:
            logger.error("step %s failed (%s); failing its %d requests", plan.step_index, output.error,
                         len(plan.chunks))
        taking_in, counters = time.perf_counter(), self.scheduler.counters
        drafted, accepted = counters.num_draft_tokens, counters.num_accepted_tokens
        outputs = self.scheduler.update_from_output(plan, output)
        self.send(outputs)
        if output.error is None and plan.chains_on_device:  # (what overlapping the next verify would gain)
            self.verify_overlap.observe(plan.timing.host_s + time.perf_counter() - taking_in,
                                        output.timing.duration_s, counters.num_draft_tokens - drafted,
                                        counters.num_accepted_tokens - accepted)
        if output.error is None and self.gate is not None and not plan.num_prefill_tokens:
            verifies = [bool(chunk.drafts) for chunk in plan.chunks if chunk.samples]
            if all(verifies) or not any(verifies):  # (rows of one mode: a steady step, if it proposed alike)
                # (its time: to the next step's start where that was scheduled before it was taken in)
                ended = self._last_started if self._last_started > plan.started else time.perf_counter()
                self.gate.observe(len(verifies), all(verifies), plan.proposes_drafts,
                                  sum(len(out.new_token_ids) for out in outputs), ended - plan.started)

    def _report_end(self, seq: Sequence) -> None:
        """The final output of a request the scheduler ended (cancelled, timed out or failed)."""
        error = self.unavailable  # (the rank can step no more: every request it ends, ends with why)
        if seq.finish_reason is FinishReason.ERROR:
            error = seq.error or error or "the request no longer fits in the memory pools"
        self.send([RequestOutput.of(seq, [], finished=True, error=error)])


def tokenizer_directory(config: EngineConfig) -> Path:
    """Where the tokenizer is: the checkpoint's directory; with load_format=dummy and no tokenizer.json there, the
    built-in checkpoint's. Its vocabulary may then be smaller than the model's (512 against V4's 129,280): the ids
    beyond it are served as ids, and decode to no text (tokenizers skips ids it does not know)."""
    directory = checkpoint_directory(config.checkpoint)
    if config.load_format == "dummy" and not (directory / "tokenizer.json").is_file():
        logger.warning("no tokenizer.json in %s: using the built-in checkpoint's (%s)", directory, DEFAULT_CHECKPOINT)
        return DEFAULT_CHECKPOINT
    return directory


def load_tokenizer(directory: Path, vocab_size: int, built_in: bool) -> Tokenizer:
    """The tokenizer.json in `directory`, whose ids must all be the model's (an id past its vocabulary would fail every
    request whose text holds it). `built_in`: the built-in checkpoint's, standing in for a dummy model's; its ids
    past a smaller vocabulary are left to the requests that reach them."""
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(f"{path}: no such tokenizer file (the checkpoint's directory must hold its tokenizer.json)")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # (tokenizers raises its own Exception, naming no file)
        raise ConfigError(f"{path}: not a tokenizer the tokenizers library reads ({exc})") from None
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size > vocab_size and not built_in:
        raise ConfigError(f"{path}: the tokenizer has {size} ids, the model's vocabulary only {vocab_size} "
                          "(config.json's vocab_size): a tokenizer of another model?")
    return tokenizer


def eos_token_ids(config: EngineConfig, model_config) -> list[int]:
    """The ids that end a request: generation_config.json's eos_token_id where it has one (as transformers' generate
    reads it), else config.json's; an eos_token_id in hf_overrides wins over both."""
    path = checkpoint_directory(config.checkpoint) / "generation_config.json"
    if "eos_token_id" in (config.hf_overrides or {}) or not path.is_file():
        return model_config.eos_token_ids
    try:
        generation = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(generation, dict):
        raise ConfigError(f"{path}: must hold a JSON object, not {type(generation).__name__}")
    eos = generation.get("eos_token_id")
    if eos is None:
        return model_config.eos_token_ids
    ids = eos if isinstance(eos, list) else [eos]
    if problem := token_ids_problem("eos_token_id", ids, model_config.vocab_size):
        raise ConfigError(f"{path}: {problem}")
    return ids


def grammar_service(config: EngineConfig, model_config) -> GrammarService:
    """The grammars of the requests a rank serves, compiled on its own threads."""
    return GrammarService(tokenizer_directory(config) / "tokenizer.json", vocab_size=model_config.vocab_size,
                          stop_token_ids=eos_token_ids(config, model_config),
                          compile_timeout_s=config.grammar_compile_timeout_s)
