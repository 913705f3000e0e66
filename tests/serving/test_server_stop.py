"""tritonserver stopping with requests running (backend/serving/server_stop.py, and the adapter acting on it).

tritonserver never tells a model that it stops; it waits up to its exit timeout for the model's requests to end. The
model sees its readiness fail (tritonserver's HTTP endpoint closes, or "Server not ready"), gives the requests running
`stop_grace_s`, then ends the rest with one UNAVAILABLE FINAL each, freeing their pages, so that the model can unload
in time. The same runs in a real tritonserver in tests/e2e/test_clean_stop.py.
"""

from __future__ import annotations

import http.server
import socket
import subprocess
import sys
import threading
import time

import pytest
from fake_pb_utils import FakePbUtils, Logger, Sender
from test_adapter_loop import errors_of, finished, request, tokens_of, wait_final

from backend.config import EngineConfig
from backend.serving import server_stop
from backend.serving.adapter import TritonAdapter
from tests.e2e.fake_engine import LLMEngine as FakeEngine
from tests.e2e.fake_engine import expected_ids

GRACE_S = 0.5
SERVER_STOPPING = RuntimeError("Failed to check model readiness: Failed to process the request for model 'dsv4_0_0', "
                               "message: Server not ready")


@pytest.fixture
def adapter(monkeypatch):
    monkeypatch.setattr(FakePbUtils, "readiness", True)
    monkeypatch.setattr(FakePbUtils, "readiness_asks", [])
    engine = FakeEngine(EngineConfig(max_tokens_limit=1000, stop_grace_s=GRACE_S))
    adapter = TritonAdapter(engine, FakePbUtils, "dsv4", "1", poll_s=0.005, stats_s=0.01, stop_check_s=0.01)
    adapter.start()
    Sender.made.clear()
    yield adapter
    adapter.shutdown()


