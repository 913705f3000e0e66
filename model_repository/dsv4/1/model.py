"""Triton Python-backend adapter for the DeepSeek-V4 engine (decoupled mode).

Thin by design: `execute` parses and validates each request (backend/triton_io.py), submits it to
the engine and returns at once. The engine calls back from its own thread; the outputs go through a
queue to one response thread, which sends them (backend/triton_io.ResponseBuilder decides what to
send), polls `is_cancelled()` every POLL_S over all live requests and turns a cancellation into
`engine.abort`, and mirrors `engine.stats()` into the metrics. Every request gets exactly one
FINAL response.
"""

import json
import os
import queue
import sys
import threading
import time
import uuid
from pathlib import Path

import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
POLL_S = 0.02  # cancellation poll period
STATS_S = 0.1  # engine.stats() -> metrics period


def _repo_root(hint: str, model_dir: str) -> Path:
    """The checkout holding `backend/`: the repo_root parameter, $DSV4_REPO_ROOT, or ../.. of the model."""
    for candidate in (hint, os.environ.get("DSV4_REPO_ROOT", ""), str(Path(model_dir).resolve().parents[1])):
        if candidate and (Path(candidate) / "backend" / "config.py").is_file():
            return Path(candidate).resolve()
    raise RuntimeError(f"cannot find the dsv4 repository (backend/config.py): repo_root={hint!r}, model {model_dir}")


class _Live:
    """One in-flight request."""

    def __init__(self, sender, builder, timer):
        self.sender, self.builder, self.timer = sender, builder, timer
        self.cancelling = False


