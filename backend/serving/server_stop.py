"""Noticing that tritonserver is stopping (or unloading this model), and ending the requests still running in time.

tritonserver never tells a model that it stops. On SIGINT or SIGTERM it refuses new requests, starts unloading every
model and gives them `--exit-timeout-secs` to go; a decoupled model's requests do not count as in flight, but the model
is only unloaded once each of them has sent its FINAL response. Streams still decoding when the stop came held it past
the timeout, and tritonserver 2.51 then aborted, often crashing on its way out (Signal 11, with 16 streams of 2,000
tokens on this CPU).

What the model can see is its own readiness. `ServerStopWatch` asks for it every `check_s` while requests are running;
those running when the stop is seen get `grace_s` to finish, and those still running after it end with an UNAVAILABLE
error, in time for the model to unload and tritonserver to exit cleanly. By default the grace is what the server's
exit timeout leaves after the time the model needs to go (STOP_MARGIN_S).

It asks tritonserver's own HTTP endpoint (`HttpHealth`: the model's readiness, then the server's liveness to tell a
stop from an unload), where the stub's parent is a tritonserver serving HTTP on an address of its own. A stopping
tritonserver 2.51 closes its HTTP service at once (or, while HTTP connections are still open, drops each new one), so
a connection refused or dropped where the endpoint answered before is a stop. Where tritonserver serves no HTTP of its
own but gRPC (`--allow-http=false`, HTTP on a unix socket or a shared port), it asks tritonserver's gRPC health RPCs
(`GrpcHealth`): 2.51 keeps its gRPC service up through the stop (it closes it only once the models have unloaded), and
answers ServerLive with UNAVAILABLE "Server exiting" (ModelReady: "Server not ready") once `TRITONSERVER_ServerStop`
has begun, which is at once without HTTP, and after tritonserver has waited for its HTTP connections with it. Where
neither tells anything (gRPC over TLS, a restricted endpoint, no answer in time), it asks the Python backend's
`is_model_ready`.
That raises "Server not ready" from the moment the server stops (0.3-0.5 s after the signal), and a call that fails is
not safe in the Python backend (2.51, and its code as published since): the server frees the error text it sends the
stub as soon as the stub has read the answer's flag, while the stub is about to take that text and free it again.
When the stub's thread loses that race (about one stop in ten on the 2-core CPU under load), the stub crashes in its
shared-memory allocator (a core dump shows `Stub::SendMessage<ModelLoaderMessage>` freeing the `PbString`) or
freezes, and the stop runs out the exit timeout. An HTTP or gRPC ask has no such path. Any ask is made only while
requests run (there is nothing to end otherwise), and never again once the stop is seen.
"""

from __future__ import annotations

import os
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

# tritonserver's own default for --exit-timeout-secs.
DEFAULT_EXIT_TIMEOUT_S = 30.0
# What the stop needs after the last request has ended, out of the exit timeout: noticing the stop (check_s),
# tritonserver's one-second polls before and after the unload, finalize() (adapter.SHUTDOWN_TIMEOUT_S, 2.5 s), and a
# second for the stub's own exit and a loaded machine (3.2-3.4 s in all, measured on the 2-core CPU).
STOP_MARGIN_S = 6.0
# A failure to ask for readiness is asked again after check_s doubled per failure in a row, up to this: asks that far
# apart cannot freeze the stub for long (each could be one made during a stop), and a stop is still seen in time.
MAX_CHECK_INTERVAL_S = 2.0


