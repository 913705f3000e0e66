"""Grammars with XGrammar: compiled off the engine thread, cached by key, matched where steps run.

    grammars = GrammarService(tokenizer_file, vocab_size=V, stop_token_ids=eos_ids)
    grammar = grammars.prepare(guided)   # any thread: parses now (a bad grammar raises ValueError), compiles
                                         # in the background; `grammar.ready` once compiled
    batch = GrammarBatch()               # the executor, per step, for all its constrained rows at once:
    batch.fill(grammars, masks)          #   the next tokens' masks (returns the rows no token can follow)
    batch.accept(grammars, tokens)       #   advance the matchers by the sampled tokens
    walk = GrammarLookahead()            # speculative decoding: the matchers take drafts tentatively,
    walk.take(grammars, drafts)          #   so that the mask after each can be filled,
    walk.rollback()                      #   then go back to the emitted tokens

Admission parses the grammar on the caller's thread (the Triton adapter's, never the engine's), so an invalid
schema, regex or EBNF is refused at once with XGrammar's message. Compiling (the per-token tables over the
vocabulary, the expensive part) runs on the service's own threads; the scheduler keeps the request aside until
its grammar is ready, so a slow schema delays only its own request. A compilation still running after
`compile_timeout_s` fails its requests with a message saying so; XGrammar cannot be interrupted, so its thread
finishes on its own while another compilation takes its place (at most `workers` such at once), and the constraint
fails at once from then on: a pathological grammar cannot hold up everyone else's. Compiled grammars are cached by the
constraint's key (kind, text, whitespace): a repeated schema compiles once, and concurrent requests
with the same schema wait for the same compilation. A compiled grammar whose first mask allows no token (the
tokenizer cannot produce its output) fails every request that uses it, with a message saying so.

A request's matcher (`RequestGrammar.matcher`) is created and used only on the thread that runs the steps
(backend/executor.py), like its sampler state: it accepts each token that thread samples for the request, so it
is never behind the step being prepared. Tokens of a live request are never dropped (preemption keeps them and
recomputes), so the matcher never goes back behind an emitted token; a request that ended meanwhile is skipped
(`done`). Speculative decoding (backend/speculative.py) walks it ahead of them only within a step: the drafter draws
each draft under the mask after the drafts before it, the verifier masks each position with the mask after the
drafts before it, the matcher taking those drafts tentatively (`GrammarLookahead`) and rolling them back with
XGrammar's `rollback` before the step ends, so that it then holds exactly the emitted tokens.
"""

from __future__ import annotations

import os
import queue
import re
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from backend.structured.params import GuidedDecoding

# JSON's free whitespace comes in runs of at most this many characters: a weak (or random) model otherwise fills
# max_tokens with newlines, while pretty-printing to depth 7 at indent 2 still fits.
MAX_WHITESPACE_RUN = 16
NO_TOKEN_CAN_FOLLOW = "the output constraint cannot be continued: no token of this model's vocabulary fits it"
_XGRAMMAR_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # "[02:21:10] /project/cpp/regex_converter.cc:83: "


# The compile times kept until a metrics exporter takes them (an offline engine never does).
COMPILE_SECONDS_KEPT = 4096