def wait_tokens(req, count: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while len(tokens_of(req)) < count:
        assert time.monotonic() < deadline, "no tokens in time"
        time.sleep(0.005)


def test_requests_still_running_after_the_grace_end_with_one_unavailable_final_and_free_their_pages(adapter):
    long_one, short_one = request("long", max_tokens=900), request("short", max_tokens=5)
    adapter.submit(long_one)
    wait_tokens(long_one, 3)
    adapter.submit(short_one)
    FakePbUtils.readiness = SERVER_STOPPING
    stopped = time.monotonic()
    wait_final(long_one, short_one)
    # The short one finished within the grace, whole; the long one ended after it, with the tokens it had.
    assert short_one.sender.num_finals == 1 and errors_of(short_one) == []
    assert tokens_of(short_one) == expected_ids(list(b"short"), 5)
    assert long_one.sender.num_finals == 1 and time.monotonic() - stopped >= GRACE_S
    assert errors_of(long_one) == ["tritonserver is stopping: the request was ended unfinished 0.5 s after that "
                                   "(stop_grace_s)"]
    assert long_one.sender.sent[-1][0].error.code == "UNAVAILABLE"
    assert 3 <= len(tokens_of(long_one)) < 900
    assert tokens_of(long_one) == expected_ids(list(b"long"), len(tokens_of(long_one)))
    deadline = time.monotonic() + 5
    while adapter.engine._running and time.monotonic() < deadline:  # (aborted at the engine's next step)
        time.sleep(0.005)
    assert adapter._live == {} and adapter.engine._running == {}
    assert finished(adapter, "error") == 1 and finished(adapter, "length") == 1


def test_a_model_being_unloaded_ends_its_requests_the_same_way(adapter):
    req = request("unloading", max_tokens=900)
    adapter.submit(req)
    wait_tokens(req, 1)
    FakePbUtils.readiness = False  # (an explicit unload, a new version: the server itself still serves)
    wait_final(req)
    assert errors_of(req) == ["the model is being unloaded: the request was ended unfinished 0.5 s after that "
                              "(stop_grace_s)"]


@pytest.mark.parametrize("error", [
    "Failed to check model readiness: Failed to process the request for model 'dsv4', message: 'dsv4' version 1 is "
    "not at ready state",
    "Failed to check model readiness: ... 'dsv4' version 1 is not found",
])
def test_readiness_failing_because_the_model_unloads_is_a_stop(error):
    assert server_stop.stop_reason(error) == "the model is being unloaded"


def test_failing_to_ask_is_not_a_stop_and_is_asked_again_backing_off_logged_once(adapter, monkeypatch):
    monkeypatch.setattr(Logger, "lines", [])
    FakePbUtils.readiness = RuntimeError("Failed to check model readiness: the shared memory is full")
    req = request("goes on", max_tokens=60)  # (0.6 s of the fake engine's steps: 60 checks' worth at 0.01 s)
    adapter.submit(req)
    wait_final(req, timeout=20)
    assert errors_of(req) == [] and tokens_of(req) == expected_ids(list(b"goes on"), 60)
    assert 1 < len(FakePbUtils.readiness_asks) <= 7 and adapter.stop_watch.since is None  # (0.02, 0.04, .. 0.64 s)
    assert sum("cannot tell whether the model still serves" in line for line in Logger.lines) == 1


def test_a_python_backend_without_is_model_ready_is_never_asked():
    watch = server_stop.ServerStopWatch(object(), "dsv4", grace_s=1)
    assert watch.check(0.0) is None and watch.since is None and not watch.must_end(100.0)


def test_a_request_the_stop_ends_while_it_is_handed_to_the_engine_does_not_run_on(adapter, monkeypatch):
    """The engine forgets an abort of a request it does not know yet: one ended between entering the adapter's table
    and reaching the engine must be aborted again once there, or it decodes to its end for no one."""
    engine = adapter.engine
    real_submit, real_abort = engine.submit, engine.abort

    def submit_after_the_stop_ended_it(seq, on_output):
        adapter._end_live_requests("tritonserver is stopping")  # (what the response thread does meanwhile)
        real_submit(seq, on_output)

    def abort_known_only(request_id):  # (as the real engine: an unknown request's abort is not remembered)
        with engine._lock:
            known = request_id in engine._running
        return real_abort(request_id) if known else False

    monkeypatch.setattr(engine, "submit", submit_after_the_stop_ended_it)
    monkeypatch.setattr(engine, "abort", abort_known_only)
    req = request("in between", max_tokens=900)
    adapter.submit(req)
    wait_final(req)
    assert errors_of(req) == ["tritonserver is stopping"] and req.sender.num_finals == 1
    deadline = time.monotonic() + 5
    while engine._running and time.monotonic() < deadline:
        time.sleep(0.005)
    assert engine._running == {} and adapter.processor._streams == {}


def test_readiness_is_asked_only_while_requests_run_and_never_again_once_a_stop_is_seen(adapter):
    """Each ask holds the stub's GIL until tritonserver answers; asked every 0.5 s during a real stop, it stopped
    being answered within seconds."""
    time.sleep(0.1)
    assert FakePbUtils.readiness_asks == []  # (idle: nothing to end)
    req = request("asked", max_tokens=900)
    adapter.submit(req)
    wait_tokens(req, 3)
    assert FakePbUtils.readiness_asks and set(FakePbUtils.readiness_asks) == {("dsv4", "1")}
    FakePbUtils.readiness = SERVER_STOPPING
    wait_final(req)
    asks = len(FakePbUtils.readiness_asks)
    later = request("too late", max_tokens=5)  # (tritonserver routes none to a stopping model: a straggler)
    adapter.submit(later)
    wait_final(later)
    time.sleep(0.1)
    assert len(FakePbUtils.readiness_asks) == asks
    assert errors_of(later) == [adapter.stop_watch.message()]


def test_the_grace_defaults_to_what_the_servers_exit_timeout_leaves():
    server = _fake_tritonserver
    servers = [server("--exit-timeout-secs=12"), server("--exit-timeout-secs", "7"), server("--http-port=1"),
               server("--exit-timeout-secs=10", "--exit-timeout-secs=3"), server("--exit-timeout=9"),
               server("--exit-t", "4"), server("--exit-on-error=false")]
    try:
        assert [server_stop.exit_timeout_s(s.pid) for s in servers] == [12, 7, 30, 3, 9, 4, 30]
        assert server_stop.default_grace_s(servers[0].pid) == 12 - server_stop.STOP_MARGIN_S
        assert server_stop.default_grace_s(servers[3].pid) == 0
    finally:
        for s in servers:
            s.kill()
            s.wait()
    assert server_stop.exit_timeout_s(servers[0].pid) == server_stop.DEFAULT_EXIT_TIMEOUT_S  # (gone)


def test_a_grace_longer_than_the_exit_timeout_leaves_is_warned_about():
    server = _fake_tritonserver("--exit-timeout-secs=10")
    try:
        assert server_stop.grace_warning(10 - server_stop.STOP_MARGIN_S, server.pid) is None
        assert "runs out that timeout" in server_stop.grace_warning(30, server.pid)
    finally:
        server.kill()
        server.wait()


def test_failed_asks_back_off_no_further_than_a_stop_can_wait():
    """However long asks failed, once they work again a stop is seen within MAX_CHECK_INTERVAL_S."""
    pb = type("Pb", (), {"answer": RuntimeError("Failed to check model readiness: busy")})

    def is_model_ready(name, version=""):
        if isinstance(pb.answer, Exception):
            raise pb.answer
        return pb.answer

    pb.is_model_ready = staticmethod(is_model_ready)
    watch, now = server_stop.ServerStopWatch(pb, "dsv4", grace_s=1), 0.0
    while now < 100:  # (100 s of failures)
        watch.check(now)
        now += 0.1
    pb.answer = SERVER_STOPPING
    stopped = now
    while watch.since is None:
        watch.check(now)
        now += 0.1
    assert now - stopped <= server_stop.MAX_CHECK_INTERVAL_S + 0.2


def _fake_tritonserver(*args: str) -> subprocess.Popen:
    """A process whose command line reads as tritonserver's (argv[0] `tritonserver`, then `args`), once returned."""
    script = "import time; time.sleep(60)"
    process = subprocess.Popen(["bash", "-c", f'exec -a /opt/bin/tritonserver {sys.executable} -c "{script}" "$@"',
                                "x", *args])
    deadline = time.monotonic() + 10
    while server_stop.server_argv(process.pid)[:1] != ["/opt/bin/tritonserver"] and time.monotonic() < deadline:
        time.sleep(0.01)  # (until bash has exec'd)
    return process


def test_tritonservers_http_endpoint_is_read_from_its_command_line():
    servers = [_fake_tritonserver(), _fake_tritonserver("--http-port=9001", "--http-address", "10.1.2.3"),
               _fake_tritonserver("--http-p", "9002", "--http-a=ipv6:[::1]"),
               _fake_tritonserver("--http-address=ipv4:0.0.0.0", "--http-port=9003"),
               _fake_tritonserver("--allow-h", "0", "--allow-http=true", "--http-port=1"),
               _fake_tritonserver("--allow-http=false"), _fake_tritonserver("--http-address=unix:/tmp/triton.sock"),
               _fake_tritonserver("--reuse-http-port=true")]
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "--http-port=9003"])
    try:
        found = [server_stop.HttpHealth.of_server(p.pid) for p in servers]
        assert [h and h.base_url for h in found] == [
            "http://127.0.0.1:8000", "http://10.1.2.3:9001", "http://[::1]:9002", "http://127.0.0.1:9003",
            "http://127.0.0.1:1", None, None, None]
        assert server_stop.HttpHealth.of_server(other.pid) is None  # (not a tritonserver: an embedded server, a test)
    finally:
        for p in [*servers, other]:
            p.kill()
            p.wait()


