#!/usr/bin/env python3
"""Structured outputs (XGrammar): what constrained requests cost in decode throughput, and grammar compile time.

    python scripts/bench_structured.py --repeats 3 --json results/structured/bench_structured.json

1. Decode throughput. For each concurrency C in --concurrency and each constrained fraction f in --fractions, C
   prompts of --prompt-tokens random token ids (seeded; the same prompts for every fraction of a C) generate
   --max-tokens tokens each through the engine (all submitted at once, so they batch; greedy, eos ignored); the
   first round(f * C) of them follow the LONG_TEXT schema (scripts/structured_schemas.py), whose string cannot
   close before max_tokens, so every request, constrained or not, produces exactly --max-tokens tokens (checked).
   Decode tokens/s is read off the run's step records (engine.scheduler.records), in wall-clock time: each
   record's `time` is when the step was scheduled, and in steady decoding the interval between the schedule times
   of consecutive decode steps is one step's period (with overlap, the engine schedules step k+1 as soon as it has
   taken in step k-1). The rate is the decode tokens of decode steps 2 .. n-1 over time[n] - time[2]: the prefill,
   the first decode step (scheduled while the prefill runs, its interval holds the prefill) and the tail (the last
   step's take-in, the drain) are left out, so no second, 1-token run is needed (scripts/bench_engine.py's way) and
   no difference of two noisy wall times is taken. Every decode step must carry all C rows (checked).
   Beside it, from the same records: the median mask-fill time per decode step (`mask_fill_s`: the host filling
   the constrained rows' token bitmasks), the median accept time (`grammar_accept_s`: the matchers advanced by the
   sampled tokens), the median step time (`duration_s`: the executor's forward + sampling, on CPU wall time of
   that thread), the mask fill and all grammar work as a % of step time (sums over the run's decode steps), and
   the median wall period of a step, and the step time beyond the 0 % cell's (same C and run; everything a
   constrained row adds to the executor's step: mask fill, the mask's application, the matchers' accept, the
   loss of the plain greedy path).
   One engine serves every cell (prefix caching off: the same prompts run again). It is warmed up first, with a
   constrained request among the warm-up, so XGrammar, its compiler and the LONG_TEXT grammar are loaded and
   cached before anything is timed. Each repetition runs every cell in turn (for repeat: for C: for f), so the
   machine's drift hits all cells alike; the ratio to unconstrained is taken per repetition against the 0 % cell
   of the same C (median, min-max over repetitions). The first run after a change of C is slower (the host
   allocator's buffers resized), so each C starts with an untimed short run, and the order of the fractions is
   rotated by one each repetition (no fraction is always first).
2. Grammar compile time. A GrammarService of its own (built as LLMEngine builds its own: the checkpoint's
   tokenizer, the model's vocabulary and stop tokens), warmed with one compilation (the compiler's tokenizer
   tables, reported apart). Each repetition, every schema of SCHEMAS, made unique to the repetition by a
   "title" (a new cache key; XGrammar's own cache is off, so a miss really compiles), is prepared and waited for
   (miss: `prepare()` parses on this thread, compiles on the service's, `future.result()`), then prepared again
   (hit: `prepare()` until `.ready`, no compilation). Reported: median and p90 over schemas, per repetition and
   over all, in ms, against the goals (miss median <= 50 ms, hit <= 1 ms); the compile time the service itself
   measures (its compile thread, without the parse and the hand-over) is given beside the miss.

3. --large-vocab V (e.g. 129280, DeepSeek-V4's): grammar costs at a real vocabulary size, which the built-in
   checkpoint's 512 tokens understate. Without --tokenizer (a real tokenizer.json, e.g. V4's), a synthetic
   byte-level vocabulary of V tokens is written first: the 256 bytes, then the most frequent words and word pairs
   of a text corpus (the installed transformers and torch sources), as a BPE vocabulary would hold them. Measured:
   every schema's compile time (miss), and per step, for a batch of B rows (--large-batches) each walking its
   schema with random allowed tokens (restarting at its end), the time to fill the B masks and to accept the B
   tokens (GrammarBatch, as the sampler calls it), medians over --large-steps steps.

Goals (the issue): 100 % constrained at >= 0.85x the unconstrained decode tok/s on this CPU; a schema compiles in
<= 50 ms median; a cache hit takes <= 1 ms. Prints the tables and the verdicts; writes --json (every raw
per-repetition number), --csv (the throughput table) and --plot (tok/s against the constrained fraction, one line
per concurrency, min-max error bars).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backend.config import EngineConfig  # noqa: E402
from backend.engine import LLMEngine, tokenizer_directory  # noqa: E402
from backend.request import SamplingParams  # noqa: E402
from backend.structured.grammar import GrammarBatch, GrammarService, default_mask_workers  # noqa: E402
from backend.structured.params import guided_decoding_from_sampling  # noqa: E402
from scripts.bench_host_overhead import spread  # noqa: E402
from scripts.bench_results import write_csv  # noqa: E402
from scripts.checkpoint_flags import add_checkpoint_flags, checkpoint_settings  # noqa: E402
from scripts.structured_schemas import LONG_TEXT, SCHEMAS  # noqa: E402

RESULTS = Path(__file__).resolve().parent.parent / "results" / "structured"
GOAL_RATIO = 0.85  # 100 % constrained decode tok/s over unconstrained
GOAL_MISS_MS = 50.0  # median compile (cache miss)
GOAL_HIT_MS = 1.0  # cache hit


def prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed + count)
    return torch.randint(2, vocab, (count, length), generator=g).tolist()


def params(max_tokens: int, constrained: bool) -> SamplingParams:
    values = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if constrained:
        values["guided_decoding"] = {"json": LONG_TEXT}
    return SamplingParams.from_dict(values)


def p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]


# --- 1. decode throughput ---------------------------------------------------------------------------------------
def run_cell(engine: LLMEngine, batch: list[list[int]], num_constrained: int, max_tokens: int) -> dict:
    """One generate() of `batch`, its first `num_constrained` requests constrained; the numbers of its decode steps."""
    last_step = engine.scheduler.records[-1].step_index if engine.scheduler.records else -1
    plain, constrained = params(max_tokens, False), params(max_tokens, True)
    started = time.perf_counter()
    results = engine.generate(batch, [constrained if i < num_constrained else plain for i in range(len(batch))])
    wall_s = time.perf_counter() - started
    for i, r in enumerate(results):
        assert r["finish_reason"] == "length" and not r.get("error") and len(r["output_ids"]) == max_tokens, \
            f"request {i} ({'constrained' if i < num_constrained else 'plain'}): {r['finish_reason']}, " \
            f"{len(r['output_ids'])} tokens, error {r.get('error')!r}"
        if i < num_constrained:
            assert r["text"].lstrip().startswith('{'), f"constrained request {i} is not JSON: {r['text'][:40]!r}"
    records = [r for r in engine.scheduler.records if r.step_index > last_step]
    decode = [r for r in records if r.kind.value == "decode"]
    assert len(decode) >= 4, f"only {len(decode)} decode steps: raise --max-tokens"
    assert all(r.num_decode_tokens == len(batch) for r in decode), \
        f"decode steps with fewer than {len(batch)} rows: {[r.num_decode_tokens for r in decode]}"
    assert len(decode) == max_tokens - 1 and all(r.kind.value != "mixed" for r in records), \
        f"expected prefill steps, then {max_tokens - 1} decode steps; got {[r.kind.value for r in records]}"
    measured = decode[1:]  # steps 2 .. n: intervals [time[k], time[k+1]] for k = 2 .. n-1
    periods = [b.time - a.time for a, b in zip(measured, measured[1:])]
    tokens = sum(r.num_decode_tokens for r in measured[:-1])
    durations = [r.timing.duration_s for r in decode]
    masks = [r.timing.mask_fill_s for r in decode]
    accepts = [r.timing.grammar_accept_s for r in decode]
    return {"tokens_per_s": tokens / sum(periods),
            "end_to_end_tokens_per_s": len(batch) * max_tokens / wall_s, "wall_s": wall_s,
            "decode_steps": len(decode), "step_ms": 1e3 * statistics.median(durations),
            "period_ms": 1e3 * statistics.median(periods), "mask_fill_ms": 1e3 * statistics.median(masks),
            "mask_fill_pct": 100.0 * sum(masks) / sum(durations), "accept_ms": 1e3 * statistics.median(accepts),
            "grammar_pct": 100.0 * (sum(masks) + sum(accepts)) / sum(durations),
            "step_ms_all": [1e3 * d for d in durations], "mask_fill_ms_all": [1e3 * m for m in masks]}


def summarise_throughput(runs: dict, options) -> list[dict]:
    rows = []
    for c in options.concurrency:
        for f in options.fractions:
            cell = runs[(c, f)]
            base = runs[(c, options.fractions[0])]
            ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(cell, base)]
            extra = [a["step_ms"] - b["step_ms"] for a, b in zip(cell, base)]
            tok = spread([r["tokens_per_s"] for r in cell])
            ratio = spread(ratios)
            rows.append({"concurrency": c, "constrained_fraction": f, "constrained_requests": round(f * c),
                         "tokens_per_s_median": tok["median"], "tokens_per_s_min": tok["min"],
                         "tokens_per_s_max": tok["max"], "ratio_median": ratio["median"], "ratio_min": ratio["min"],
                         "ratio_max": ratio["max"], "end_to_end_tokens_per_s_median":
                             statistics.median(r["end_to_end_tokens_per_s"] for r in cell),
                         "mask_fill_ms_median": statistics.median(r["mask_fill_ms"] for r in cell),
                         "step_ms_median": statistics.median(r["step_ms"] for r in cell),
                         "extra_step_ms_median": statistics.median(extra),
                         "mask_fill_pct_median": statistics.median(r["mask_fill_pct"] for r in cell),
                         "accept_ms_median": statistics.median(r["accept_ms"] for r in cell),
                         "grammar_pct_median": statistics.median(r["grammar_pct"] for r in cell),
                         "period_ms_median": statistics.median(r["period_ms"] for r in cell)})
    return rows


def print_throughput(rows: list[dict], options) -> None:
    base = options.fractions[0]
    print(f"\ndecode tok/s, {options.repeats} runs: median (min-max); ratio to the {base:.0%} cell of the same C and "
          f"run; per decode step: medians over the steps, then over runs (+step: step ms beyond the {base:.0%} "
          f"cell's, same run)")
    print(f"{'C':>3} {'constr.':>8} | {'decode tok/s':>22} | {'ratio':>17} | {'mask fill ms':>12} "
          f"{'accept ms':>9} {'step ms':>8} {'+step':>6} {'mask %':>7} {'grammar %':>9} {'period ms':>9} | "
          f"{'e2e tok/s':>9}")
    for r in rows:
        tok = f"{r['tokens_per_s_median']:.0f} ({r['tokens_per_s_min']:.0f}-{r['tokens_per_s_max']:.0f})"
        ratio = f"{r['ratio_median']:.2f} ({r['ratio_min']:.2f}-{r['ratio_max']:.2f})"
        constrained = f"{r['constrained_fraction']:.0%}"
        print(f"{r['concurrency']:>3} {constrained:>8} | {tok:>22} | {ratio:>17} | {r['mask_fill_ms_median']:>12.3f} "
              f"{r['accept_ms_median']:>9.3f} {r['step_ms_median']:>8.2f} {r['extra_step_ms_median']:>+6.2f} "
              f"{r['mask_fill_pct_median']:>6.1f}% {r['grammar_pct_median']:>8.1f}% {r['period_ms_median']:>9.2f} | "
              f"{r['end_to_end_tokens_per_s_median']:>9.0f}")


# --- 2. grammar compile time ------------------------------------------------------------------------------------
def compile_pass(service: GrammarService, repeat: int) -> dict:
    """Every schema of SCHEMAS once as a miss and once as a hit; ms per schema."""
    miss, hit, thread = {}, {}, {}
    for name, schema in SCHEMAS.items():
        unique = dict(schema, title=f"bench_structured {name} repeat {repeat}")
        guided = guided_decoding_from_sampling({"guided_decoding": {"json": unique}}, name)
        before = service.stats()
        service.take_compile_seconds()
        started = time.perf_counter()
        grammar = service.prepare(guided)
        grammar.future.result()
        miss[name] = 1e3 * (time.perf_counter() - started)
        started = time.perf_counter()
        again = service.prepare(guided)
        while not again.ready:
            pass
        hit[name] = 1e3 * (time.perf_counter() - started)
        after = service.stats()
        assert after["compiled"] == before["compiled"] + 1 and after["cache_hits"] == before["cache_hits"] + 1, \
            f"{name}: expected one compilation and one cache hit, stats {before} -> {after}"
        assert grammar.error is None, f"{name}: {grammar.error}"
        (compiled_s,) = service.take_compile_seconds()
        thread[name] = 1e3 * compiled_s
    return {"miss_ms": miss, "hit_ms": hit, "compile_thread_ms": thread}


def print_compile(passes: list[dict], first_compile_ms: float) -> dict:
    print(f"\ngrammar compile, {len(SCHEMAS)} schemas per run (ms; miss = prepare + result, compile = the service's "
          f"compile thread alone, hit = prepare until ready)")
    print(f"{'run':>4} | {'miss median':>11} {'p90':>7} {'max':>7} | {'compile median':>14} {'p90':>7} | "
          f"{'hit median':>10} {'p90':>7} {'max':>7}")
    summary = {}
    for label, chosen in [(str(i + 1), [p]) for i, p in enumerate(passes)] + [("all", passes)]:
        miss = [v for p in chosen for v in p["miss_ms"].values()]
        thread = [v for p in chosen for v in p["compile_thread_ms"].values()]
        hit = [v for p in chosen for v in p["hit_ms"].values()]
        row = {"miss_median_ms": statistics.median(miss), "miss_p90_ms": p90(miss), "miss_max_ms": max(miss),
               "compile_thread_median_ms": statistics.median(thread), "compile_thread_p90_ms": p90(thread),
               "hit_median_ms": statistics.median(hit), "hit_p90_ms": p90(hit), "hit_max_ms": max(hit)}
        summary[label] = row
        print(f"{label:>4} | {row['miss_median_ms']:>11.2f} {row['miss_p90_ms']:>7.2f} {row['miss_max_ms']:>7.2f} | "
              f"{row['compile_thread_median_ms']:>14.2f} {row['compile_thread_p90_ms']:>7.2f} | "
              f"{row['hit_median_ms']:>10.4f} {row['hit_p90_ms']:>7.4f} {row['hit_max_ms']:>7.4f}")
    slowest = sorted(SCHEMAS, key=lambda n: -statistics.median(p["miss_ms"][n] for p in passes))[:3]
    print("slowest schemas (median miss ms): " + ", ".join(
        f"{n} {statistics.median(p['miss_ms'][n] for p in passes):.1f}" for n in slowest))
    print(f"first compilation of the service (the compiler's tokenizer tables included): {first_compile_ms:.1f} ms")
    return summary


# --- 3. a real vocabulary size ----------------------------------------------------------------------------------
def synthetic_tokenizer(path: Path, vocab_size: int) -> int:
    """Write a byte-level BPE tokenizer.json of `vocab_size` tokens (see the module docstring); returns its stop id."""
    import collections
    import re

    import transformers

    byte_to_char = _bytes_to_unicode()
    counts, pairs, size = collections.Counter(), collections.Counter(), 0
    sources = Path(transformers.__file__).parent, Path(torch.__file__).parent
    for source in (p for root in sources for p in sorted(root.rglob("*.py"))):
        pieces = re.findall(r" ?[A-Za-z]+| ?[0-9]{1,3}| ?[^\sA-Za-z0-9]+|\s+", source.read_text(errors="ignore"))
        counts.update(pieces)
        pairs.update(a + b for a, b in zip(pieces, pieces[1:]) if len(a) + len(b) <= 16)
        size += sum(map(len, pieces))
        if size > 60e6:
            break
    vocab = {byte_to_char[b]: b for b in range(256)}
    for word in [w for w, _ in counts.most_common()] + [w for w, _ in pairs.most_common()]:
        if len(vocab) == vocab_size - 1:
            break
        vocab.setdefault("".join(byte_to_char[b] for b in word.encode()), len(vocab))
    stop = len(vocab)
    vocab["<eos>"] = stop
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    path.write_text(json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "normalizer": None, "post_processor": None,
        "added_tokens": [{"id": stop, "content": "<eos>", "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True}],
        "pre_tokenizer": byte_level, "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []}}))
    return stop


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as a printable character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def large_vocab_pass(service: GrammarService, options) -> dict:
    """Compile every schema (a miss each), then time batched mask fills and accepts per step."""
    from kernels.token_bitmask import allowed_tokens

    compile_ms, grammars = {}, {}
    for name, schema in list(SCHEMAS.items()) + [("long_text", LONG_TEXT)]:
        started = time.perf_counter()
        grammar = service.prepare(guided_decoding_from_sampling({"guided_decoding": {"json": schema}}, name))
        grammar.future.result()
        compile_ms[name] = 1e3 * (time.perf_counter() - started)
        grammars[name] = grammar
    names = list(grammars)
    generator = torch.Generator().manual_seed(options.seed)
    fills = mask_fills(options.mask_workers)
    steps = {}
    for batch in options.large_batches:
        rows = [service.prepare(grammars[names[i % len(names)]].guided) for i in range(batch)]
        masks = {name: torch.empty(batch, (options.large_vocab + 31) // 32, dtype=torch.int32) for name in fills}
        fill_ms, accept_ms = {name: [] for name in fills}, []
        for step in range(options.large_steps):
            order = list(fills)[step % len(fills):] + list(fills)[:step % len(fills)]  # no method always first
            for name in order:
                started = time.perf_counter()
                fills[name](rows, masks[name])
                fill_ms[name].append(1e3 * (time.perf_counter() - started))
            reference = masks[order[0]]
            assert all(torch.equal(m, reference) for m in masks.values()), "the mask fills disagree"
            allowed = allowed_tokens(reference, options.large_vocab)
            tokens = torch.multinomial(allowed.float(), 1, generator=generator).flatten().tolist()
            started = time.perf_counter()
            GrammarBatch.accept(rows, tokens)
            accept_ms.append(1e3 * (time.perf_counter() - started))
            for row in rows:
                if row.done:  # the end of its document: walk it again
                    row.matcher.reset()
                    row.done = False
        steps[batch] = {"fill_ms_median": {name: statistics.median(v) for name, v in fill_ms.items()},
                        "fill_ms_p90": {name: p90(v) for name, v in fill_ms.items()},
                        "accept_ms_median": statistics.median(accept_ms), "accept_ms_p90": p90(accept_ms)}
    return {"compile_ms": compile_ms, "steps": steps}


def mask_fills(worker_counts: list[int]) -> dict:
    """The ways to fill a step's masks, side by side: the engine's (GrammarBatch: a persistent pool of N threads),
    and XGrammar's batch call on its own N threads (what the engine did before: a new thread pool every call)."""
    import xgrammar as xgr

    fills = {}
    for n in worker_counts:
        fills[f"pool {n}"] = GrammarBatch(workers=n).fill
        own = xgr.BatchGrammarMatcher(max_threads=n)
        fills[f"xgrammar {n}"] = lambda rows, masks, own=own: own.batch_fill_next_token_bitmask(
            [r.matcher for r in rows], masks)
    return fills