class GrammarService:
    """Parses, compiles and caches the grammars of one engine's requests (see the module docstring)."""

    def __init__(self, tokenizer_file: str | Path, *, vocab_size: int, stop_token_ids: list[int],
                 cache_entries: int = 256, workers: int = 2, compile_timeout_s: float | None = None):
        self.tokenizer_file = Path(tokenizer_file)
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.cache_entries = cache_entries
        self.workers, self.compile_timeout_s = workers, compile_timeout_s
        # Two compilations at a time (a slow schema does not hold up the next one), each on up to half the cores; a
        # thread more for each that may be left running past its deadline (`_expire_overdue`).
        self._pool = _DaemonPool(2 * workers, "dsv4-grammar")
        self._slots = threading.Semaphore(workers)  # compilations that count
        self._running: dict[Future, _Running] = {}
        self._closed = False
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, Future] = OrderedDict()  # key -> Future[compiled grammar], LRU
        self._compiler = None  # built on first use: the tokenizer's tables take ~0.7 s at a 129K vocabulary
        self._compiler_lock = threading.Lock()
        self.num_compiled = 0
        self.num_cache_hits = 0
        # Not yet taken (take_compile_seconds: a metrics histogram); bounded, for an engine nobody reads them from.
        self._compile_seconds: deque[float] = deque(maxlen=COMPILE_SECONDS_KEPT)

    def prepare(self, guided: GuidedDecoding) -> "RequestGrammar":
        """A request's grammar: its compilation shared through the cache. Raises ValueError for an invalid
        constraint (or one whose cached compilation already failed)."""
        with self._lock:
            future = self._cache.get(guided.key)
            if future is not None:
                self._cache.move_to_end(guided.key)
                self.num_cache_hits += 1
        if future is None:
            future = self._compile_later(guided)
        grammar = RequestGrammar(future, guided, self)
        if grammar.error is not None:
            raise ValueError(grammar.error)
        return grammar

    def check(self, guided: GuidedDecoding) -> None:
        """Parse only: ValueError for an invalid constraint (a request another data-parallel rank serves is compiled
        by that rank's service)."""
        self._parse(guided)

    def take_compile_seconds(self) -> list[float]:
        """The compile times recorded since the last call (each compilation's, once)."""
        with self._lock:
            taken = list(self._compile_seconds)
            self._compile_seconds.clear()
        return taken

    def close(self) -> None:
        """Stop compiling: pending compilations are cancelled (their requests end with an error); one still running
        is left to its daemon thread, which does not hold the process's exit."""
        self._closed = True
        self._pool.shutdown()

    # --- compilation ----------------------------------------------------------------------------------------
    def _compile_later(self, guided: GuidedDecoding) -> Future:
        grammar = self._parse(guided)  # on the caller's thread: a bad grammar is refused now
        with self._lock:
            future = self._cache.get(guided.key)  # another thread may have started it meanwhile: shared, a hit
            if future is not None:
                self.num_cache_hits += 1
            else:
                future = self._pool.submit(self._compile_in_slot, grammar, guided.key)
                self._cache[guided.key] = future
                while len(self._cache) > self.cache_entries:
                    self._cache.popitem(last=False)
        return future

    def _parse(self, guided: GuidedDecoding):
        import xgrammar as xgr

        try:
            if guided.kind in ("json", "json_object"):  # json_object: any JSON object, as vLLM compiles it
                schema = guided.spec if guided.kind == "json" else '{"type": "object"}'
                grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=guided.any_whitespace,
                                                       max_whitespace_cnt=MAX_WHITESPACE_RUN if guided.any_whitespace
                                                       else None)
                return _narrowed(grammar, json=True)
            if guided.kind == "regex":
                return _narrowed(xgr.Grammar.from_regex(guided.spec))
            if guided.kind == "choice":
                return xgr.Grammar.from_ebnf(choice_grammar(guided.choices))
            if guided.kind == "structural_tag":
                return _narrowed(structural_tag_grammar(guided.spec), json=True)
            return _narrowed(xgr.Grammar.from_ebnf(guided.spec))
        except (RuntimeError, ValueError, TypeError) as exc:  # (a structural tag's pydantic checks raise ValueError)
            raise ValueError(f"invalid {_KIND_NAMES[guided.kind]}: {_xgrammar_message(exc)}") from None

    def _compile_in_slot(self, future: Future, grammar, key: tuple):
        """`_compile` once one of the `workers` slots is free, its start recorded for `_expire_overdue`."""
        self._slots.acquire()
        if self._closed:  # (it waited for a slot while the service closed)
            self._slots.release()
            raise RuntimeError("the engine is shutting down")
        with self._lock:
            self._running[future] = record = _Running(key, time.monotonic())
        try:
            return self._compile(grammar, key)
        finally:
            with self._lock:
                del self._running[future]
            if not record.abandoned:  # (an abandoned one's slot was given back when it was)
                self._slots.release()

    def _expire_overdue(self) -> None:
        """Compilations running longer than compile_timeout_s are abandoned: their requests fail (`RequestGrammar`),
        their constraint fails at once from now on, and their slot goes to the next compilation (at most `workers`
        abandoned at once: past that, a slow compilation holds its slot until it ends)."""
        if self.compile_timeout_s is None:
            return
        now, freed = time.monotonic(), 0
        with self._lock:
            abandoned = self._num_abandoned_locked()
            for future, record in self._running.items():
                overdue = now - record.started_s > self.compile_timeout_s
                if overdue and not record.abandoned and abandoned < self.workers:
                    record.abandoned, freed, abandoned = True, freed + 1, abandoned + 1
                    if self._cache.get(record.key) is future:
                        self._cache[record.key] = _failed(ValueError(self.timeout_message))
        for _ in range(freed):
            self._slots.release()

    @property
    def num_abandoned(self) -> int:
        """Compilations past their deadline still running."""
        with self._lock:
            return self._num_abandoned_locked()

    def _num_abandoned_locked(self) -> int:
        return sum(record.abandoned for record in self._running.values())

    def abandoned(self, future: Future) -> bool:
        """Whether `future`'s compilation was abandoned past its deadline (and is still running)."""
        self._expire_overdue()
        with self._lock:
            record = self._running.get(future)
            return record is not None and record.abandoned

    @property
    def timeout_message(self) -> str:
        return (f"the output constraint did not compile within {self.compile_timeout_s:g} s "
                "(grammar_compile_timeout_s): simplify it")

    def _compile(self, grammar, key: tuple):
        """The compiled grammar; ValueError (cached: the constraint is at fault) when its first mask allows no
        token. Any other failure is not cached: the next request with the constraint compiles it again."""
        import xgrammar as xgr

        try:
            started = time.perf_counter()
            compiled = self._get_compiler().compile_grammar(grammar)
            first = xgr.allocate_token_bitmask(1, self.vocab_size)
            xgr.GrammarMatcher(compiled).fill_next_token_bitmask(first, 0)
        except Exception:
            # Not the constraint's fault: the next request compiles it again. An entry that is done already stays:
            # the failure put there when this compilation was abandoned past its deadline (`_expire_overdue`).
            with self._lock:
                entry = self._cache.get(key)
                if entry is not None and not entry.done():
                    del self._cache[key]
            raise
        with self._lock:
            self.num_compiled += 1
            self._compile_seconds.append(time.perf_counter() - started)
        if not first.any():
            raise ValueError(NO_TOKEN_CAN_FOLLOW)
        return compiled

    def _get_compiler(self):
        with self._compiler_lock:  # (the first two compilations may ask at once)
            if self._compiler is None:
                self._compiler = self._build_compiler()
            return self._compiler

    def _build_compiler(self):
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(self.tokenizer_file))
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                  stop_token_ids=self.stop_token_ids)
        # Our cache holds the compiled grammars (shared futures); XGrammar's own would hold them twice.
        threads = max(1, min(8, (os.cpu_count() or 2) // 2))
        return xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)

    def stats(self) -> dict:
        with self._lock:
            return {"compiled": self.num_compiled, "cache_hits": self.num_cache_hits, "cached": len(self._cache)}


class _DaemonPool:
    """`size` daemon threads running submitted calls, each given its own Future first. ThreadPoolExecutor's threads are
    joined when the interpreter exits, so a compilation XGrammar never ends (it cannot be interrupted) held the
    process's exit, and with it tritonserver's unload of the model; these are left behind."""

    def __init__(self, size: int, name: str):
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._size, self._shut = size, False
        for i in range(size):
            threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True).start()

    def submit(self, fn, *args) -> Future:
        if self._shut:
            raise RuntimeError("the engine is shutting down")
        future: Future = Future()
        self._tasks.put((future, fn, args))
        return future

    def shutdown(self) -> None:
        """Cancel what has not started; the threads end once the calls they run return. Once."""
        if self._shut:
            return
        self._shut = True
        while True:
            try:
                task = self._tasks.get_nowait()
            except queue.Empty:
                break
            task[0].cancel()
        for _ in range(self._size):  # (each thread takes one stop)
            self._tasks.put(None)

    def _work(self) -> None:
        while (task := self._tasks.get()) is not None:
            future, fn, args = task
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(future, *args))
            except BaseException as exc:  # noqa: BLE001 (the caller's to read)
                future.set_exception(exc)


