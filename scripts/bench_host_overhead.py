#!/usr/bin/env python3
"""The engine's host work per decode step, with the device taken out: what a GPU would leave the host to do.

    python scripts/bench_host_overhead.py --repeats 3 --json results/host_overhead.json

Two measurements, each repeated (--repeats) in one process, the spread reported:

1. Host time per decode step. The tiny checkpoint's forward is replaced by a stub that returns logits at
   once, so a step's time is the engine's own work: schedule, build and pack the batch, launch, sample,
   take the output in, report every token (to a queue, as the Triton adapter's callback does). For each
   running requests x context in --rows x --contexts the requests are prefilled (through the engine, with
   the stub), then --steps decode steps are timed one by one; the table gives the median over
   repetitions of each configuration's median step, and the min-max. Each repetition measures every
   configuration in turn (the machine's drift hits them alike), and the growth with context is the ratio
   of the largest to the smallest context in the same repetition. Overlap off: every step's work on one
   thread. Overlap on: the same work, the forward side on the executor thread (with a stub forward the
   hand-over between the two threads is all overlap adds). --cuda-graphs: the decode steps at static shapes, as a
   GPU runs them (padded, packed into the graphs' buffers; off CUDA the recorded closure runs the stub).
   --num-speculative-tokens 0 1 2: each configuration also with verify steps of k drafts a row (the draft layer a
   stub as well, every draft accepted; k = 1 with overlap too, where --cuda-graphs' static steps let the next verify
   be scheduled before the one in flight is taken in, more drafts without): what a verify step and its
   drafts cost the host, beside a decode step's (k = 0).
2. Steps (and tokens) per second with a device stand-in: the forward sleeps --device-ms (the GIL released, as on
   a GPU stream) at --sleep-rows x --sleep-context, overlap on and off. Without overlap a step costs device +
   host; with it, max(device, host). With --num-speculative-tokens 1 (and --cuda-graphs: static steps, whose drafts
   the device chains) verify steps too, every draft accepted: overlapped, the next verify is scheduled before the
   one in flight is taken in (backend/engine_core.py). With --real-forward the model's own forward runs instead (on a GPU:
   what overlap gains for real).
3. Rank 0's host time per decode step with data-parallel ranks (--data-parallel-sizes, e.g. 1 2): every rank
   --dp-rows requests at --dp-context, the stub forward in every rank's process, over gloo; the ranks alone (whole
   experts: they never meet) and with expert parallelism over them (they agree on every step: the step's time
   includes waiting for that agreement, printed beside it). Each rank runs its own engine, so rank 0's step should
   cost what one rank's does: the ratio to data_parallel_size 1 is printed.
4. The same on paper for more ranks than the machine holds (--simulate-ranks, e.g. 1 2 4 8): one engine at
   --dp-rows requests, and for each other rank simulated, --dp-rows outputs a step packed as a rank packs them
   (backend/parallel/data_parallel.py OutputBatch), unpacked and passed on by rank 0's receiving thread as it
   would; rank 0's engine-thread step time, the receiving thread's time per step, and the bytes a rank sends per
   request.

5. Inter-token gaps while requests come and go (--churn-seconds, e.g. 30): --churn-rows requests always running (a
   finished one replaced at once by a new one, prompts of 64-1,024 tokens, 32-512 tokens out), the engine serving
   on its own thread as under tritonserver, the stub forward; each request's gaps between consecutive tokens (median,
   p99, p99.9, max) and the collector's full (generation-2) collections meanwhile, with the start-up heap frozen as
   the engine serves (backend/host_memory.py) and thawed right after start, in turn within each repetition, the
   same requests in both.

Prefix caching is on, as by default (decodes reaching block boundaries are snapshotted; each snapshot
references the request's compressed pages, a cost that grows with the context: --no-enable-prefix-caching
shows it). Each configuration's
pools are sized for it (--dtype bfloat16 halves them). --device cuda runs the same on a GPU (scripts/gpu_check.sh).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import queue
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backend.config import EngineConfig  # noqa: E402
from backend.engine import LLMEngine, Placement  # noqa: E402
from backend.host_memory import thaw_heap  # noqa: E402
from backend.model.deepseek_v4 import DeepseekV4Model  # noqa: E402
from backend.parallel.data_parallel import OutputBatch  # noqa: E402
from backend.request import RequestOutput, SamplingParams, Sequence  # noqa: E402
from scripts.checkpoint_flags import add_checkpoint_flags, checkpoint_settings  # noqa: E402

PREFILL_CHUNK = 65536
WARM_UP_STEPS = 64
# Data-parallel ranks are processes of their own (spawned: they import this script again); this variable tells them
# to take the stub forward too.
STUB_VOCAB = "DSV4_BENCH_STUB_VOCAB"


def stub_forward(vocab: int, device, device_s: float = 0.0, streams: tuple[int, int] | None = None):
    """A forward that returns zero logits for the rows that want them, after `device_s` of sleep; with `streams`
    (hc_mult, hidden size), also zero residual streams when asked for them (speculative decoding's verify steps)."""

    def forward(batch, kv, return_streams=False, **_):
        if device_s:
            time.sleep(device_s)
        logits = torch.zeros(batch.logits_token_index.shape[0], vocab, device=device)
        if return_streams:
            return logits, torch.zeros(batch.num_tokens, *streams, device=device)
        return logits

    return forward


def stub_draft(vocab: int, device, streams: tuple[int, int]):
    """The draft layer's pass as a stub: zero logits (every draft is token 0, which the zero target logits accept:
    each verify emits 1 + k tokens) and zero streams."""

    def draft(batch, kv, hidden, logits_index, j=0):
        return (torch.zeros(logits_index.shape[0], vocab, device=device),
                torch.zeros(batch.num_tokens, *streams, device=device))

    return draft


def stub_every_forward(vocab: int) -> None:
    """Every model of this process (and, through the environment, of the ranks it spawns) takes the stub forward:
    zero logits at once, no MoE exchange (the ranks still agree on every step)."""
    os.environ[STUB_VOCAB] = str(vocab)
    DeepseekV4Model.forward = lambda self, batch, kv, **_: torch.zeros(batch.logits_token_index.shape[0], vocab,
                                                                        device=self.device)
    DeepseekV4Model.idle_forward = lambda self, counts, draft=False: None


if STUB_VOCAB in os.environ:  # a data-parallel rank spawned by part 3
    stub_every_forward(int(os.environ[STUB_VOCAB]))


def engine_config(options, rows: int, context: int, overlap: bool, device_s: float | None = 0.0,
                  speculative_tokens: int = 0, **layout) -> EngineConfig:
    """An engine for `rows` requests of `context` tokens (on each data-parallel rank of `layout`), `speculative_tokens`
    drafts a decode."""
    window = 4 * (PREFILL_CHUNK + 256)  # the window pool: one chunk in flight and its window, and the decodes'
    # the prompts, what prefill steps decode meanwhile, the warm-up and the timed steps
    num_tokens = rows * (context + 2 * rows + WARM_UP_STEPS + options.steps + 64) + 4096
    return EngineConfig(**checkpoint_settings(options), device=options.device, dtype=options.dtype,
                        max_running_requests=rows, max_num_batched_tokens=PREFILL_CHUNK,
                        prefill_chunk_tokens=PREFILL_CHUNK, num_tokens=num_tokens,
                        swa_full_tokens_ratio=min(1.0, (window + rows * 256) / num_tokens),
                        overlap_scheduling=overlap, cpu_threads=1,
                        enable_prefix_caching=options.enable_prefix_caching,
                        num_speculative_tokens=speculative_tokens,
                        # a stub forward is host work only: a CUDA graph would capture it once and skip its sleep
                        # (--cuda-graphs: the static steps' host work, with no sleep to skip)
                        cuda_graphs=options.cuda_graphs if device_s is not None else None, **layout)


def make_engine(options, rows: int, context: int, overlap: bool, device_s: float | None = 0.0,
                speculative_tokens: int = 0) -> LLMEngine:
    """An engine for `rows` requests of `context` tokens; its forward (and draft layer) a stub sleeping `device_s`
    (None: the model's own)."""
    engine = LLMEngine(engine_config(options, rows, context, overlap, device_s, speculative_tokens))
    if device_s is not None:
        streams = (engine.model.config.hc_mult, engine.model.config.hidden_size)
        engine.model.forward = stub_forward(engine.vocab_size, engine.device, device_s, streams)
        engine.model.draft = stub_draft(engine.vocab_size, engine.device, streams)
    return engine


def decoding(engine: LLMEngine, rows: int, context: int, steps: int) -> queue.SimpleQueue:
    """`rows` requests of `context` prompt tokens, prefilled; returns the queue their outputs go to."""
    outputs: queue.SimpleQueue = queue.SimpleQueue()
    submit_all(engine, rows, context, outputs.put)
    while engine.scheduler.num_waiting or any(s.is_prefill for s in engine.scheduler._running):
        engine.step()
    for _ in range(WARM_UP_STEPS):  # every request decoding, overlap's pipeline full, the prefill's cache churn past
        engine.step()
    assert engine.scheduler.num_running == rows
    return outputs


def time_steps(engine: LLMEngine, steps: int, clock=time.perf_counter) -> list[float]:
    """Each step's time on `clock` (time.thread_time: the engine thread's CPU time, what it did itself, whatever
    other processes take of the cores meanwhile)."""
    times = []
    for _ in range(steps):
        started = clock()
        engine.step()
        times.append(clock() - started)
    return times


def host_per_step(options, rows: int, context: int, overlap: bool, speculative_tokens: int) -> float:
    engine = make_engine(options, rows, context, overlap, speculative_tokens=speculative_tokens)
    try:
        decoding(engine, rows, context, options.steps)
        times = time_steps(engine, options.steps)
        assert all(r.kind.value == "decode" for r in list(engine.scheduler.records)[-options.steps:])
        return statistics.median(times)
    finally:
        engine.shutdown()


def steps_per_second(options, overlap: bool, speculative_tokens: int = 0) -> tuple[float, float]:
    """(steps/s, tokens/s) of --steps decode (or verify) steps with the device stand-in."""
    device_s = None if options.real_forward else options.device_ms / 1e3
    engine = make_engine(options, options.sleep_rows, options.sleep_context, overlap, device_s, speculative_tokens)
    try:
        outputs = decoding(engine, options.sleep_rows, options.sleep_context, options.steps)
        while not outputs.empty():  # (the prefills' and the warm-up's tokens)
            outputs.get()
        started = time.perf_counter()
        time_steps(engine, options.steps)
        elapsed = time.perf_counter() - started
        tokens = 0
        while not outputs.empty():
            tokens += len(outputs.get().new_token_ids)
        return options.steps / elapsed, tokens / elapsed
    finally:
        engine.shutdown()


def prompts(count: int, context: int) -> list[list[int]]:
    """Distinct prompts (nothing restored from the prefix cache), their lengths staggered so that decodes reach the
    cache's block boundaries at the same rate (count / 128 a step) at every context."""
    prompt = [2 + i % 250 for i in range(context)]
    return [[2 + r % 250] + prompt[1:context - r % 128] for r in range(count)]


def submit_all(engine: LLMEngine, count: int, context: int, on_output) -> None:
    params = SamplingParams(max_tokens=min(engine.limits.max_request_positions - context,
                                           engine.limits.max_tokens_limit), ignore_eos=True)
    for r, prompt in enumerate(prompts(count, context)):
        engine.submit(Sequence(f"r{r}-{time.monotonic_ns()}", prompt, params), on_output)


def rank0_host_per_step(options, ranks: int, expert_parallel: bool) -> tuple[float, float, float]:
    """Part 3: rank 0's median decode step (wall time), the median time of it spent waiting for the ranks'
    agreement, and its median CPU time on the engine thread, with --dp-rows requests on each of `ranks` data-parallel
    ranks (`expert_parallel`: over them too, the ranks agree on every step), every rank's forward the stub."""
    from backend.model.config import load_model_config

    stub_every_forward(load_model_config(checkpoint_settings(options)["checkpoint"]).vocab_size)
    layout = dict(data_parallel_size=ranks, expert_parallel_size=ranks if expert_parallel else 1) if ranks > 1 else {}
    engine = LLMEngine(engine_config(options, options.dp_rows, options.dp_context, True, **layout))
    waits = _timed(engine.core.sync, "agree") if engine.core.sync.lock_step else []  # (not the shared ALONE)
    seen: dict[str, int] = {}
    lock = threading.Lock()

    def count(out: RequestOutput) -> None:
        with lock:
            seen[out.request_id] = seen.get(out.request_id, 0) + 1

    try:
        submit_all(engine, options.dp_rows * ranks, options.dp_context, count)
        while len(seen) < options.dp_rows * ranks:  # every request on every rank has its first token
            engine.step()
        for _ in range(WARM_UP_STEPS):
            engine.step()
        assert engine.scheduler.num_running == options.dp_rows
        waits.clear()
        step = statistics.median(time_steps(engine, options.steps))
        waited = statistics.median(waits) if waits else 0.0
        return step, waited, statistics.median(time_steps(engine, options.steps, time.thread_time))
    finally:
        engine.shutdown()


def _timed(obj, name: str) -> list[float]:
    """The times of every call of obj.name from now on (on the instance)."""
    times, call = [], getattr(obj, name)

    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            times.append(time.perf_counter() - started)

    setattr(obj, name, timed)
    return times


def simulated_rank0(options, ranks: int) -> dict:
    """Part 4: one engine at --dp-rows decoding requests, and `ranks - 1` more ranks' outputs (--dp-rows requests, one
    token each) arriving every step, packed as a rank sends them, unpacked and passed on by a receiving thread as rank
    0's is: rank 0's engine-thread step, the receiving thread's time per step, a rank's bytes per request."""
    from backend.engine import DataParallelRank

    rows, context = options.dp_rows, options.dp_context
    engine = make_engine(options, rows, context, overlap=True)
    try:
        sink = decoding(engine, rows, context, options.steps)
        frames = [_simulated_rank(engine, DataParallelRank(r), rows, context, sink) for r in range(1, ranks)]
        stepped, done, receiving = threading.Event(), threading.Event(), []

        def receive() -> None:  # what rank 0's dsv4-ranks thread does with each rank's outputs of a step
            while not done.is_set():
                if stepped.wait(0.1):
                    stepped.clear()
                    started = time.perf_counter()
                    for rank_frames in frames:
                        engine._take_outputs(OutputBatch.from_frames(rank_frames))
                    receiving.append(time.perf_counter() - started)

        receiver = threading.Thread(target=receive, daemon=True)
        receiver.start()
        times, cpu = [], []
        for _ in range(options.steps):
            started, started_cpu = time.perf_counter(), time.thread_time()
            engine.step()
            times.append(time.perf_counter() - started)
            cpu.append(time.thread_time() - started_cpu)
            stepped.set()
        done.set()
        receiver.join()
        sent = sum(len(f) for f in frames[0]) / rows if frames else 0.0
        return {"engine_ms": 1e3 * statistics.median(times), "engine_cpu_ms": 1e3 * statistics.median(cpu),
                "receiving_ms": 1e3 * statistics.median(receiving) if receiving else 0.0, "bytes_per_request": sent}
    finally:
        engine.shutdown()


def _simulated_rank(engine: LLMEngine, rank, rows: int, context: int, sink) -> list[bytes]:
    """A simulated rank's requests placed on it (as rank 0 places them), and one step's outputs of theirs, packed."""
    engine.ranks.append(rank)
    outputs, handles = [], {}
    for r in range(rows):
        request_id = f"rank{rank.rank}-{r}"
        placed = Placement(rank, context, sink.put, request_id, context, next(engine._handles))
        with engine._placement_lock:
            engine._placed[request_id] = engine._by_handle[placed.handle] = placed
        handles[request_id] = placed.handle
        outputs.append(RequestOutput(request_id, [7 + r % 100], "", False, None, context, 1))
    return OutputBatch.of(rank.rank, outputs, handles).frames()


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def stand_in(options, results: dict) -> None:
    """Part 2: decode steps, and with --num-speculative-tokens 1 verify steps (the draft layer a stub, every draft
    accepted), overlap off and on, in turn within each repetition."""
    configs = [(k, overlap) for k in sorted({0} | ({1} & set(options.num_speculative_tokens)))
               for overlap in (False, True)]
    runs = {config: [] for config in configs}
    for _ in range(options.repeats):
        for config in configs:
            runs[config].append(steps_per_second(options, config[1], config[0]))
    results["device_stand_in"] = {f"k={k} overlap={overlap}": {"steps_per_s": spread([r[0] for r in values]),
                                                               "tokens_per_s": spread([r[1] for r in values])}
                                  for (k, overlap), values in runs.items()}
    forward = "the model's forward" if options.real_forward else \
        f"sleep {options.device_ms:g} ms (ideal {1e3 / options.device_ms:.0f} steps/s)"
    print(f"\nforward = {forward}, {options.sleep_rows} x {options.sleep_context} on {options.device}: steps/s and "
          f"tokens/s (median, min-max over {options.repeats} runs)")
    for (k, overlap), values in runs.items():
        steps, tokens = spread([r[0] for r in values]), spread([r[1] for r in values])
        print(f"  k={k} overlap {'on ' if overlap else 'off'}: {steps['median']:7.1f} ({steps['min']:.1f}-"
              f"{steps['max']:.1f}) steps/s  {tokens['median']:8.1f} ({tokens['min']:.1f}-{tokens['max']:.1f}) tokens/s")
    for k in sorted({k for k, _ in configs}):  # (each repetition's on / off: runs side by side, paired)
        ratio = spread([on[0] / off[0] for off, on in zip(runs[(k, False)], runs[(k, True)])])
        results["device_stand_in"][f"k={k} on/off"] = {"steps_per_s": ratio}
        print(f"  k={k} overlap on / off, each repetition's: {ratio['median']:.2f}x "
              f"({ratio['min']:.2f}-{ratio['max']:.2f})")


def simulate(options, results: dict) -> None:
    runs = {ranks: [simulated_rank0(options, ranks) for _ in range(options.repeats)] for ranks in options.simulate_ranks}
    results["simulated_ranks"] = {str(ranks): {key: spread([run[key] for run in values]) for key in values[0]}
                                  for ranks, values in runs.items()}
    print(f"\nsimulated ranks, {options.dp_rows} requests each at {options.dp_context}: rank 0's engine-thread ms/step "
          f"(wall, CPU), its receiving thread's ms/step, bytes a rank sends per request (median, min-max over runs)")
    for ranks, cell in results["simulated_ranks"].items():
        print(f"  {ranks:>2} ranks: " + ", ".join(f"{key} {v['median']:.2f} ({v['min']:.2f}-{v['max']:.2f})"
                                                  for key, v in cell.items()))


def data_parallel(options, results: dict) -> None:
    layouts = [(ranks, ep) for ranks in options.data_parallel_sizes for ep in ((False, True) if ranks > 1 else
                                                                             (False,))]
    runs: dict[tuple, list] = {layout: [] for layout in layouts}
    for _ in range(options.repeats):  # each repetition measures every layout in turn
        for layout in layouts:
            runs[layout].append([1e3 * t for t in rank0_host_per_step(options, *layout)])
    keys = ("step_ms", "agreement_ms", "cpu_ms")
    results["data_parallel"] = {f"{r}{'+ep' if ep else ''}": {key: spread([v[i] for v in values])
                                                              for i, key in enumerate(keys)}
                                for (r, ep), values in runs.items()}
    print(f"\ndata-parallel ranks, {options.dp_rows} requests each at {options.dp_context}, stub forward over gloo: "
          f"rank 0's step (wall ms), of it waiting for the ranks' agreement, its engine thread's CPU ms; each the "
          f"median, min-max over runs, and the ratio to one rank's")
    base = results["data_parallel"].get("1")
    for name, cell in results["data_parallel"].items():
        print(f"  {name:>5} ranks: " + ", ".join(
            f"{key} {cell[key]['median']:.2f} ({cell[key]['min']:.2f}-{cell[key]['max']:.2f})"
            + (f" {cell[key]['median'] / base[key]['median']:.2f}x" if base and key != "agreement_ms" else "")
            for key in keys))


CHURN_PROMPT = (64, 1024)  # part 5: prompt and output lengths, drawn uniformly
CHURN_OUTPUT = (32, 512)


def inter_token_gaps(options, frozen: bool, seed: int) -> dict:
    """Part 5, once: the gaps between consecutive tokens of every request (ms), and the full collections meanwhile."""
    rows, draw = options.churn_rows, random.Random(seed)
    engine = make_engine(options, rows, CHURN_PROMPT[1] + CHURN_OUTPUT[1], overlap=True)
    last: dict[str, float] = {}
    gaps: list[float] = []
    finished: queue.SimpleQueue = queue.SimpleQueue()

    def on_output(out: RequestOutput) -> None:  # (the engine thread's, as the Triton adapter's callback)
        now = time.perf_counter()
        if out.request_id in last:
            gaps.append(now - last[out.request_id])
        last[out.request_id] = now
        if out.finished:
            del last[out.request_id]
            finished.put(out.request_id)

    def submit(index: int) -> None:
        prompt = [draw.randrange(2, engine.vocab_size) for _ in range(draw.randint(*CHURN_PROMPT))]
        params = SamplingParams(max_tokens=draw.randint(*CHURN_OUTPUT), ignore_eos=True)
        engine.submit(Sequence(f"churn-{index}", prompt, params), on_output)

    pauses: list[float] = []  # each full collection's seconds
    collecting_since = [0.0]

    def on_collection(phase: str, info: dict) -> None:
        if info["generation"] == 2:
            if phase == "start":
                collecting_since[0] = time.perf_counter()
            else:
                pauses.append(time.perf_counter() - collecting_since[0])

    engine.start()
    if not frozen:
        thaw_heap()
    frozen_objects = gc.get_freeze_count()
    gc.callbacks.append(on_collection)
    try:
        submitted = 0
        for submitted in range(rows):
            submit(submitted)
        end = time.perf_counter() + options.churn_seconds
        while time.perf_counter() < end:
            try:
                finished.get(timeout=0.1)
            except queue.Empty:
                continue
            submitted += 1
            submit(submitted)
    finally:
        gc.callbacks.remove(on_collection)
        engine.shutdown()
    gaps.sort()
    quantile = lambda q: 1e3 * gaps[min(len(gaps) - 1, int(q * len(gaps)))]  # noqa: E731
    return {"gaps": len(gaps), "median_ms": quantile(0.5), "p99_ms": quantile(0.99), "p999_ms": quantile(0.999),
            "max_ms": 1e3 * gaps[-1], "full_collections": len(pauses), "collection_ms": 1e3 * sum(pauses),
            "longest_collection_ms": 1e3 * max(pauses, default=0.0), "frozen_objects": frozen_objects}


def churn(options, results: dict) -> None:
    """Part 5: inter_token_gaps with the heap frozen and thawed, in turn within each repetition."""
    runs: dict[bool, list[dict]] = {True: [], False: []}
    for repeat in range(options.repeats):
        for frozen in runs:
            runs[frozen].append(inter_token_gaps(options, frozen, seed=repeat))
    results["churn"] = {("frozen" if frozen else "thawed"): {key: spread([run[key] for run in values])
                                                              for key in values[0]}
                        for frozen, values in runs.items()}
    print(f"\n{options.churn_rows} requests running for {options.churn_seconds:g} s, replaced as they finish "
          f"(stub forward): gaps between a request's tokens, ms, and full collections (median, min-max over runs)")
    for name, cell in results["churn"].items():
        print(f"  heap {name}: " + ", ".join(f"{key} {v['median']:.1f} ({v['min']:.1f}-{v['max']:.1f})"
                                             for key, v in cell.items() if key not in ("gaps", "frozen_objects")))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_flags(parser)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 16384, 65000])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device-ms", type=float, default=10.0)
    parser.add_argument("--sleep-rows", type=int, default=64)
    parser.add_argument("--sleep-context", type=int, default=16384)
    parser.add_argument("--real-forward", action="store_true", help="part 2 with the model's forward, not a sleep")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--skip-host", action="store_true", help="only the device stand-in")
    parser.add_argument("--skip-stand-in", action="store_true", help="no device stand-in (part 2)")
    parser.add_argument("--data-parallel-sizes", type=int, nargs="*", default=[],
                        help="part 3: rank 0's step with these many data-parallel ranks (processes; e.g. 1 2)")
    parser.add_argument("--simulate-ranks", type=int, nargs="*", default=[],
                        help="part 4: rank 0's step with these many ranks simulated (e.g. 1 2 4 8)")
    parser.add_argument("--churn-seconds", type=float, default=0.0,
                        help="part 5: this long of requests coming and going, heap frozen and thawed (e.g. 30)")
    parser.add_argument("--churn-rows", type=int, default=64)
    parser.add_argument("--dp-rows", type=int, default=128)
    parser.add_argument("--dp-context", type=int, default=1024)
    parser.add_argument("--num-speculative-tokens", type=int, nargs="+", default=[0],
                        help="part 1 with k drafts per decode, for each k given (0: decode steps; k > 0: verify steps, "
                             "the draft layer a stub too)")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="part 1 with static decode steps (and draft chains), the steps a GPU replays")
    parser.add_argument("--json", type=Path)
    options = parser.parse_args()
    torch.set_num_threads(1)

    results = {"host_ms": [], "growth": [], "device_stand_in": None,
               "settings": vars(options) | {"json": str(options.json)}}
    if not options.skip_host:
        # (with more than one draft a row every verify step is taken in before the next: measured once; with one,
        # also overlapped, where the static steps leave the next verify's drafts on the device)
        configs = [(rows, context, overlap, k) for k in options.num_speculative_tokens for rows in options.rows
                   for context in options.contexts for overlap in ((False,) if k > 1 else (False, True))]
        runs: dict[tuple, list[float]] = {config: [] for config in configs}
        for repeat in range(options.repeats):
            for config in configs:
                runs[config].append(1e3 * host_per_step(options, *config))
            print(f"repetition {repeat + 1} of {options.repeats} done", flush=True)
        print(f"\n{'drafts':>6} {'rows':>5} {'context':>8} {'overlap':>8} "
              f"{'host ms/step (median, min-max over runs)':>44}")
        for (rows, context, overlap, k), values in runs.items():
            row = dict(rows=rows, context=context, overlap=overlap, num_speculative_tokens=k, **spread(values))
            results["host_ms"].append(row)
            print(f"{k:>6} {rows:>5} {context:>8} {str(overlap):>8} {row['median']:>20.2f} "
                  f"({row['min']:.2f}-{row['max']:.2f})")
        low, high = min(options.contexts), max(options.contexts)
        print(f"\ngrowth from context {low} to {high} (paired in each repetition: median, min-max)")
        for rows, _, overlap, k in [config for config in configs if config[1] == low]:
            ratios = [b / a for a, b in zip(runs[(rows, low, overlap, k)], runs[(rows, high, overlap, k)])]
            growth = dict(rows=rows, overlap=overlap, num_speculative_tokens=k, **spread(ratios))
            results["growth"].append(growth)
            print(f"{k:>6} drafts {rows:>5} rows overlap {'on ' if overlap else 'off'}: {growth['median']:.2f}x "
                  f"({growth['min']:.2f}-{growth['max']:.2f})")
    if not options.skip_stand_in:
        stand_in(options, results)
    if options.churn_seconds:
        churn(options, results)
    if options.simulate_ranks:
        simulate(options, results)
    if options.data_parallel_sizes:  # (last: it stubs every model of this process)
        data_parallel(options, results)
    if options.json:
        options.json.parent.mkdir(parents=True, exist_ok=True)
        options.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