def test_without_http_the_stop_is_asked_over_tritonservers_grpc_endpoint():
    """tritonserver serving no HTTP of its own (--allow-http=false, a unix socket, a shared port): its gRPC endpoint,
    read from the same command line, unless it serves none either."""
    servers = [_fake_tritonserver("--allow-http=false"),
               _fake_tritonserver("--allow-h", "0", "--grpc-port", "9101", "--grpc-address=10.1.2.3"),
               _fake_tritonserver("--http-address=unix:/tmp/triton.sock", "--grpc-a", "::1", "--grpc-p=9102"),
               _fake_tritonserver("--allow-http=false", "--allow-grpc=false"),
               _fake_tritonserver("--allow-http=false", "--reuse-grpc-port=1"),
               _fake_tritonserver("--allow-http=false", "--grpc-use-ssl=true"), _fake_tritonserver()]
    try:
        found = [server_stop.ServerStopWatch.endpoint_of(p.pid) for p in servers]
        assert [h and (h.name, h.where) for h in found] == [
            ("gRPC", "gRPC at 127.0.0.1:8001"), ("gRPC", "gRPC at 10.1.2.3:9101"), ("gRPC", "gRPC at [::1]:9102"),
            None, None, None, ("HTTP", "http://127.0.0.1:8000")]
    finally:
        for p in servers:
            p.kill()
            p.wait()