@dataclass
class _Running:
    key: tuple
    started_s: float  # time.monotonic()
    abandoned: bool = False  # past the service's compile_timeout_s: its requests failed, its slot given back


def _failed(exc: Exception) -> Future:
    future: Future = Future()
    future.set_exception(exc)
    return future


class RequestGrammar:
    """One request's grammar: the shared compilation (`ready`, `error`: for the scheduler, any thread) and, on the
    thread that runs the steps, its own matcher."""

    def __init__(self, future: Future, guided: GuidedDecoding, service: GrammarService | None = None):
        self.future = future
        self.guided = guided
        self.service = service  # (whose deadline its compilation runs under)
        timeout = service.compile_timeout_s if service is not None else None
        # Its own deadline too: a compilation waiting for a slot (behind slow ones) is not yet running to be abandoned
        self.deadline = time.monotonic() + timeout if timeout is not None else None
        self._expired = False  # (once said, kept: `ready` and `error` read it one after the other)
        self._matcher = None
        self.done = False  # terminated (the grammar's end and a stop token accepted), or failed

    @property
    def ready(self) -> bool:
        """Compiled, failed, or past its deadline (its own, or its compilation abandoned past the service's)."""
        return self.future.done() or self._abandoned()

    def _abandoned(self) -> bool:
        if not self._expired:  # (the service's check first: it gives overdue compilations' slots to the next ones)
            abandoned = self.service is not None and self.service.abandoned(self.future)
            self._expired = abandoned or (self.deadline is not None and time.monotonic() > self.deadline)
        return self._expired

    @property
    def error(self) -> str | None:
        """Why the compilation failed (a client-facing message), None when it did not (or has not finished)."""
        if not self.future.done():
            return self.service.timeout_message if self._abandoned() else None
        if self.future.cancelled():
            return "the engine is shutting down: the output constraint was not compiled"
        exc = self.future.exception()
        if exc is None:
            return None
        return str(exc) if isinstance(exc, ValueError) else f"the output constraint failed to compile: {exc}"

    @property
    def matcher(self):
        """Its matcher (created on first use, on the thread that runs the steps)."""
        if self._matcher is None:
            import xgrammar as xgr

            self._matcher = xgr.GrammarMatcher(self.future.result())
        return self._matcher