class TritonPythonModel:
    def initialize(self, args):
        config_json = json.loads(args["model_config"])
        params = {k: v.get("string_value", "") for k, v in config_json.get("parameters", {}).items()}
        root = _repo_root(params.pop("repo_root", "").strip(), args["model_repository"])
        if str(root) not in sys.path:
            sys.path.insert(0, str(root))
        from backend import triton_io
        from backend.config import EngineConfig
        from backend.engine import LLMEngine
        from backend.metrics import RequestTimer, ServingMetrics
        from backend.request import FinishReason, Sequence

        # Imported here: sys.path only knows the repository from now on.
        self._io, self._reasons = triton_io, FinishReason
        self._timer_cls, self._seq_cls = RequestTimer, Sequence
        config = EngineConfig.from_parameters(params)  # ConfigError names the bad parameter
        if not os.path.isabs(config.checkpoint):
            config.checkpoint = str(root / config.checkpoint)
        self.logger = pb_utils.Logger
        self.logger.log_info(f"[dsv4] repo {root}; engine config {config}")
        self.engine = LLMEngine(config)
        self.limits = triton_io.RequestLimits(
            self.engine.vocab_size, self.engine.max_prompt_tokens, config.max_tokens_limit)
        self.metrics = ServingMetrics(pb_utils, args["model_name"])
        self._live = {}
        self._lock = threading.Lock()
        self._outputs = queue.Queue()
        self._stop = threading.Event()
        self._parent_pid = os.getppid()
        self.engine.start()
        self._thread = threading.Thread(target=self._response_loop, name="dsv4-responses", daemon=True)
        self._thread.start()
        threading.Thread(target=self._watch_parent, name="dsv4-parent-watch", daemon=True).start()

    def execute(self, requests):
        for request in requests:
            self._submit(request)
        return None

    def finalize(self):
        self.engine.shutdown()
        self._stop.set()
        self._thread.join(timeout=10)
        with self._lock:
            leftovers, self._live = list(self._live.values()), {}
        for live in leftovers:
            self._send_error(live.sender, "the model is shutting down")

    # --- requests in ------------------------------------------------------------------------
    def _submit(self, request):
        sender = request.get_response_sender()
        request_id = f"{request.request_id() or 'req'}-{uuid.uuid4().hex[:12]}"
        try:
            inputs = self._io.to_numpy_inputs(
                list(self._io.INPUT_NAMES), lambda name: pb_utils.get_input_tensor_by_name(request, name)
            )
            parsed = self._io.parse_request(inputs, self.engine.tokenizer, self.limits, request.parameters())
            seq = self._seq_cls(request_id, parsed.prompt_ids, parsed.sampling, priority=parsed.priority)
            with self._lock:
                self._live[request_id] = _Live(sender, self._io.ResponseBuilder(parsed), self._timer_cls())
            self.engine.submit(seq, self._outputs.put)
        except Exception as exc:  # a bad request, or one the engine refuses: answer it, stay up
            with self._lock:
                self._live.pop(request_id, None)
            self.metrics.on_finished(self._reasons.ERROR.value)
            self._send_error(sender, str(exc), getattr(pb_utils.TritonError, "INVALID_ARG", None))

    # --- responses out ----------------------------------------------------------------------
    def _response_loop(self):
        next_poll = next_stats = 0.0
        while not (self._stop.is_set() and self._outputs.empty()):
            try:
                self._handle(self._outputs.get(timeout=POLL_S))
            except queue.Empty:
                pass
            now = time.monotonic()
            if now >= next_poll:
                self._poll_cancelled()
                next_poll = now + POLL_S
            if now >= next_stats:
                self._update_stats()
                next_stats = now + STATS_S

    def _handle(self, output):
        with self._lock:
            live = self._live.get(output.request_id)
        if live is None:
            return  # already answered (an error while sending, or shutdown)
        final_sent = False
        try:
            if output.new_token_ids:
                self.metrics.on_tokens(live.timer)
            if output.error or output.finish_reason == self._reasons.CANCELLED:
                message, code = (output.error, None) if output.error else ("request cancelled", "CANCELLED")
                final_sent = self._send_error(live.sender, message, getattr(pb_utils.TritonError, code or "", None))
            else:
                arrays = live.builder.on_output(output)
                if arrays is not None and live.sender.is_cancelled():
                    self._cancel(output.request_id, live)
                elif arrays is not None:
                    tensors = [pb_utils.Tensor(name, array) for name, array in arrays.items()]
                    flags = FINAL if output.finished else 0
                    live.sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=flags)
                    final_sent = output.finished
        except Exception as exc:
            self.logger.log_error(f"[dsv4] sending a response for {output.request_id} failed: {exc}")
            self.engine.abort(output.request_id)
            final_sent = self._send_error(live.sender, f"internal error: {exc}")
        finally:
            if output.finished or final_sent:
                with self._lock:
                    self._live.pop(output.request_id, None)
                self.metrics.on_finished((output.finish_reason or self._reasons.ERROR).value)
                if not final_sent:
                    self._send_final(live.sender)

    def _poll_cancelled(self):
        with self._lock:
            live_items = list(self._live.items())
        for request_id, live in live_items:
            if not live.cancelling and live.sender.is_cancelled():
                self._cancel(request_id, live)

    def _cancel(self, request_id, live):
        """The client cancelled: the engine aborts at its next step and answers CANCELLED."""
        if not live.cancelling:
            live.cancelling = True
            self.engine.abort(request_id)

    def _watch_parent(self):
        """tritonserver can exit without finalize() (its exit timeout hit with requests in flight);
        then calls to it block forever. Do not leave an engine computing for nobody: exit, removing
        this stub's shm region (named in its command line) that the server would have removed."""
        while not self._stop.wait(0.5):
            if os.getppid() != self._parent_pid:
                try:
                    argv = Path("/proc/self/cmdline").read_bytes().split(b"\0")
                    (Path("/dev/shm") / argv[2].decode()).unlink(missing_ok=True)
                except (OSError, IndexError, UnicodeDecodeError, ValueError):
                    pass
                os._exit(0)

    def _update_stats(self):
        try:
            self.metrics.update(self.engine.stats())
        except Exception as exc:
            self.logger.log_warn(f"[dsv4] engine.stats() failed: {exc}")

    def _send_error(self, sender, message, code=None):
        """Send an error response flagged FINAL; True when it went out."""
        error = pb_utils.TritonError(message, code) if code is not None else pb_utils.TritonError(message)
        try:
            sender.send(pb_utils.InferenceResponse(output_tensors=[], error=error), flags=FINAL)
            return True
        except Exception as exc:
            self.logger.log_warn(f"[dsv4] could not send an error response: {exc}")
            return False

    def _send_final(self, sender):
        try:
            sender.send(flags=FINAL)
        except Exception as exc:
            self.logger.log_warn(f"[dsv4] could not send the final flag: {exc}")
