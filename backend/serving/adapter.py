"""The Triton adapter's logic: requests in, responses out, cancellation, metrics, exactly one FINAL.

`model_repository/dsv4/1/model.py` only builds the engine and hands the Python backend's utility
module (`triton_python_backend_utils`, "pb_utils") to `TritonAdapter`; nothing here imports
tritonserver, so the whole contract is unit-tested in-process with a fake pb_utils.

Threads:
- tritonserver's `execute()` calls `submit()`: parse the request (triton_io), hand it to the
  engine (`engine.submit`, the admission gate) and return at once (decoupled mode);
- the engine thread calls back with each `RequestOutput` (token ids); the callback only queues it;
- one response thread turns them into text and applies stop strings (backend/output_processor.py),
  sends what the queue holds (`triton_io.ResponseBuilder` decides what; a request's outputs queued together go as
  one response: sends are round trips to tritonserver, so a thread behind the engine catches up), asks each live
  request's sender `is_cancelled()` (at most once per `ask_interval_s()`, with its responses or by a poll every
  `poll_s`) and turns a cancellation into `engine.abort`, mirrors `engine.stats()` into the metrics every
  `stats_s`, and watches for tritonserver stopping (server_stop.py: the requests still running then get a grace, and
  end with an error after it, so that the model unloads within the server's exit timeout). Detokenization and sending
  never run on the engine thread.
Every request gets exactly one FINAL: on an error response (bad request, engine error, cancellation, failure to
send), else as a bare flag, after the last output's response (`_send_output` says why) or where no response could
carry it. Three threads may answer a request (the response thread, submit()'s
when the engine refuses it, finalize()'s at shutdown): each response goes out holding the request's
`sending` lock, and whoever sends the FINAL marks it `answered` there, so nothing follows a FINAL.
"""

from __future__ import annotations

import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field, replace

from backend.output_processor import OutputProcessor, coalesce
from backend.request import SHUTTING_DOWN, EngineUnavailable, FinishReason, Sequence
from backend.serving import server_stop, triton_io
from backend.serving.metrics import RequestTimer, ServingMetrics


@dataclass
class _Live:
    """One in-flight request, as the adapter sees it."""

    sender: object  # the request's response sender
    builder: triton_io.ResponseBuilder
    timer: RequestTimer = field(default_factory=RequestTimer)
    cancelling: bool = False
    sending: threading.Lock = field(default_factory=threading.Lock)  # held while a response of it goes out
    answered: bool = False  # its FINAL went out (or failed to): nothing more is sent (under `sending`)
    asked_at: float = float("-inf")  # when its sender was last asked is_cancelled() (time.monotonic())
    failed: str | None = None  # sending one of its responses failed: its end is this error, counted as one


# How long finalize() may take: below tritonserver's exit timeout (30 s by default, 10 s in scripts/serve.sh and the
# end-to-end tests), past which the server gives up on the model and aborts (server_stop.STOP_MARGIN_S counts it).
SHUTDOWN_TIMEOUT_S = 2.5

# How many is_cancelled() calls a second the response thread makes at most, over all live requests. Each is a round
# trip to tritonserver (55 us measured under tritonserver on the 2-core CPU) on the thread that also sends every
# response: asking every live request every 20 ms and before every response took 16 % of a core at 64 streams, and
# would take more than the thread has at 256 streams of 100 tokens/s. 1,000 a second is about 5 %; a request is
# then asked every max(poll_s, live requests / 1000) seconds (0.26 s at 256), which bounds how long a cancelled
# request keeps decoding.
MAX_CANCEL_ASKS_PER_S = 1000
# At most this many queued outputs are taken (and merged) at once, so that cancellations are still asked for between.
MAX_OUTPUTS_TAKEN = 4096


