#!/usr/bin/env python3
"""Decode step time of the engine's forward on the main thread and on a thread of the engine's own, side by side.

    python scripts/bench_engine_thread.py --repeats 3 --json results/engine_thread.json

As served, the engine loop runs in a thread of its own (LLMEngine.start) and the forward in the
executor's (overlap scheduling, backend/executor.py). Each repetition times the same workload three
ways, in one process, in turn:
  main              generate() without overlap: the forward on the main thread, every step on torch's N
                    intra-op threads
  loop              the engine as it serves: steps under 64 tokens on one thread, larger ones on
                    cpu_threads (default N), the forward on the executor's thread
  loop@N            the same with every step on N threads
and reports the median step time of each (the step records' device time: forward and sampling) and
the loop/main ratios.
--workload decode: --batch requests of --prompt-tokens, --steps decode steps each (decode steps
timed); --workload prefill: one --prompt-tokens prompt prefilled in chunks of --chunk tokens
(prefill steps timed), e.g. --prompt-tokens 8192 --chunk 565 for the starvation benchmark's chunks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backend.config import EngineConfig  # noqa: E402
from backend.engine import LLMEngine  # noqa: E402
from backend.request import SamplingParams, Sequence  # noqa: E402
from scripts.checkpoint_flags import add_checkpoint_flags, checkpoint_settings  # noqa: E402


def prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(2, vocab, (batch, length), generator=g).tolist()


def step_median(engine: LLMEngine, first_step: int, kind: str) -> float:
    steps = [r.timing.duration_s for r in list(engine.scheduler.records)[first_step:] if r.kind.value == kind]
    return statistics.median(steps)


def on_main(engine: LLMEngine, batch: list[list[int]], steps: int, kind: str) -> float:
    first = engine.scheduler.counters.num_steps
    engine.generate(batch, SamplingParams(max_tokens=steps, ignore_eos=True))
    return step_median(engine, first, kind)


def on_loop(engine: LLMEngine, batch: list[list[int]], steps: int, kind: str) -> float:
    first = engine.scheduler.counters.num_steps
    done = threading.Semaphore(0)

    def on_output(out):
        if out.finished:
            done.release()

    engine.start()
    try:
        for i, ids in enumerate(batch):
            engine.submit(Sequence(f"loop-{i}-{time.monotonic_ns()}", ids, SamplingParams(max_tokens=steps,
                                                                                         ignore_eos=True)), on_output)
        for _ in batch:
            done.acquire()
    finally:
        engine.shutdown()
    return step_median(engine, first, kind)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_flags(parser)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--workload", choices=["decode", "prefill"], default="decode")
    parser.add_argument("--chunk", type=int, default=565, help="prefill chunk tokens (--workload prefill)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    main_threads = torch.get_num_threads()
    # Every repeat runs the same prompts: prefix caching would turn all but the first into restores, so it is off
    settings = dict(**checkpoint_settings(args), device="cpu", enable_prefix_caching=False)
    if args.workload == "prefill":
        settings.update(prefill_chunk_tokens=args.chunk, num_tokens=4 * args.prompt_tokens, max_running_requests=1,
                        max_num_batched_tokens=max(8192, args.chunk))
        args.batch, args.steps = 1, 1
    engines = {"main": LLMEngine(EngineConfig(**settings, overlap_scheduling=False)),
               "loop": LLMEngine(EngineConfig(**settings)), f"loop@{main_threads}": LLMEngine(EngineConfig(**settings))}
    for name in ("main", f"loop@{main_threads}"):
        engines[name].executor.small_step_tokens = 0  # every step on all threads
    batch = prompts(args.batch, args.prompt_tokens, engines["main"].vocab_size)
    on_main(engines["main"], [batch[0][:64]], 4, "decode")  # warm-up
    rows = []
    for rep in range(args.repeats):
        row = {"repeat": rep}
        for name, engine in engines.items():
            run = on_main if name == "main" else on_loop
            row[name] = run(engine, batch, args.steps, args.workload)
        rows.append(row)
        print(" | ".join([f"repeat {rep}"] + [f"{k} {v * 1e3:.1f} ms" for k, v in row.items() if k != "repeat"]),
              flush=True)
    names = list(engines)
    print(f"\nmedian {args.workload} step ({args.batch} x {args.prompt_tokens}-token prompts"
          f"{f', chunks of {args.chunk}' if args.workload == 'prefill' else ''}), main thread with {main_threads} "
          "intra-op threads")
    print("| repeat | " + " | ".join(f"{n} (ms)" for n in names) + " | " + " | ".join(f"{n}/main" for n in names[1:])
          + " |")
    print("|---" * (1 + 2 * len(names) - 1) + "|")
    for row in rows:
        cells = [f"{row[n] * 1e3:.1f}" for n in names] + [f"{row[n] / row['main']:.2f}" for n in names[1:]]
        print(f"| {row['repeat']} | " + " | ".join(cells) + " |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"workload": args.workload, "main_threads": main_threads, "rows": rows},
                                        indent=2))


if __name__ == "__main__":
    main()