def print_large_vocab(result: dict, options, tokenizer: str) -> None:
    miss = list(result["compile_ms"].values())
    print(f"\nvocabulary of {options.large_vocab} tokens ({tokenizer}): compile (miss) median "
          f"{statistics.median(miss):.1f} ms, p90 {p90(miss):.1f} ms, max {max(miss):.1f} ms over {len(miss)} schemas")
    print("mask fill per step, median (p90), ms: the engine's persistent pool of N threads ('pool N') beside "
          "XGrammar's batch call on N threads of its own ('xgrammar N', a new pool every call)")
    methods = list(next(iter(result["steps"].values()))["fill_ms_median"])
    print(f"{'rows':>5} | " + " | ".join(f"{m:>18}" for m in methods) + f" | {'accept ms':>9}")
    for batch, r in result["steps"].items():
        cells = [f"{r['fill_ms_median'][m]:>8.3f} ({r['fill_ms_p90'][m]:>7.3f})" for m in methods]
        print(f"{batch:>5} | " + " | ".join(cells) + f" | {r['accept_ms_median']:>9.3f}")


def run_large_vocab(options) -> dict:
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        tokenizer, stop = options.tokenizer, options.stop_token_id
        if tokenizer is None:
            tokenizer = Path(scratch) / "tokenizer.json"
            started = time.perf_counter()
            stop = synthetic_tokenizer(tokenizer, options.large_vocab)
            print(f"synthetic vocabulary of {options.large_vocab} tokens written in "
                  f"{time.perf_counter() - started:.1f} s", flush=True)
        service = GrammarService(tokenizer, vocab_size=options.large_vocab, stop_token_ids=[stop])
        try:
            started = time.perf_counter()
            warm_up = guided_decoding_from_sampling({"guided_decoding": {"regex": "a"}}, "warm-up")
            service.prepare(warm_up).future.result()
            tables_ms = 1e3 * (time.perf_counter() - started)
            result = large_vocab_pass(service, options)
        finally:
            service.close()
    result["tokenizer_tables_ms"] = tables_ms
    print_large_vocab(result, options, str(options.tokenizer or "synthetic byte-level"))
    print(f"the tokenizer's tables (first compilation): {tables_ms:.0f} ms")
    return result