def server_argv(server_pid: int) -> list[str]:
    """The command line of process `server_pid`; empty when it cannot be read (gone)."""
    try:
        raw = Path(f"/proc/{server_pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [arg.decode(errors="replace") for arg in raw.split(b"\0")]


def option_value(argv: list[str], name: str, shortest: str) -> str | None:
    """The value given to option `name` on `argv` (the last one given wins, as with any option); None when not given.
    tritonserver parses its options with getopt_long, which takes any unambiguous prefix of a name: `shortest` is the
    shortest one for `name`."""
    value = None
    for i, arg in enumerate(argv):
        given, equals, rest = arg.partition("=")
        if len(given) >= len(shortest) and name.startswith(given):
            value = rest if equals else argv[i + 1] if i + 1 < len(argv) else None
    return value


def exit_timeout_s(server_pid: int) -> float:
    """The --exit-timeout-secs on the command line of process `server_pid` (tritonserver), its default when not given
    or when the process cannot be read."""
    value = option_value(server_argv(server_pid), "--exit-timeout-secs", "--exit-t")
    try:
        return float(value) if value is not None else DEFAULT_EXIT_TIMEOUT_S
    except ValueError:
        return DEFAULT_EXIT_TIMEOUT_S


def explicit_model_control(server_pid: int) -> bool:
    """Whether tritonserver (process `server_pid`) runs with --model-control-mode=explicit: the one mode in which a
    model may unload itself (pb_utils.unload_model). In the others the call fails, and the Python backend frees the
    failure's message while the stub still reads it: not to be called there."""
    return option_value(server_argv(server_pid), "--model-control-mode", "--model-cont") == "explicit"


def default_grace_s(server_pid: int | None = None) -> float:
    """How long requests may go on once the stop is seen: the exit timeout of tritonserver (this stub's parent) less
    STOP_MARGIN_S."""
    return max(0.0, exit_timeout_s(os.getppid() if server_pid is None else server_pid) - STOP_MARGIN_S)


def grace_warning(grace_s: float, server_pid: int | None = None) -> str | None:
    """What to tell the operator of a stop_grace_s longer than tritonserver's exit timeout leaves: the stop then runs
    out the timeout whenever requests run past the grace."""
    fits = default_grace_s(server_pid)
    if grace_s <= fits:
        return None
    return (f"stop_grace_s={grace_s:g} is longer than tritonserver's --exit-timeout-secs leaves the requests running "
            f"at a stop ({fits:g} s, after the model's own {STOP_MARGIN_S:g} s): a stop with requests still running "
            f"then runs out that timeout")


class HealthUnknown(Exception):
    """A health ask that said nothing either way (refused, restricted, timed out)."""


class _Health:
    """What tritonserver's health endpoints (HTTP's, gRPC's) tell: its subclasses ask whether the model is ready and
    whether the server is live, each answering yes, no, or None for a connection lost once the endpoint had answered
    (the server gone: a stop, where the other ask says nothing else)."""

    def stop_reason(self, model_name: str, model_version: str = "") -> str | None:
        """None while the model is ready; else why not (the server stopping, or the model unloading). HealthUnknown
        when the endpoints answer neither way."""
        model = self._model_ready(model_name, model_version)
        if model:
            return None  # (one ask while it serves)
        if not self._live():
            return "tritonserver is stopping"
        if model is None:
            raise HealthUnknown(self._why_unknown(model_name, model_version))
        return "the model is being unloaded"

    def _model_ready(self, model_name: str, model_version: str) -> bool | None:
        raise NotImplementedError

    def _why_unknown(self, model_name: str, model_version: str) -> str:
        return f"the model {model_name!r} could not be asked for, while tritonserver is live"

    def _live(self) -> bool | None:
        raise NotImplementedError


class HttpHealth(_Health):
    """tritonserver's own HTTP health endpoints, asked over the address it serves them on."""

    name = "HTTP"

    # (what a URL path may hold as it is: tritonserver 2.51 matches the model name in the path without decoding it)
    PATH_SAFE = "!$&'()*+,;=:@-._~"

    def __init__(self, base_url: str, timeout_s: float = 0.25):
        self.base_url, self.timeout_s = base_url, timeout_s
        self.answered = False  # (whether the endpoint was ever there: until then, a lost connection tells nothing)
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # (never through a proxy)

    @classmethod
    def of_server(cls, server_pid: int) -> "HttpHealth | None":
        """Where process `server_pid` serves HTTP, from its command line: None unless it is a tritonserver serving HTTP
        on an address of its own (one serving gRPC only, or HTTP on a unix socket or a shared port, is asked over gRPC;
        a server embedded in another process, through the Python backend)."""
        address = _own_endpoint(server_pid, "http", "8000")
        return None if address is None else cls(f"http://{address}")

    @property
    def where(self) -> str:
        return self.base_url

    def close(self) -> None:
        pass

    def _model_ready(self, model_name: str, model_version: str) -> bool | None:
        """(None too for a name a URL path cannot hold as it is: not asked.)"""
        if not self._as_is(model_name, model_version):
            return None
        return self._ready(f"/v2/models/{model_name}" + (f"/versions/{model_version}" if model_version else "")
                           + "/ready")

    def _why_unknown(self, model_name: str, model_version: str) -> str:
        if not self._as_is(model_name, model_version):
            return f"the model name {model_name!r} cannot be asked for in a URL path as it is"
        return super()._why_unknown(model_name, model_version)

    def _as_is(self, *parts: str) -> bool:
        return all(urllib.parse.quote(part, safe=self.PATH_SAFE) == part for part in parts)

    def _live(self) -> bool | None:
        return self._ready("/v2/health/live")

    def _ready(self, path: str) -> bool | None:
        """200: yes; 400 or 503 (tritonserver's answers for not ready, not live, not found): no. A connection refused
        or dropped, once the endpoint has answered: None (a stopping tritonserver 2.51 closes its HTTP service at
        once, or, while HTTP connections are still open, drops each new one, before it says anything of its
        readiness)."""
        try:
            with self._opener.open(self.base_url + path, timeout=self.timeout_s) as answer:
                status = answer.status
        except urllib.error.HTTPError as exc:
            status = exc.code
        except Exception as exc:  # (refused, dropped, timed out, a malformed address)
            lost = isinstance(getattr(exc, "reason", exc), (ConnectionRefusedError, ConnectionResetError))
            if lost and self.answered:
                return None
            raise HealthUnknown(f"GET {path}: {exc!r}") from exc
        self.answered = True
        if status not in (200, 400, 503):
            raise HealthUnknown(f"GET {path}: HTTP {status}")
        return status == 200


class GrpcHealth(_Health):
    """tritonserver's own gRPC health RPCs (ServerLive, ModelReady), asked over the address it serves them on: for a
    tritonserver that serves gRPC but no HTTP of its own. Its client (tritonclient's, never through a proxy) is made
    at the first ask."""

    name = "gRPC"
    STOPPING = ("Server exiting", "Server not ready")  # (ServerLive's and ModelReady's answers from the stop on)

    def __init__(self, url: str, timeout_s: float = 0.25):
        self.url, self.timeout_s = url, timeout_s
        self.answered = False  # (as HttpHealth's: until it has answered, a lost connection tells nothing)
        self._client = None
        self._closed = False

    @classmethod
    def of_server(cls, server_pid: int) -> "GrpcHealth | None":
        """Where process `server_pid` serves gRPC, from its command line: None unless it is a tritonserver serving gRPC
        on an address of its own."""
        address = _own_endpoint(server_pid, "grpc", "8001")
        return None if address is None else cls(address)

    @property
    def where(self) -> str:
        return f"gRPC at {self.url}"

    def _model_ready(self, model_name: str, model_version: str) -> bool | None:
        return self._ask("is_model_ready", model_name, model_version)

    def _live(self) -> bool | None:
        return self._ask("is_server_live")

    def _ask(self, rpc: str, *args) -> bool | None:
        """The RPC's answer; no for tritonserver's own "stopping" errors; None for a connection lost once it had
        answered (UNAVAILABLE: nothing listens there any more)."""
        try:
            from tritonclient.utils import InferenceServerException

            answer = getattr(self._client_made(), rpc)(*args, client_timeout=self.timeout_s)
        except InferenceServerException as exc:
            if any(words in str(exc) for words in self.STOPPING):
                self.answered = True
                return False
            if exc.status() == "StatusCode.UNAVAILABLE" and self.answered:
                return None
            raise HealthUnknown(f"{rpc}: {exc}") from exc
        except Exception as exc:  # (a malformed address, a client closed at shutdown)
            raise HealthUnknown(f"{rpc}: {exc!r}") from exc
        self.answered = True
        return bool(answer)

    def _client_made(self):
        if self._closed:
            raise RuntimeError("closed")
        if self._client is None:
            import tritonclient.grpc

            # (as HttpHealth's opener, never through a proxy: gRPC follows http_proxy even to 127.0.0.1)
            self._client = tritonclient.grpc.InferenceServerClient(self.url,
                                                                   channel_args=[("grpc.enable_http_proxy", 0)])
        return self._client

    def close(self) -> None:
        self._closed = True
        if self._client is not None:
            self._client.close()
            self._client = None


# tritonserver 2.51's options the watch reads, each with its shortest unambiguous prefix (getopt_long takes any)
_ENDPOINT_OPTIONS = {
    "http": {"allow": "--allow-h", "reuse": "--reuse-h", "address": "--http-a", "port": "--http-p"},
    "grpc": {"allow": "--allow-gr", "reuse": "--reuse-g", "address": "--grpc-a", "port": "--grpc-p"},
}


def _own_endpoint(server_pid: int, protocol: str, default_port: str) -> str | None:
    """"host:port" to ask for the `protocol` ("http" or "grpc") that process `server_pid` serves, from its command
    line: None unless it is a tritonserver serving it on an address of its own (not disabled, not a port shared with
    other servers, which could answer for this one, not a unix socket, not gRPC over TLS, which an insecure channel
    cannot ask)."""
    argv = server_argv(server_pid)
    if not argv or Path(argv[0]).name != "tritonserver":
        return None
    prefix = _ENDPOINT_OPTIONS[protocol]
    if not _true(option_value(argv, f"--allow-{protocol}", prefix["allow"]), default=True):
        return None
    if _true(option_value(argv, f"--reuse-{protocol}-port", prefix["reuse"]), default=False):
        return None
    if protocol == "grpc" and any(_true(option_value(argv, name, name), default=False)
                                  for name in ("--grpc-use-ssl", "--grpc-use-ssl-mutual")):
        return None
    host = _loopback_host(option_value(argv, f"--{protocol}-address", prefix["address"]) or "0.0.0.0")
    port = option_value(argv, f"--{protocol}-port", prefix["port"]) or default_port
    return None if host is None else f"{host}:{port}"


def _true(value: str | None, default: bool) -> bool:
    """A tritonserver boolean option's value (true/on/1, false/off/0)."""
    return default if value is None else value.lower() not in ("false", "off", "0")


def _loopback_host(address: str) -> str | None:
    """The host to ask for the service tritonserver binds to `address` (its --http-address or --grpc-address: an IPv4
    or IPv6 address, `ipv4:`/`ipv6:` prefixed as libevhtp takes them, or a host name); None for a unix socket."""
    kind, colon, rest = address.partition(":")
    if colon and kind == "unix":
        return None
    if colon and kind in ("ipv4", "ipv6"):
        address = rest
    address = address.strip("[]")
    if address in ("", "0.0.0.0"):
        return "127.0.0.1"
    if address == "::":
        return "[::1]"
    return f"[{address}]" if ":" in address else address


class ServerStopWatch:
    """Asks whether this model still serves; says when the requests running must end, and why."""

    def __init__(self, pb_utils, model_name: str, model_version: str = "", *, grace_s: float, check_s: float = 0.5,
                 health: HttpHealth | GrpcHealth | None = None):
        self.pb, self.model_name, self.model_version = pb_utils, model_name, model_version
        self.grace_s, self.check_s = grace_s, check_s
        self.health = health  # (None: asked through the Python backend's is_model_ready only)
        self.next_check = 0.0
        self.reason: str | None = None  # why the model no longer serves (None: it does, as far as seen)
        self.since: float | None = None  # when that was seen (time.monotonic())
        self.failures = 0  # asks in a row that failed saying nothing of a stop
        self.last_failure = ""
        self.fallback = self.last_fallback = ""  # why the last ask went through is_model_ready though `health` is known
        # (a Python backend without is_model_ready and no endpoint to ask: never asked)
        self.enabled = health is not None or hasattr(pb_utils, "is_model_ready")

    @classmethod
    def endpoint_of(cls, server_pid: int) -> HttpHealth | GrpcHealth | None:
        """What to ask of tritonserver (process `server_pid`): its HTTP endpoint, else its gRPC one, else nothing."""
        return HttpHealth.of_server(server_pid) or GrpcHealth.of_server(server_pid)

    def check(self, now: float) -> str | None:
        """Ask for the model's readiness, if due (a stop seen: whether it stands, `_recheck`). A failure that says
        nothing of a stop is asked again later, backing off (each ask could be one made during a stop), and returned
        when it differs from the last one, for the caller to log; so is an endpoint's ask that told nothing, once, and
        its answering again."""
        if not self.enabled or now < self.next_check:
            return None
        if self.since is not None:
            return self._recheck(now)
        self.next_check = now + self.check_s
        try:
            reason = self._ask()
        except Exception as exc:
            return self._failed(now, f"cannot tell whether the model still serves: {exc}")
        self.failures = 0
        if reason is not None:
            self.reason, self.since = reason, now
        if self.fallback == self.last_fallback:
            return None
        self.last_fallback = self.fallback  # (an ask that told nothing, or one that works again: logged once)
        return f"asked is_model_ready: {self.fallback}" if self.fallback else f"tritonserver's {self.health.name} " \
                                                                              "answers again"

    def _recheck(self, now: float) -> str | None:
        """A stop seen over an endpoint is asked about again there, so that one reading that was none (both asks'
        connections dropped while tritonserver serves) does not refuse every later request: the model reading ready
        again clears it (returned, for the caller to log). Never through is_model_ready, which a stopping server may
        crash in: a stop seen that way stands."""
        if self.health is None or self.fallback:
            return None
        self.next_check = now + self.check_s
        try:
            if self.health.stop_reason(self.model_name, self.model_version) is not None:
                return None
        except Exception:  # (an ask that says nothing: the stop stands)
            return None
        seen, self.reason, self.since = self.reason, None, None
        return f"tritonserver's {self.health.name} endpoint says the model serves: {seen!r} was a reading, not a stop"

    def _ask(self) -> str | None:
        """Why the model no longer serves, or None: over HTTP or gRPC where that answers, else through the Python
        backend."""
        self.fallback = ""
        if self.health is not None:
            try:
                return self.health.stop_reason(self.model_name, self.model_version)
            except HealthUnknown as exc:
                if not hasattr(self.pb, "is_model_ready"):
                    raise
                self.fallback = f"{self.health.name} told nothing ({exc})"
        try:
            ready = self.pb.is_model_ready(self.model_name, self.model_version)
        except Exception as exc:
            reason = stop_reason(str(exc))
            if reason is None:
                raise
            return reason
        return None if ready else "the model is being unloaded"

    @property
    def seen_over(self) -> str:
        """How the last ask was answered."""
        return f"over {self.health.name}" if self.health is not None and not self.fallback else "through is_model_ready"

    def _failed(self, now: float, failure: str) -> str | None:
        self.failures += 1
        self.next_check = now + min(self.check_s * 2 ** min(self.failures, 16), max(self.check_s, MAX_CHECK_INTERVAL_S))
        if failure == self.last_failure:
            return None
        self.last_failure = failure
        return failure

    def must_end(self, now: float) -> bool:
        """Whether the requests still running must end now: the stop has lasted its grace."""
        return self.since is not None and now - self.since >= self.grace_s

    def message(self) -> str:
        return f"{self.reason}: the request was ended unfinished {self.grace_s:g} s after that (stop_grace_s)"


def stop_reason(error: str) -> str | None:
    """What an is_model_ready failure says of a stop: tritonserver's ModelIsReady answers "Server not ready" once it
    stops; its GetModel, "... is not at ready state" / "is not found" / "has no available versions" once the model
    unloads. None for anything else (a failure to ask)."""
    if "Server not ready" in error:
        return "tritonserver is stopping"
    if any(words in error for words in ("not at ready state", "is not found", "has no available versions")):
        return "the model is being unloaded"
    return None