class _FakeTritonGrpc:
    """tritonserver's gRPC health RPCs as 2.51 answers them: ModelReady and ServerLive, or, from its stop on,
    UNAVAILABLE "Server not ready" and "Server exiting"; `delay_s` holds every answer back."""

    def __init__(self):
        import grpc
        from concurrent.futures import ThreadPoolExecutor

        from tritonclient.grpc import service_pb2, service_pb2_grpc

        fake = self
        self.model_ready, self.live, self.stopping, self.delay_s = True, True, False, 0.0

        class Servicer(service_pb2_grpc.GRPCInferenceServiceServicer):
            def ModelReady(self, request, context):
                time.sleep(fake.delay_s)
                if fake.stopping:
                    context.abort(grpc.StatusCode.UNAVAILABLE, "Server not ready")
                return service_pb2.ModelReadyResponse(ready=fake.model_ready)

            def ServerLive(self, request, context):
                time.sleep(fake.delay_s)
                if fake.stopping:
                    context.abort(grpc.StatusCode.UNAVAILABLE, "Server exiting")
                return service_pb2.ServerLiveResponse(live=fake.live)

        self.server = grpc.server(ThreadPoolExecutor(max_workers=2))
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(Servicer(), self.server)
        self.url = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()


@pytest.fixture
def fake_grpc():
    fake = _FakeTritonGrpc()
    yield fake
    fake.server.stop(0)


def test_grpc_health_tells_ready_unloading_and_stopping_as_tritonserver_answers(fake_grpc, monkeypatch):
    """Through a proxy in the environment too: gRPC would follow http_proxy even to 127.0.0.1."""
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    monkeypatch.setenv("grpc_proxy", "http://127.0.0.1:9")
    monkeypatch.delenv("no_proxy", raising=False)
    health = server_stop.GrpcHealth(fake_grpc.url)
    try:
        assert health.stop_reason("dsv4", "1") is None
        fake_grpc.model_ready = False
        assert health.stop_reason("dsv4", "1") == "the model is being unloaded"
        fake_grpc.stopping = True
        assert health.stop_reason("dsv4", "1") == "tritonserver is stopping"
        fake_grpc.stopping, fake_grpc.delay_s = False, 0.5  # (slower than the ask's timeout: not a stop)
        with pytest.raises(server_stop.HealthUnknown, match="DEADLINE_EXCEEDED"):
            health.stop_reason("dsv4", "1")
        fake_grpc.delay_s = 0.0
        fake_grpc.server.stop(0).wait()  # (the server gone once it had answered: a stop; an ask while it is still
        # stopping may be CANCELLED, which says nothing either way)
        assert health.stop_reason("dsv4", "1") == "tritonserver is stopping"
        health.close()
        with pytest.raises(server_stop.HealthUnknown, match="closed"):
            health.stop_reason("dsv4", "1")
    finally:
        health.close()