def plot(rows: list[dict], options) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for c in options.concurrency:
        cells = [r for r in rows if r["concurrency"] == c]
        x = [100 * r["constrained_fraction"] for r in cells]
        y = [r["tokens_per_s_median"] for r in cells]
        err = [[r["tokens_per_s_median"] - r["tokens_per_s_min"] for r in cells],
               [r["tokens_per_s_max"] - r["tokens_per_s_median"] for r in cells]]
        line = ax.errorbar(x, y, yerr=err, marker="o", capsize=4, label=f"concurrency {c}")
        ax.axhline(GOAL_RATIO * cells[0]["tokens_per_s_median"], color=line[0].get_color(), linestyle=":",
                   linewidth=1, label=f"{GOAL_RATIO}x of 0 % (C={c})")
    ax.set_xlabel("constrained requests (%)")
    ax.set_ylabel("decode tokens/s (median, min-max)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"structured outputs (LONG_TEXT schema), {options.max_tokens} tokens, {options.repeats} runs, "
                 f"{options.device}")
    ax.legend(fontsize=8)
    options.plot.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(options.plot, dpi=120, bbox_inches="tight")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_flags(parser)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.0, 0.5, 1.0],
                        help="constrained fractions; the first is the baseline of the ratios (keep it 0)")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--overlap-scheduling", action=argparse.BooleanOptionalAction,
                        default=EngineConfig.overlap_scheduling)
    parser.add_argument("--skip-throughput", action="store_true", help="only the grammar compile times")
    parser.add_argument("--skip-compile", action="store_true", help="only the decode throughput")
    parser.add_argument("--large-vocab", type=int, default=0,
                        help="also measure at this vocabulary size (129280: DeepSeek-V4's); 0: not")
    parser.add_argument("--tokenizer", type=Path, help="with --large-vocab: this tokenizer.json, else a synthetic one")
    parser.add_argument("--stop-token-id", type=int, help="with --tokenizer: its end-of-sequence id")
    parser.add_argument("--large-batches", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--large-steps", type=int, default=40)
    parser.add_argument("--mask-workers", type=int, nargs="+", default=sorted({1, default_mask_workers()}),
                        help="with --large-vocab: the thread counts of the mask fills compared")
    parser.add_argument("--json", type=Path, default=RESULTS / "bench_structured.json")
    parser.add_argument("--csv", type=Path, default=RESULTS / "bench_structured.csv", help="the throughput table")
    parser.add_argument("--plot", type=Path, default=RESULTS / "bench_structured.png")
    parser.add_argument("--no-plot", action="store_true")
    options = parser.parse_args()
    if not (0.0 <= min(options.fractions) and max(options.fractions) <= 1.0):
        parser.error("--fractions must lie in [0, 1]")
    started = time.perf_counter()

    engine = LLMEngine(EngineConfig(**checkpoint_settings(options), device=options.device,
                                    max_running_requests=max(options.concurrency),
                                    max_num_batched_tokens=max(8192, max(options.concurrency) * options.prompt_tokens),
                                    enable_prefix_caching=False, overlap_scheduling=options.overlap_scheduling))
    service = GrammarService(tokenizer_directory(engine.config) / "tokenizer.json", vocab_size=engine.vocab_size,
                             stop_token_ids=engine.eos_token_ids)
    try:
        # Warm-up: XGrammar, the engine's compiler and the LONG_TEXT grammar; every batch shape once.
        warm_started = time.perf_counter()
        engine.generate([[2, 3, 4, 5]], params(4, True))  # (this one waits for its grammar's compilation)
        for c in options.concurrency:
            batch = prompts(c, options.prompt_tokens, engine.vocab_size, options.seed)
            run_cell(engine, batch, c // 2, min(options.max_tokens, 8))
        first = time.perf_counter()
        service.prepare(guided_decoding_from_sampling({"guided_decoding": {"json": LONG_TEXT}}, "warm-up")) \
            .future.result()
        first_compile_ms = 1e3 * (time.perf_counter() - first)
        print(f"warm-up {time.perf_counter() - warm_started:.1f} s; engine grammars {engine.grammars.stats()}",
              flush=True)

        runs: dict[tuple, list[dict]] = {(c, f): [] for c in options.concurrency for f in options.fractions}
        passes: list[dict] = []
        for repeat in range(options.repeats):
            if not options.skip_throughput:
                for c in options.concurrency:
                    batch = prompts(c, options.prompt_tokens, engine.vocab_size, options.seed)
                    run_cell(engine, batch, c // 2, min(options.max_tokens, 8))  # (untimed: the switch of C)
                    shift = repeat % len(options.fractions)
                    for f in options.fractions[shift:] + options.fractions[:shift]:
                        cell = run_cell(engine, batch, round(f * c), options.max_tokens)
                        runs[(c, f)].append(cell)
                        print(f"run {repeat + 1}: C {c:>3}, {f:>4.0%} constrained: {cell['tokens_per_s']:8.1f} "
                              f"decode tok/s, mask fill {cell['mask_fill_ms']:.3f} ms of {cell['step_ms']:.2f} ms/step",
                              flush=True)
            if not options.skip_compile:
                passes.append(compile_pass(service, repeat))
                print(f"run {repeat + 1}: compile median "
                      f"{statistics.median(passes[-1]['miss_ms'].values()):.2f} ms", flush=True)
    finally:
        service.close()
        engine.shutdown()

    results = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(options).items()},
               "goals": {"ratio_100pct": GOAL_RATIO, "compile_median_ms": GOAL_MISS_MS, "cache_hit_ms": GOAL_HIT_MS},
               "torch_threads": torch.get_num_threads()}
    verdicts = []
    if not options.skip_throughput:
        rows = summarise_throughput(runs, options)
        print_throughput(rows, options)
        results["throughput"] = rows
        results["throughput_runs"] = [{"concurrency": c, "constrained_fraction": f, "repeat": i, **run}
                                      for (c, f), cell in runs.items() for i, run in enumerate(cell)]
        for r in rows:
            if r["constrained_fraction"] == 1.0:
                ok = r["ratio_median"] >= GOAL_RATIO
                verdicts.append(f"C={r['concurrency']}: 100 % constrained at {r['ratio_median']:.2f}x "
                                f"({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) of unconstrained "
                                f"(goal >= {GOAL_RATIO}x): {'PASS' if ok else 'FAIL'}")
        if options.csv:
            write_csv(options.csv, rows)
        if not options.no_plot:
            plot(rows, options)
    if not options.skip_compile:
        summary = print_compile(passes, first_compile_ms)
        results["compile"] = {"summary": summary, "runs": passes, "first_compile_ms": first_compile_ms}
        overall = summary["all"]
        verdicts.append(f"compile median {overall['miss_median_ms']:.2f} ms (goal <= {GOAL_MISS_MS:g}): "
                        f"{'PASS' if overall['miss_median_ms'] <= GOAL_MISS_MS else 'FAIL'}")
        verdicts.append(f"cache hit max {overall['hit_max_ms']:.4f} ms (goal <= {GOAL_HIT_MS:g}): "
                        f"{'PASS' if overall['hit_max_ms'] <= GOAL_HIT_MS else 'FAIL'}")
    if options.large_vocab:
        results["large_vocab"] = run_large_vocab(options)
        miss = statistics.median(results["large_vocab"]["compile_ms"].values())
        verdicts.append(f"compile median at {options.large_vocab} tokens {miss:.1f} ms (goal <= {GOAL_MISS_MS:g}): "
                        f"{'PASS' if miss <= GOAL_MISS_MS else 'FAIL'}")
    print("\n" + "\n".join(verdicts))
    results["verdicts"] = verdicts
    results["elapsed_s"] = time.perf_counter() - started
    print(f"elapsed {results['elapsed_s']:.0f} s")
    if options.json:
        options.json.parent.mkdir(parents=True, exist_ok=True)
        options.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
