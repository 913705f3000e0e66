"""A stand-in for tritonserver's `triton_python_backend_utils` (pb_utils): the parts the adapter and
the metrics use, recording what they send instead of talking to a server."""

from __future__ import annotations

import threading
import time


class FakeMetric:
    def __init__(self, labels, buckets=None):
        self.labels, self.buckets = labels, buckets
        self.value, self.observed = 0.0, []

    def increment(self, delta):
        assert delta > 0, "Triton counters only go up"
        self.value += delta

    def set(self, value):
        self.value = value

    def observe(self, value):
        self.observed.append(value)


class FakeFamily:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    created = {}

    def __init__(self, name, description, kind):
        self.name, self.kind, self.metrics = name, kind, []
        FakeFamily.created[name] = self

    def Metric(self, labels, buckets=None):  # noqa: N802 (pb_utils' name)
        if self.kind == self.HISTOGRAM:
            assert buckets, "histograms need buckets"
        metric = FakeMetric(labels, buckets)
        self.metrics.append(metric)
        return metric


class Tensor:
    def __init__(self, name, array):
        self.name, self.array = name, array

    def as_numpy(self):
        return self.array


class TritonError:
    INVALID_ARG, CANCELLED, UNAVAILABLE = "INVALID_ARG", "CANCELLED", "UNAVAILABLE"

    def __init__(self, message, code=None):
        self.message, self.code = message, code


class InferenceResponse:
    def __init__(self, output_tensors=(), error=None):
        self.outputs = {t.name: t.array for t in output_tensors}
        self.error = error


class Logger:
    lines: list[str] = []

    @classmethod
    def log_info(cls, message):
        cls.lines.append(message)

    log_warn = log_error = log_info


class FakePbUtils:
    """Pass the class itself where the adapter expects the pb_utils module."""

    MetricFamily = FakeFamily
    Tensor, TritonError, InferenceResponse, Logger = Tensor, TritonError, InferenceResponse, Logger
    TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1

    @staticmethod
    def get_input_tensor_by_name(request, name):
        array = request.inputs.get(name)
        return None if array is None else Tensor(name, array)

    # What is_model_ready answers: True / False, or an exception it raises (as the real one does once the server
    # stops); every call is recorded as (model name, version).
    readiness: bool | Exception = True
    readiness_asks: list[tuple[str, str]] = []

    @classmethod
    def is_model_ready(cls, model_name, model_version=""):
        cls.readiness_asks.append((model_name, model_version))
        if isinstance(cls.readiness, Exception):
            raise cls.readiness
        return cls.readiness


class Sender:
    """A response sender: records (response, flags); `fail_sends` makes the next sends raise.

    Once a FINAL has gone out, tritonserver frees the request's response factory: asking is_cancelled() then
    crashes the real server (a segfault in TRITONBACKEND_ResponseFactoryIsCancelled). The fake records it
    (`asked_after_final`), and every sender made is listed in `Sender.made`, for tests to check."""

    made: list["Sender"] = []

    def __init__(self):
        self.sent: list[tuple[InferenceResponse | None, int]] = []
        self.cancelled = False
        self.fail_sends = 0
        self.asked_after_final = False
        self.asks = 0  # is_cancelled() calls
        self.lock = threading.Lock()
        Sender.made.append(self)

    def send(self, response=None, flags=0):
        with self.lock:
            if self.fail_sends:
                self.fail_sends -= 1
                raise RuntimeError("the client went away")
            self.sent.append((response, flags))

    def is_cancelled(self):
        time.sleep(0.0002)  # the real call is a round trip to the server (the GIL is released meanwhile)
        with self.lock:
            self.asks += 1
            if self.num_finals:
                self.asked_after_final = True
            return self.cancelled

    @property
    def num_finals(self) -> int:
        return sum(1 for _, flags in self.sent if flags & FakePbUtils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


class Request:
    def __init__(self, inputs: dict, parameters: str = "{}", request_id: str = "r"):
        self.inputs, self._parameters, self._id = inputs, parameters, request_id
        self.sender = Sender()

    def get_response_sender(self):
        return self.sender

    def parameters(self):
        return self._parameters

    def request_id(self):
        return self._id