class TritonAdapter:
    def __init__(self, engine, pb_utils, model_name: str, model_version: str = "", *, poll_s: float = 0.02,
                 stats_s: float = 0.1, max_cancel_asks_per_s: float = MAX_CANCEL_ASKS_PER_S, stop_check_s: float = 0.5):
        self.engine = engine
        self.pb = pb_utils
        self.final_flag = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        self.metrics = ServingMetrics(pb_utils, model_name, model_version)
        self.logger = pb_utils.Logger
        self.poll_s, self.stats_s = poll_s, stats_s
        self.max_cancel_asks_per_s = max_cancel_asks_per_s
        self.model_name = model_name
        self._unload_requested = False
        self._may_unload = engine.config.unload_when_unavailable and server_stop.explicit_model_control(os.getppid())
        if engine.config.unload_when_unavailable and not self._may_unload:
            self.logger.log_warn("[dsv4] unload_when_unavailable needs tritonserver --model-control-mode=explicit: "
                                 "without it a model that can no longer serve stays loaded, answering UNAVAILABLE")
        grace_s = engine.config.stop_grace_s
        if grace_s is not None and (warning := server_stop.grace_warning(grace_s)):
            self.logger.log_warn(f"[dsv4] {warning}")
        self.stop_watch = server_stop.ServerStopWatch(
            pb_utils, model_name, model_version, check_s=stop_check_s,
            grace_s=server_stop.default_grace_s() if grace_s is None else grace_s,
            health=server_stop.ServerStopWatch.endpoint_of(os.getppid()))
        health = self.stop_watch.health
        self.logger.log_info(f"[dsv4] the server's stop is watched for over {health.where}" if health else
                             "[dsv4] the server's stop is watched for through is_model_ready (no HTTP or gRPC endpoint "
                             "of tritonserver's own to ask: docs/serving.md#stopping-the-server)")
        self._live: dict[str, _Live] = {}
        self.processor = OutputProcessor(engine.tokenizer, engine.abort)
        self._lock = threading.Lock()
        self._outputs: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._response_loop, name="dsv4-responses", daemon=True)

    def start(self) -> None:
        self.engine.start()
        self._thread.start()

    def shutdown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Stop the engine, drain the responses, answer whatever is still live with an error, and let go of every
        object of the backend's (senders, metrics), all within about `timeout_s` seconds.

        Called from `finalize()`, while tritonserver still listens to this process. What the backend's objects do when
        they are destroyed (a metric or a metric family deletes itself in the server) must happen now: left to the
        stub's own teardown, after the server has let go of the stub's shared memory, it crashed the stub or hung it.
        """
        deadline = time.monotonic() + timeout_s
        try:
            self.engine.shutdown(timeout=timeout_s * 0.8)
        except Exception as exc:  # (what follows must still happen: every request answered, every object let go)
            self.logger.log_error(f"[dsv4] stopping the engine failed: {exc}")
        self._stop.set()
        self._thread.join(timeout=max(0.5, deadline - time.monotonic()))
        with self._lock:
            leftovers, self._live = list(self._live.values()), {}
        for live in leftovers:  # (the response thread may still be sending one of theirs: after it, or not at all)
            self._answer_with_error(live, SHUTTING_DOWN, wait_s=max(0.25, deadline - time.monotonic()))
        leftovers.clear()
        self.metrics.close()
        if self.stop_watch.health is not None:
            self.stop_watch.health.close()  # (a gRPC channel's threads)

    # --- requests in ----------------------------------------------------------------------------
    def submit(self, request) -> None:
        """Parse and hand one request to the engine; a bad request is answered at once, never raised."""
        timer = RequestTimer()  # (its arrival: before the prompt is tokenized and its chat template rendered)
        sender = request.get_response_sender()
        request_id = f"{request.request_id() or 'req'}-{uuid.uuid4().hex[:12]}"
        live = None
        try:
            if self.stop_watch.must_end(time.monotonic()):  # (tritonserver routes none to a stopping model)
                raise EngineUnavailable(self.stop_watch.message())
            inputs = triton_io.to_numpy_inputs(
                list(triton_io.INPUT_NAMES), lambda name: self.pb.get_input_tensor_by_name(request, name))
            parsed = triton_io.parse_request(inputs, self.engine.tokenizer, request.parameters(),
                                             self.engine.chat_template)
            seq = Sequence(request_id, parsed.prompt_ids, parsed.sampling, priority=parsed.priority)
            live = _Live(sender, triton_io.ResponseBuilder(parsed, self.engine.tokenizer), timer)
            with self._lock:
                self._live[request_id] = live
            self.processor.add(request_id, parsed.sampling)
            self.engine.submit(seq, self._outputs.put)
            with self._lock:
                answered_meanwhile = request_id not in self._live
            if answered_meanwhile:  # (the server's stop ended it before the engine knew it: the abort found nothing)
                self._abort(request_id)
                self.processor.discard(request_id)
        except Exception as exc:  # a bad request, or one the engine refuses: answer it, stay up
            # (listed, the response thread may have answered it already: an engine that failed it, then raised)
            with self._lock:
                self._live.pop(request_id, None)
            live = live or _Live(sender, None)
            self._abort(request_id)  # (an engine that queued it before it raised: it ends, its pages freed)
            self.processor.discard(request_id)
            refused = isinstance(exc, ValueError)  # (a bad request, or a full queue: EngineUnavailable)
            code = "UNAVAILABLE" if isinstance(exc, EngineUnavailable) else "INVALID_ARG" if refused else "INTERNAL"
            message = str(exc) if refused else f"internal error: {exc}"  # (503 / 400 / 500)
            if self._answer_with_error(live, message, getattr(self.pb.TritonError, code, None)):
                self._measure(self.metrics.on_finished, FinishReason.ERROR.value)

    # --- responses out --------------------------------------------------------------------------
    def _response_loop(self) -> None:
        next_poll = next_stats = 0.0
        while not (self._stop.is_set() and self._outputs.empty()):
            for output in self._take_outputs():
                try:
                    self._handle(output)
                except Exception as exc:  # (this thread answers every request: it outlives what fails for one)
                    self.logger.log_error(f"[dsv4] handling an output failed: {exc}")
            now = time.monotonic()
            if now >= next_poll:
                try:
                    self._poll_cancelled()
                except Exception as exc:  # (a sender's is_cancelled() failing)
                    self.logger.log_error(f"[dsv4] asking for cancellations failed: {exc}")
                next_poll = now + self.poll_s
            if now >= next_stats:
                self._update_stats()
                next_stats = now + self.stats_s
            try:
                self._watch_for_stop(now)
            except Exception as exc:  # (this thread answers every request: it outlives what fails here)
                self.logger.log_error(f"[dsv4] acting on the server's stop failed: {exc}")

    def _take_outputs(self) -> list:
        """What the engine queued (waiting up to poll_s for it), each request's outputs merged into one response's
        worth (output_processor.coalesce): one response per step while this thread keeps up, fewer carrying more
        tokens when sending falls behind."""
        try:
            outputs = [self._outputs.get(timeout=self.poll_s)]
        except queue.Empty:
            return []
        while len(outputs) < MAX_OUTPUTS_TAKEN:
            try:
                outputs.append(self._outputs.get_nowait())
            except queue.Empty:
                break
        return coalesce(outputs)

    def _handle(self, output) -> None:
        try:
            output = self.processor.process(output)
        except Exception as exc:  # (its text could not be made: that request ends, the thread that answers all goes on)
            self.logger.log_error(f"[dsv4] the text of {output.request_id}'s output failed: {exc}")
            self._abort(output.request_id)
            self.processor.discard(output.request_id)
            output = replace(output, new_token_ids=[], logprobs=None, new_text="", finished=True,
                             finish_reason=FinishReason.ERROR, error=f"internal error: {exc}")
        if output is None:
            return  # the request ended at a stop string: the engine's later outputs are dropped
        with self._lock:
            live = self._live.get(output.request_id)
        if live is None:
            return  # already answered (an error while sending, or shutdown)
        with live.sending:
            if not live.answered:
                self._send_for(output, live)

    def _send_for(self, output, live: _Live) -> None:
        """The response(s) of one output (holding its request's `sending` lock)."""
        final_sent = False
        if output.new_token_ids:
            self._measure(self.metrics.on_tokens, live.timer)
        try:
            if output.finished and not output.error and live.sender.is_cancelled():
                output = replace(output, finish_reason=FinishReason.CANCELLED)  # (as any cancelled request ends)
            if output.error or output.finish_reason == FinishReason.CANCELLED or live.failed:
                final_sent = self._send_end_error(live, output)
            else:
                final_sent = self._send_output(output.request_id, live, output)
        except Exception as exc:
            self.logger.log_error(f"[dsv4] sending a response for {output.request_id} failed: {exc}")
            live.failed = f"internal error: {exc}"  # (if this error cannot go out either: sent at the abort's end)
            final_sent = self._send_error(live.sender, live.failed)
            self._abort(output.request_id)
        finally:
            if output.finished or final_sent:
                self._retire(output, live, final_sent)

    def _abort(self, request_id: str) -> bool:
        """engine.abort from this thread, which answers every request: what fails in it is logged (False), not raised
        (an error being sent still goes out, the other requests' cancellations still go through)."""
        try:
            return self.engine.abort(request_id)
        except Exception as exc:
            self.logger.log_error(f"[dsv4] aborting {request_id} failed: {exc}")
            return False

    def _send_end_error(self, live: _Live, output) -> bool:
        if live.failed or output.error:
            return self._send_error(live.sender, live.failed or output.error)
        return self._send_error(live.sender, "request cancelled", getattr(self.pb.TritonError, "CANCELLED", None))

    def _send_output(self, request_id: str, live: _Live, output) -> bool:
        """Send the response the builder makes of `output`, if any, and after the last one the FINAL; True when the
        FINAL went out."""
        arrays = live.builder.on_output(output)
        if arrays is None:
            return False
        # (cancelled: nothing more goes out before the CANCELLED end, no text with a hole in it; a last output, asked
        # about by `_send_for` already, goes out whole)
        if live.cancelling or (not output.finished and self._cancelled_now(request_id, live)):
            self._cancel(request_id, live)
            return False
        tensors = [self.pb.Tensor(name, array) for name, array in arrays.items()]
        live.sender.send(self.pb.InferenceResponse(output_tensors=tensors))
        if output.finished:
            # The FINAL goes out alone. tritonserver's HTTP generate endpoints end the client's reply on a FINAL
            # response before they delete it, and a server stopped in between (a Ctrl-C right after the answer) has
            # freed the allocator of its outputs by then: it crashed at the stop. A bare FINAL has no outputs, and
            # send() returns only after tritonserver has deleted the response before it.
            live.sender.send(flags=self.final_flag)
        return output.finished

    def _retire(self, output, live: _Live, final_sent: bool) -> None:
        live.answered = True
        with self._lock:
            self._live.pop(output.request_id, None)
        self.processor.discard(output.request_id)
        if not final_sent:
            self._send_final_flag(live.sender)
        reason = FinishReason.ERROR if live.failed else output.finish_reason or FinishReason.ERROR
        self._measure(self.metrics.on_finished, reason.value)

    def _measure(self, record, *args) -> None:
        """A metric's update; one that fails is logged, and never stops a response or fails a request."""
        try:
            record(*args)
        except Exception as exc:
            self.logger.log_warn(f"[dsv4] a metric update failed: {exc}")

    def _poll_cancelled(self) -> None:
        # Asked under the lock: a request refused in submit() leaves the table (under it) before its error FINAL
        # goes out from that thread, and tritonserver frees a sender once its FINAL is out (asking it then crashed
        # the server, in TRITONBACKEND_ResponseFactoryIsCancelled).
        with self._lock:
            cancelled = [(request_id, live) for request_id, live in self._live.items()
                         if not live.cancelling and self._cancelled_now(request_id, live)]
        for request_id, live in cancelled:
            self._cancel(request_id, live)

    def ask_interval_s(self) -> float:
        """How often a live request's sender is asked whether the client cancelled (see MAX_CANCEL_ASKS_PER_S)."""
        return max(self.poll_s, len(self._live) / self.max_cancel_asks_per_s)

    def _cancelled_now(self, request_id: str, live: _Live) -> bool:
        """Whether the client cancelled, if its sender is due to be asked (False otherwise: asked again later). One
        sender failing to say is logged and asked again next time, while every other request's cancellation still
        goes through."""
        now = time.monotonic()
        if now - live.asked_at < self.ask_interval_s():
            return False
        live.asked_at = now
        try:
            return live.sender.is_cancelled()
        except Exception as exc:
            self.logger.log_error(f"[dsv4] asking whether {request_id} was cancelled failed: {exc}")
            return False

    def _cancel(self, request_id: str, live: _Live) -> None:
        """The client cancelled: the engine aborts at its next step and answers CANCELLED. A request that submit() has
        not handed to the engine yet (a cancellation while it is parsed or placed) is asked again at the next poll."""
        if not live.cancelling:
            live.cancelling = self._abort(request_id)

    def _watch_for_stop(self, now: float) -> None:
        """Once tritonserver stops (or unloads this model) and the requests running have had their grace, each still
        running ends with an UNAVAILABLE error, its pages freed: only then can the model unload, within the server's
        exit timeout."""
        watch = self.stop_watch
        if watch.since is None and not self._live:
            return  # (asked while requests run, and, once a stop is seen, until it is confirmed or cleared)
        seen = watch.since
        note = watch.check(now)
        if note:
            self.logger.log_warn(f"[dsv4] {note}")
        if seen is None and watch.since is not None:
            running = len(self._live)
            self.logger.log_info(f"[dsv4] {watch.reason} (seen {watch.seen_over}): the {running} "
                                 f"request{'s' * (running != 1)} running get{'s' * (running == 1)} "
                                 f"{watch.grace_s:g} s to finish (stop_grace_s)")
        if watch.must_end(now):
            self._end_live_requests(watch.message())

    def _end_live_requests(self, message: str) -> None:
        with self._lock:
            ending, self._live = list(self._live.items()), {}
        self.logger.log_warn(f"[dsv4] ending {len(ending)} requests unfinished: {message}")
        for request_id, live in ending:
            self._abort(request_id)
            self.processor.discard(request_id)
            if self._answer_with_error(live, message, getattr(self.pb.TritonError, "UNAVAILABLE", None)):
                self._measure(self.metrics.on_finished, FinishReason.ERROR.value)

    def _update_stats(self) -> None:
        try:
            stats = self.engine.stats()
            self.metrics.update(stats)
            self.metrics.on_grammar_compiles(self.engine.take_grammar_compile_seconds())
        except Exception as exc:
            self.logger.log_warn(f"[dsv4] engine.stats() failed: {exc}")
            return
        if stats.get("unavailable") and not self._unload_requested and self._may_unload:
            self._report_not_ready(stats["unavailable"])

    def _report_not_ready(self, reason: str) -> None:
        """The engine can never serve again: ask Triton to unload this model so that its ready endpoint says
        so (as Triton's vLLM backend does; the `unload_when_unavailable` parameter, which needs
        --model-control-mode=explicit). Otherwise the model stays loaded, refusing every request as UNAVAILABLE."""
        self._unload_requested = True
        self.logger.log_error(f"[dsv4] the engine cannot serve any more ({reason}); unloading the model")
        try:
            self.pb.unload_model(self.model_name)  # non-blocking: finalize() runs once the in-flight requests end
        except Exception as exc:  # noqa: BLE001 (the server refused it all the same)
            self.logger.log_warn(f"[dsv4] cannot unload the model ({exc}): it stays loaded, answering UNAVAILABLE")

    def _answer_with_error(self, live: _Live, message: str, code=None, wait_s: float = -1) -> bool:
        """An error FINAL, sent outside the response thread's own output path, unless the request was answered already
        (or a response of it is still going out after `wait_s` seconds; -1: as long as it takes); True when this
        call answered it."""
        if not live.sending.acquire(timeout=wait_s):
            self.logger.log_warn(f"[dsv4] a response still going out: left unanswered ({message})")
            return False
        try:
            if live.answered:
                return False
            live.answered = True
            if not self._send_error(live.sender, message, code):
                self._send_final_flag(live.sender)  # (the request must still end)
            return True
        finally:
            live.sending.release()

    def _send_error(self, sender, message: str, code=None) -> bool:
        """Send an error response flagged FINAL; True when it went out."""
        error = self.pb.TritonError(message, code) if code is not None else self.pb.TritonError(message)
        try:
            sender.send(self.pb.InferenceResponse(output_tensors=[], error=error), flags=self.final_flag)
            return True
        except Exception as exc:
            self.logger.log_warn(f"[dsv4] could not send an error response: {exc}")
            return False

    def _send_final_flag(self, sender) -> None:
        try:
            sender.send(flags=self.final_flag)
        except Exception as exc:
            self.logger.log_warn(f"[dsv4] could not send the final flag: {exc}")
