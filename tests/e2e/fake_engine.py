"""A stand-in for backend.engine.LLMEngine with the same interface, for testing the Triton adapter
(model_repository/dsv4/1/model.py) fast and deterministically.

tests/e2e/conftest.py lays out a repo root whose backend/ holds the real config and request
modules and serving/ package plus this file as backend/engine.py; tests/serving/test_adapter_loop.py
uses it in-process.

Tokens are bytes (vocab 256). Generation is deterministic: the i-th output token is
`ord('a') + (sum(prompt) + i) % 26`, one token per request per step, STEP_S per step. A prompt
containing "NOFIT" is refused by submit(), and so is what RequestLimits refuses (ids outside
the 256 bytes, max_tokens over config.max_tokens_limit, more than 1000 positions); "é" in the prompt makes every token a UTF-8 "é" split
over two steps. Each running request holds one page in pool "window".
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from backend.request import FinishReason, RequestLimits, RequestOutput, Sequence

STEP_S = 0.01


class ByteTokenizer:
    @dataclass
    class Encoding:
        ids: list[int]

    def encode(self, text: str, add_special_tokens: bool = True) -> "ByteTokenizer.Encoding":
        return self.Encoding(list(text.encode("utf-8")))  # (it has no special tokens to add)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def expected_ids(prompt_ids: list[int], max_tokens: int) -> list[int]:
    if 0xC3 in prompt_ids:  # "é"
        return [0xC3, 0xA9] * (max_tokens // 2) + [0xC3] * (max_tokens % 2)
    return [ord("a") + (sum(prompt_ids) + i) % 26 for i in range(max_tokens)]


class LLMEngine:
    def __init__(self, config):
        self.config = config
        self.tokenizer = ByteTokenizer()
        self.chat_template = None  # no chat template: `messages` requests are refused
        self.limits = RequestLimits(vocab_size=256, max_tokens_limit=config.max_tokens_limit, max_request_positions=1000)
        self._lock = threading.Lock()
        self._running: dict[str, tuple[Sequence, object]] = {}
        self._aborted: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fake-engine", daemon=True)
        self._steps = 0

    def start(self):
        self._thread.start()

    def shutdown(self, timeout: float = 5.0):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout)

    def submit(self, seq: Sequence, on_output) -> None:
        self.limits.check(seq.prompt_ids, seq.sampling)
        if seq.sampling.guided_decoding is not None:
            raise ValueError("this fake engine has no structured outputs")
        if b"NOFIT" in bytes(seq.prompt_ids):
            raise ValueError("request can never fit: prompt asks for NOFIT")
        with self._lock:
            self._running[seq.request_id] = (seq, on_output)

    def take_grammar_compile_seconds(self) -> list[float]:
        return []  # no structured outputs here

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborted.add(request_id)

    def stats(self) -> dict:
        with self._lock:
            used = len(self._running)
            return {
                "steps_by_kind": {"decode": self._steps},
                "longest_prefill_streak": 0,
                "decode_stalls": 0,
                "num_running": used,
                "num_waiting": 0,
                "pool_usage": {"window": used / 64},
                "pages_used": {"window": used},
            }

    def _loop(self):
        while not self._stop.is_set():
            time.sleep(STEP_S)
            with self._lock:
                items = list(self._running.items())
                aborted, self._aborted = self._aborted, set()
            if items:
                self._steps += 1
            for request_id, (seq, on_output) in items:
                output = self._advance(seq, request_id in aborted)
                if output.finished:
                    with self._lock:
                        self._running.pop(request_id, None)
                on_output(output)

    def _advance(self, seq: Sequence, aborted: bool) -> RequestOutput:
        n_in = len(seq.prompt_ids)
        if aborted:
            return RequestOutput(seq.request_id, [], "", True, FinishReason.CANCELLED, n_in, len(seq.output_ids))
        token = expected_ids(seq.prompt_ids, len(seq.output_ids) + 1)[-1]
        seq.append_output(token)
        finished = len(seq.output_ids) >= seq.sampling.max_tokens
        reason = FinishReason.LENGTH if finished else None
        # Token ids only, as the real engine reports them: the adapter's output processor makes the text.
        return RequestOutput(seq.request_id, [token], "", finished, reason, n_in, len(seq.output_ids))