def test_a_grpc_endpoint_that_is_not_there_tells_nothing_until_it_has_answered():
    """Nothing listens: HealthUnknown (the watch then asks is_model_ready), not a stop."""
    with socket.socket() as sock:  # (a port nothing listens on)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    health = server_stop.GrpcHealth(f"127.0.0.1:{port}")
    try:
        with pytest.raises(server_stop.HealthUnknown, match="is_model_ready: .*UNAVAILABLE"):
            health.stop_reason("dsv4")
        health.answered = True  # (once it has answered, a lost connection is the server gone: a stop)
        assert health.stop_reason("dsv4") == "tritonserver is stopping"
    finally:
        health.close()


DROP = -1  # (a status that closes the connection without an answer, as a stopping tritonserver does)
SLOW = -2  # (a status answered after the ask's timeout)


class _Health(http.server.BaseHTTPRequestHandler):
    """tritonserver's health endpoints, their statuses set by the test."""
    statuses: dict[str, int] = {}
    asked: list[str] = []

    def do_GET(self):
        _Health.asked.append(self.path)
        status = self.statuses.get(self.path, 404)
        if status == DROP:
            self.close_connection = True
            return
        if status == SLOW:
            time.sleep(1)
            status = 200
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def health_server(monkeypatch):
    monkeypatch.setattr(_Health, "statuses", {})
    monkeypatch.setattr(_Health, "asked", [])
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _health(server) -> server_stop.HttpHealth:
    return server_stop.HttpHealth(f"http://127.0.0.1:{server.server_address[1]}")


MODEL, LIVE = "/v2/models/dsv4:fp8/versions/1/ready", "/v2/health/live"


def test_the_http_asks_tell_serving_an_unload_and_a_stop_apart(health_server):
    health = _health(health_server)
    _Health.statuses = {MODEL: 200, LIVE: 200}  # (the name as it is: tritonserver matches the path undecoded)
    assert health.stop_reason("dsv4:fp8", "1") is None and _Health.asked == [MODEL]  # (one ask while it serves)
    _Health.statuses = {MODEL: 400, LIVE: 200}
    assert health.stop_reason("dsv4:fp8", "1") == "the model is being unloaded"
    _Health.statuses = {MODEL: 400, LIVE: 400}
    assert health.stop_reason("dsv4:fp8", "1") == "tritonserver is stopping"
    _Health.statuses = {MODEL: 503, LIVE: 503}
    assert health.stop_reason("dsv4:fp8", "1") == "tritonserver is stopping"
    _Health.statuses = {MODEL: 403}  # (a restricted endpoint: no answer either way)
    with pytest.raises(server_stop.HealthUnknown, match="HTTP 403"):
        health.stop_reason("dsv4:fp8", "1")
    _Health.statuses = {MODEL: DROP, LIVE: DROP}  # (new connections dropped while open ones hold the stop)
    assert health.stop_reason("dsv4:fp8", "1") == "tritonserver is stopping"
    health_server.shutdown()
    health_server.server_close()  # (a stopping tritonserver closes its HTTP service)
    assert health.stop_reason("dsv4:fp8", "1") == "tritonserver is stopping"


def test_a_lost_connection_tells_nothing_before_any_answer_and_a_stop_after_a_refusal(health_server):
    _Health.statuses = {MODEL: DROP, LIVE: DROP}
    with pytest.raises(server_stop.HealthUnknown, match="RemoteDisconnected"):
        _health(health_server).stop_reason("dsv4:fp8", "1")
    with socket.socket() as sock:  # (a port nothing listens on)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(server_stop.HealthUnknown, match="refused"):
        server_stop.HttpHealth(f"http://127.0.0.1:{port}").stop_reason("dsv4")
    restricted = _health(health_server)
    _Health.statuses = {"/v2/models/dsv4/ready": 403}
    with pytest.raises(server_stop.HealthUnknown):
        restricted.stop_reason("dsv4")
    health_server.shutdown()
    health_server.server_close()
    assert restricted.stop_reason("dsv4") == "tritonserver is stopping"  # (it answered before, if only with a 403)