class GrammarBatch:
    """The executor's side: fills the next-token masks of a step's constrained rows, and advances their matchers by
    the tokens sampled, each for all rows in one call.

    The masks are filled on a persistent pool of `workers` threads (this one among them; one for every full
    ROWS_PER_SHARE rows, at least one), each taking the next ROWS_PER_CHUNK rows until none are left, through
    XGrammar's batch call on one thread (which leaves the GIL). Chunks taken as threads come free, not a fixed
    share each: a few rows cost far more than the rest (inside length-bounded strings, 10-50x the median at V4's
    vocabulary), and a thread whose share held them kept the step waiting (at 256 rows and 8 threads, replaying
    measured row times: about 2.4 ms a step in chunks of 8 against 3.0 ms in equal shares, 1.9 ms if spread
    perfectly).
    Not XGrammar's own threads: its batch call builds a new thread pool every call, half the cores by default, and
    queues a task per row, so a 16-core host started and joined dozens of threads every step (3.7-4.8 ms a step on
    the H200's host against 0.14 ms on a 2-core CPU). Default workers: half the cores, at most 8, as vLLM sizes its
    mask pool."""

    ROWS_PER_SHARE = 16
    ROWS_PER_CHUNK = 8

    def __init__(self, workers: int | None = None):
        self.workers = max(1, workers if workers is not None else default_mask_workers())
        self._helpers = (ThreadPoolExecutor(self.workers - 1, thread_name_prefix="dsv4-mask")
                         if self.workers > 1 else None)
        self._batch = None

    def fill(self, grammars: list[RequestGrammar], masks: torch.Tensor) -> list[int]:
        """masks[i] (int32 [n, W] on the host) := grammars[i]'s next-token mask; returns the i whose mask allows no
        token at all."""
        if self._batch is None:
            import xgrammar as xgr

            self._batch = xgr.BatchGrammarMatcher(max_threads=1)  # stateless: one serves every thread
        matchers = [g.matcher for g in grammars]
        threads = max(1, min(self.workers, len(matchers) // self.ROWS_PER_SHARE))
        if threads == 1:
            self._batch.batch_fill_next_token_bitmask(matchers, masks)  # (XGrammar's own row order)
            return self._unfit(masks, len(matchers))
        # (one iterator every thread takes from: a range iterator's next() is atomic under the GIL)
        chunks = iter(range(0, len(matchers), self.ROWS_PER_CHUNK))
        pending = [self._helpers.submit(self._fill_chunks, matchers, masks, chunks) for _ in range(threads - 1)]
        try:
            self._fill_chunks(matchers, masks, chunks)
        finally:  # (every chunk done before the masks are read or refilled, a failed one's too)
            wait(pending)
        for future in pending:
            future.result()
        return self._unfit(masks, len(matchers))

    @staticmethod
    def _unfit(masks: torch.Tensor, rows: int) -> list[int]:
        """The rows whose mask allows no token. (numpy's reduction runs on this thread; torch's may wait on intra-op
        threads another process holds.)"""
        return np.flatnonzero(~masks[:rows].numpy().any(axis=1)).tolist()

    def fill_or_unmask(self, grammars: list[RequestGrammar], masks: torch.Tensor) -> list[int]:
        """fill(), with the rows no token fits left unmasked (allowing every token: what their caller draws there is
        not kept, it ends or stops those rows); returns those rows."""
        unfit = self.fill(grammars, masks)
        for i in unfit:
            masks[i].fill_(-1)
        return unfit

    def _fill_chunks(self, matchers: list, masks: torch.Tensor, chunks) -> None:
        for start in chunks:
            end = min(start + self.ROWS_PER_CHUNK, len(matchers))
            self._batch.batch_fill_next_token_bitmask(matchers[start:end], masks, list(range(start, end)))

    def close(self) -> None:
        if self._helpers is not None:
            self._helpers.shutdown(wait=False)

    @staticmethod
    def accept(grammars: list[RequestGrammar], tokens: list[int]) -> tuple[list[int], list[int]]:
        """Advance each grammar by its token; returns (the i whose grammar rejected its token, the i whose grammar
        reached its end: a stop token accepted). Both are `done`."""
        import xgrammar as xgr

        accepted = xgr.BatchGrammarMatcher.batch_accept_token([g.matcher for g in grammars], tokens)
        rejected, ended = [], []
        for i, (grammar, ok) in enumerate(zip(grammars, accepted)):
            if not ok:
                rejected.append(i)
            elif grammar.matcher.is_terminated():
                ended.append(i)
            else:
                continue
            grammar.done = True
        return rejected, ended


class GrammarLookahead:
    """Matchers walked ahead of their emitted tokens through a step's drafts (speculative decoding), so that the mask
    after each draft can be filled, then rolled back (XGrammar's `rollback`).

    A grammar's walk is open while it has taken every draft given so far; it stops at a draft the grammar cannot take,
    and is *blocked* where no mask can follow: after a draft that ends the grammar (XGrammar fills no mask after a
    stop token), or where no token fits (`block`). The walk is per step: `rollback` before the step ends."""

    def __init__(self):
        self.taken: dict[RequestGrammar, int] = {}  # drafts each walked matcher holds beyond the emitted tokens
        self._stopped: set[RequestGrammar] = set()
        self._blocked: set[RequestGrammar] = set()

    def open(self, grammar: RequestGrammar | None) -> bool:
        """Whether the grammar takes further drafts (no grammar: any draft)."""
        return grammar is None or grammar not in self._stopped

    def blocked(self, grammar: RequestGrammar) -> bool:
        """Whether no token can follow the drafts it took (its emitted tokens stop there)."""
        return grammar in self._blocked

    def take(self, grammars: list[RequestGrammar], tokens: list[int]) -> list[bool]:
        """Each open grammar takes its draft (one call); returns which did (a draft not taken stops the walk)."""
        import xgrammar as xgr

        taken = xgr.BatchGrammarMatcher.batch_accept_token([g.matcher for g in grammars], tokens)
        for grammar, ok in zip(grammars, taken):
            if not ok:
                self._stopped.add(grammar)
                continue
            self.taken[grammar] = self.taken.get(grammar, 0) + 1
            if grammar.matcher.is_terminated():
                self.block(grammar)
        return taken

    def block(self, grammar: RequestGrammar) -> None:
        """No token can follow the drafts the grammar took: its walk ends there."""
        self._stopped.add(grammar)
        self._blocked.add(grammar)

    def rollback(self, keep: dict[RequestGrammar, int] | None = None) -> None:
        """Each walked matcher back to `keep[grammar]` of the drafts it took (none by default); the walk is over."""
        keep = keep or {}
        for grammar, taken in self.taken.items():
            if taken > keep.get(grammar, 0):
                grammar.matcher.rollback(taken - keep.get(grammar, 0))
        self.taken.clear()
        self._stopped.clear()
        self._blocked.clear()


def default_mask_workers() -> int:
    """Threads that fill a step's masks: half the CPUs this process may use, at most 8."""
    return min(8, max(1, len(os.sched_getaffinity(0)) // 2))


_KIND_NAMES = {"json": "JSON schema", "json_object": "JSON object constraint", "regex": "regex",
               "choice": "choice", "grammar": "grammar", "structural_tag": "structural tag"}


def structural_tag_grammar(spec: str):
    """XGrammar's grammar of a structural tag (its JSON text): the current form, or the older one of structures and
    triggers, compiled as vLLM compiles them. (The service narrows its JSON as any other kind's; its free-text spans,
    tag dispatches rather than character classes, are left as XGrammar writes them.)"""
    import json

    import xgrammar as xgr

    tag = json.loads(spec)
    if "structures" not in tag:
        return xgr.Grammar.from_structural_tag(spec)
    try:
        items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                 for s in tag["structures"]]
        triggers = tag["triggers"]
    except (KeyError, TypeError):
        raise ValueError("the older form takes {\"structures\": [{\"begin\": ..., \"schema\": ..., \"end\": ...}, "
                         "...], \"triggers\": [...]}") from None
    return xgr.Grammar.from_structural_tag(items, triggers)


def _xgrammar_message(exc: BaseException) -> str:
    return _XGRAMMAR_LOCATION.sub("", str(exc).strip()) or repr(exc)


# Two narrowings of what XGrammar (0.2.8, 0.2.9) converts, so that every output is valid UTF-8 and valid JSON:
# - its negated character classes ([^...], e.g. a JSON string's characters), a regex's "." and a class's range
#   across them ([\u0100-\uffff]) admit the UTF-8 encodings of the surrogates U+D800..U+DFFF, which are not valid
#   UTF-8 (a byte-level tokenizer can produce them byte by byte);
# - it writes the characters of a length-bounded JSON string (minLength / maxLength) as [^\"\\\r\n], which admits
#   raw control characters; JSON forbids them (its unbounded strings exclude \0-\x1f).
# The grammar is printed, its classes narrowed, and the text parsed again.
_BOUNDED_STRING_CHARACTERS = r'[^\"\\\r\n]'
_SURROGATES = r"\ud800-\udfff"
_ANY_CHARACTER = r"[\0-\U0010ffff]"  # a regex's "."


def _narrowed(grammar, json: bool = False):
    import xgrammar as xgr

    text = str(grammar)
    if json:
        text = text.replace(_BOUNDED_STRING_CHARACTERS, r'[^\0-\x1f\"\\\r\n]')
    narrowed = _exclude_surrogates(text).replace(_ANY_CHARACTER, "[^" + _SURROGATES + "]")
    return grammar if narrowed == str(grammar) else xgr.Grammar.from_ebnf(narrowed)


def _exclude_surrogates(ebnf: str) -> str:
    """The printed grammar with the surrogates added to every negated character class and cut out of every other
    class's ranges (string literals copied as they are)."""
    out, i = [], 0
    while i < len(ebnf):
        c = ebnf[i]
        if c in '"[':  # a literal or a class, up to its unescaped end
            end = i + 1
            while ebnf[end] != ('"' if c == '"' else "]"):
                end += 2 if ebnf[end] == "\\" else 1
            body = ebnf[i:end + 1]
            if body.startswith("[^"):
                body = "[^" + _SURROGATES + body[2:]
            elif c == "[":
                body = _without_surrogate_ranges(body)
            out.append(body)
            i = end + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


_CLASS_ITEM = re.compile(r"(\\(?:u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|x[0-9a-fA-F]{1,2}|.)|[^\\])"
                         r"(?:-(\\(?:u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|x[0-9a-fA-F]{1,2}|.)|[^\\]))?", re.S)
_SURROGATE_LOW, _SURROGATE_HIGH = 0xD800, 0xDFFF


def _without_surrogate_ranges(body: str) -> str:
    """A positive character class ("[...]", as XGrammar prints it) with U+D800..U+DFFF cut out of its ranges (a range
    across them split in two, a range or a character inside them dropped); other items as they are."""
    items, changed = [], False
    for match in _CLASS_ITEM.finditer(body[1:-1]):
        low, high = match.group(1), match.group(2)
        first, last = _code_point(low), _code_point(high if high is not None else low)
        if last < _SURROGATE_LOW or first > _SURROGATE_HIGH:
            items.append(match.group(0))
            continue
        changed = True
        if first < _SURROGATE_LOW:
            items.append(f"{low}-\\ud7ff")
        if last > _SURROGATE_HIGH:
            items.append(f"\\ue000-{high}")
    return "[" + "".join(items) + "]" if changed else body


_ESCAPED = {"0": 0, "t": 9, "n": 10, "r": 13, "b": 8, "f": 12, "v": 11, "e": 27}  # (XGrammar's printed escapes)


def _code_point(item: str) -> int:
    """A class item's code point: a character, or one as XGrammar prints it escaped (\\uXXXX, \\UXXXXXXXX, \\xXX,
    \\0, \\n and the like, or a backslash before the character itself: \\", \\\\, \\])."""
    if not item.startswith("\\"):
        return ord(item)
    if item[1] in "uUx" and len(item) > 2:
        return int(item[2:], 16)
    return _ESCAPED.get(item[1], ord(item[1]))


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose language is exactly `choices` (vLLM's choice_as_grammar: each a quoted literal)."""
    return "root ::= " + " | ".join(f'"{_ebnf_literal(choice)}"' for choice in choices)


def _ebnf_literal(text: str) -> str:
    escapes = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}
    return "".join(escapes.get(c) or (f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else c) for c in text)