def test_a_model_name_a_url_path_cannot_hold_as_it_is_asks_only_the_servers_liveness(health_server):
    _Health.statuses = {LIVE: 200}
    with pytest.raises(server_stop.HealthUnknown, match="URL path"):
        _health(health_server).stop_reason("ds v4")
    assert _Health.asked == [LIVE]
    _Health.statuses = {LIVE: 400}
    assert _health(health_server).stop_reason("ds v4") == "tritonserver is stopping"


def test_the_python_backends_ask_is_made_only_where_http_tells_nothing(health_server):
    """is_model_ready failing (the stop's "Server not ready") can crash the stub: it is the fallback, not the ask."""
    pb = type("Pb", (), {"asks": 0})

    def is_model_ready(name, version=""):
        pb.asks += 1
        raise SERVER_STOPPING

    pb.is_model_ready = staticmethod(is_model_ready)
    watch = server_stop.ServerStopWatch(pb, "dsv4", "1", grace_s=1, check_s=0.5, health=_health(health_server))
    _Health.statuses = {"/v2/models/dsv4/versions/1/ready": 200}
    assert watch.check(0.0) is None and watch.since is None and pb.asks == 0
    _Health.statuses = {}  # (404 everywhere: not tritonserver's endpoints after all)
    assert "HTTP 404" in watch.check(1.0) and watch.since == 1.0 and pb.asks == 1
    assert watch.reason == "tritonserver is stopping" and watch.seen_over == "through is_model_ready"
    malformed = server_stop.HttpHealth("http://[ipv6:[::1]]:8000")  # (whatever fails in the ask, the fallback asks)
    watch = server_stop.ServerStopWatch(pb, "dsv4", "1", grace_s=1, check_s=0.5, health=malformed)
    assert "HTTP told nothing" in watch.check(0.0) and watch.since == 0.0 and pb.asks == 2


def test_an_ask_that_times_out_or_fails_after_answers_is_never_a_stop(health_server):
    """Only a connection refused or dropped reads as a stop: a false one would end every request after the grace."""
    health = _health(health_server)
    _Health.statuses = {MODEL: 200}
    assert health.stop_reason("dsv4:fp8", "1") is None and health.answered
    for statuses in ({MODEL: SLOW, LIVE: SLOW}, {MODEL: 500}, {MODEL: 400, LIVE: 404}, {MODEL: 400, LIVE: SLOW}):
        _Health.statuses = statuses
        with pytest.raises(server_stop.HealthUnknown):
            health.stop_reason("dsv4:fp8", "1")


def test_an_http_ask_that_told_nothing_is_logged_once_and_its_answering_again(health_server):
    pb = type("Pb", (), {"is_model_ready": staticmethod(lambda name, version="": True)})
    watch = server_stop.ServerStopWatch(pb, "dsv4", "1", grace_s=1, check_s=0.5, health=_health(health_server))
    _Health.statuses = {"/v2/models/dsv4/versions/1/ready": 403}
    notes = [watch.check(t) for t in (0.0, 0.5, 1.0)]
    assert notes[0].startswith("asked is_model_ready: HTTP told nothing") and "403" in notes[0]
    assert notes[1:] == [None, None] and watch.seen_over == "through is_model_ready" and watch.since is None
    _Health.statuses = {"/v2/models/dsv4/versions/1/ready": 200}
    assert watch.check(1.5) == "tritonserver's HTTP answers again" and watch.check(2.0) is None
    assert watch.seen_over == "over HTTP"


def test_a_stop_reading_the_endpoint_takes_back_is_cleared_and_one_it_keeps_stands(health_server):
    """Both asks' connections dropped while tritonserver serves read as a stop; asked again (over the endpoint, never
    through is_model_ready), the model reads ready: the stop is cleared and said so, where before it stood for good and
    every later request was refused. A stop the endpoint keeps telling stands, and ends the requests after the
    grace."""
    watch = server_stop.ServerStopWatch(FakePbUtils, "dsv4", grace_s=GRACE_S, check_s=0.01,
                                        health=_health(health_server))
    _Health.statuses = {"/v2/models/dsv4/ready": 200}
    assert watch.check(0.0) is None and watch.since is None  # (it answered: a dropped connection now reads as a stop)
    _Health.statuses = {"/v2/models/dsv4/ready": DROP, LIVE: DROP}
    assert watch.check(1.0) is None and watch.reason == "tritonserver is stopping"
    assert watch.check(1.001) is None and watch.since == 1.0  # (not due yet)
    _Health.statuses = {"/v2/models/dsv4/ready": DROP, LIVE: DROP}
    assert watch.check(1.1) is None and watch.since == 1.0  # (the endpoint keeps telling it)
    assert watch.must_end(1.0 + GRACE_S)
    _Health.statuses = {"/v2/models/dsv4/ready": 200}
    note = watch.check(1.2)
    assert note == "tritonserver's HTTP endpoint says the model serves: 'tritonserver is stopping' was a reading, " \
                   "not a stop"
    assert watch.since is None and watch.reason is None and not watch.must_end(1.0 + GRACE_S)


def test_the_adapter_serves_on_once_a_stop_reading_is_taken_back(adapter, health_server):
    """The same through the adapter: a request running when the false stop is read is not ended after the grace, and
    a request arriving after the reading was taken back is served."""
    adapter.stop_watch.health = _health(health_server)
    _Health.statuses = {"/v2/models/dsv4/versions/1/ready": 200}
    running = request("running", max_tokens=400)
    adapter.submit(running)
    wait_tokens(running, 3)
    _Health.statuses = {"/v2/models/dsv4/versions/1/ready": DROP, LIVE: DROP}
    deadline = time.monotonic() + 5
    while adapter.stop_watch.since is None:
        assert time.monotonic() < deadline, "the stop reading was not seen"
        time.sleep(0.005)
    _Health.statuses = {"/v2/models/dsv4/versions/1/ready": 200}
    while adapter.stop_watch.since is not None:
        assert time.monotonic() < deadline, "the stop reading was not taken back"
        time.sleep(0.005)
    later = request("later", max_tokens=5)
    adapter.submit(later)
    wait_final(running, later)
    assert errors_of(running) == [] and len(tokens_of(running)) == 400
    assert errors_of(later) == [] and len(tokens_of(later)) == 5


def test_explicit_model_control_is_read_from_tritonservers_command_line():
    """unload_when_unavailable unloads the model only where tritonserver runs with --model-control-mode=explicit (its
    getopt prefixes too): elsewhere pb_utils.unload_model fails, and the Python backend frees the failure's message
    while the stub still reads it."""
    server = _fake_tritonserver
    servers = [server("--model-control-mode=explicit"), server("--model-control-mode", "explicit"),
               server("--model-cont=explicit"), server("--model-control-mode=poll"), server("--model-config-name=x"),
               server("--model-control-mode=explicit", "--model-control-mode=none")]
    try:
        assert [server_stop.explicit_model_control(s.pid) for s in servers] == [True, True, True, False, False, False]
    finally:
        for s in servers:
            s.kill()
            s.wait()


def test_a_model_that_cannot_serve_is_not_unloaded_without_explicit_model_control(monkeypatch):
    """With unload_when_unavailable and a server not in explicit mode (this test's parent), the adapter warns at start
    and never calls unload_model once the engine says it cannot serve."""
    unloads = []
    monkeypatch.setattr(FakePbUtils, "unload_model", staticmethod(unloads.append), raising=False)
    Logger.lines.clear()
    engine = FakeEngine(EngineConfig(max_tokens_limit=1000, unload_when_unavailable=True))
    monkeypatch.setattr(engine, "stats", lambda: {"unavailable": "rank 1 is gone"})
    adapter = TritonAdapter(engine, FakePbUtils, "dsv4", "1", poll_s=0.005, stats_s=0.01, stop_check_s=0.01)
    adapter.start()
    try:
        time.sleep(0.1)  # (several stats updates)
    finally:
        adapter.shutdown()
    assert unloads == [] and any("needs tritonserver --model-control-mode=explicit" in line for line in Logger.lines)
