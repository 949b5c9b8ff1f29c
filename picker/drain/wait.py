"""drain-wait: a preStop hook that returns once the vLLM engine beside it has nothing left to do.

Kubernetes runs preStop before it sends SIGTERM. vLLM keeps /health at 200 while it drains and answers
new completions with HTTP 500, so the longer the engine keeps serving normally after its endpoint was
removed, the fewer requests fail. This hook waits, within one deadline, in two phases:

1. propagation: until no new request has reached the engine for two consecutive quiet intervals (the
   endpoint removal has reached every router), or until the propagation allowance ends;
2. drain: until vllm:num_requests_running + vllm:num_requests_waiting (summed over every engine and
   label) is 0, or until the deadline.

Then it exits 0, always (a failing hook gains nothing), after logging one JSON line saying what it saw.

How an arrival is seen (vLLM's own counters, read from /metrics):
- vllm:prompt_tokens_total and vllm:time_to_first_token_seconds_count move when the engine starts a
  request (every request has at least one prompt token and observes one TTFT). They are counters, so a
  request that arrives and finishes between two polls still moves them; the gauges alone would miss it.
- (running + waiting) rising, plus vllm:request_success_total rising, is a lower bound of the requests
  that arrived between two polls (each finish leaves the gauges and enters the counter). It catches a
  request still queued, before its prefill. It can undercount: vLLM does not count client aborts.
- request_success_total alone counts endings, not arrivals, and generation tokens keep moving while
  old streams run: neither is used as an arrival signal.
A queued request being promoted to running also moves the first two counters; that only extends the
wait while the engine has work, which phase 2 would wait for anyway. A counter going down means the
engine restarted: it counts as activity.

Standard library only, no import from `picker`: the file runs alone inside a model-server image
(`python3 wait.py --metrics-url ...`; Python 3.9+). The decision logic is `DrainWait`, a pure state
machine fed (time, sample); `run()` is the thin loop that feeds it from a clock and /metrics.

Longer than 400 lines on purpose: standard library only and one file, so it can be copied into a
model-server image alone (picker/drain/README.md).
"""

from __future__ import annotations

import argparse
import enum
import json
import math
import signal
import socket
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any, Union

DEFAULT_METRICS_URL = "http://127.0.0.1:8000/metrics"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
FINISHED = "vllm:request_success_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
FIRST_TOKENS = "vllm:time_to_first_token_seconds_count"
_WANTED = frozenset((RUNNING, WAITING, FINISHED, PROMPT_TOKENS, FIRST_TOKENS))
# A vLLM /metrics page is tens of KB per engine; a page beyond this is not one we can trust.
MAX_METRICS_BYTES = 4 * 1024 * 1024


class UsageError(ValueError):
    """Bad command-line arguments, worded for the operator."""


class Interrupted(Exception):
    """The hook itself got SIGTERM (the kubelet gave up on it): log what was seen and exit."""


@dataclass(frozen=True)
class Sample:
    """What one good /metrics page says, summed over engines and labels."""

    running: float
    waiting: float
    finished: float | None = None  # vllm:request_success_total, every finished_reason
    admitted: float | None = None  # prompt tokens + first tokens: moves when a request starts
    # a prefill replica (--pulls-url): prompts it computed whose KV a decode replica has still to
    # pull, as the picker counts them; vLLM shows these nowhere, yet stopping the engine loses them
    pulls: float = 0.0

    @property
    def in_engine(self) -> float:
        return self.running + self.waiting + self.pulls


@dataclass(frozen=True)
class SampleError:
    """A poll that taught nothing: kind is refused, timeout, http-status, malformed, too-large or error."""

    kind: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.detail}"


Result = Union[Sample, SampleError]  # noqa: UP007 (a runtime alias: Python 3.9 has no `|` here)


class Phase(enum.Enum):
    PROPAGATION = "propagation"
    DRAIN = "drain"
    DONE = "done"


@dataclass(frozen=True)
class Settings:
    metrics_url: str = DEFAULT_METRICS_URL
    quiet_interval_s: float = 2.0
    propagation_allowance_s: float = 20.0
    deadline_s: float = 60.0
    poll_interval_s: float = 0.5
    request_timeout_s: float = 1.0
    log_file: str | None = None
    # picker proxy with streams.resume: this replica's drain URL on the picker's admin port with
    # ?move_streams=true, POSTed once at the start: its streams continue on other replicas at once
    move_streams_url: str | None = None
    admin_token_file: str | None = None
    # a prefill replica of a prefill / decode pool: its entry on the picker's admin API
    # (GET /admin/endpoints/<address>), whose kv_pulls_pending the drain waits for too
    pulls_url: str | None = None


def arrived(previous: Sample, current: Sample) -> bool:
    """True when the counters prove that a request reached the engine between the two samples."""
    if previous.admitted is not None and current.admitted is not None:
        if current.admitted != previous.admitted:  # up: a request started; down: the engine restarted
            return True
    finished_delta = 0.0
    if previous.finished is not None and current.finished is not None:
        if current.finished < previous.finished:
            return True
        finished_delta = current.finished - previous.finished
    return (current.in_engine - previous.in_engine) + finished_delta > 0


class DrainWait:
    """The whole decision, as a state machine of (time, poll result); no clock, no I/O.

    Times are seconds on any monotonic clock; `start` is when the hook began.
    """

    def __init__(self, settings: Settings, start: float) -> None:
        self.settings = settings
        self.start = start
        self.phase = Phase.PROPAGATION
        self.propagation_ended_by: str | None = None
        self.propagation_end: float | None = None
        self.outcome: str | None = None
        self.end: float | None = None
        self.last: Sample | None = None
        self.quiet_since: float | None = None
        self.failing_since: float | None = None
        self.samples = 0
        self.arrivals = 0
        self.errors: dict[str, int] = {}
        self.last_error: SampleError | None = None

    @property
    def deadline_at(self) -> float:
        return self.start + self.settings.deadline_s

    @property
    def allowance_at(self) -> float:
        return self.start + self.settings.propagation_allowance_s

    @property
    def quiet_needed_s(self) -> float:
        return 2 * self.settings.quiet_interval_s

    def advance(self, now: float) -> Phase:
        """Apply what the passage of time alone decides (the deadline, the allowance)."""
        if self.phase is not Phase.DONE and now >= self.deadline_at:
            self._finish(now, "deadline")
        elif self.phase is Phase.PROPAGATION and now >= self.allowance_at:
            self._end_propagation(now, "allowance")
        return self.phase

    def observe(self, now: float, result: Result) -> Phase:
        """Feed one poll result, taken at `now`."""
        if self.phase is Phase.DONE:
            return self.phase
        if self.phase is Phase.PROPAGATION and self.allowance_at <= now < self.deadline_at:
            self._end_propagation(now, "allowance")
        if isinstance(result, SampleError):
            self._on_error(now, result)
        else:
            self._on_sample(now, result)
        if self.phase is not Phase.DONE and now >= self.deadline_at:
            self._finish(now, "deadline")
        return self.phase

    def interrupt(self, now: float) -> None:
        if self.phase is not Phase.DONE:
            self._finish(now, "interrupted")

    def fetch_budget(self, now: float) -> float:
        """How long the next poll may take: never past the deadline."""
        return max(0.0, min(self.settings.request_timeout_s, self.deadline_at - now))

    def pause(self, now: float) -> float:
        """How long to sleep before the next poll."""
        return max(0.0, min(self.settings.poll_interval_s, self.deadline_at - now))

    def _on_sample(self, now: float, sample: Sample) -> None:
        self.samples += 1
        self.failing_since = None
        previous, self.last = self.last, sample
        if self.phase is Phase.PROPAGATION:
            if previous is None:
                self.quiet_since = now  # arrivals before the first sample cannot be seen
            elif arrived(previous, sample):
                self.arrivals += 1
                self.quiet_since = now
            if self.quiet_since is not None and now - self.quiet_since >= self.quiet_needed_s:
                self._end_propagation(now, "quiet")
        if self.phase is Phase.DRAIN and sample.in_engine <= 0:
            self._finish(now, "idle")

    def _on_error(self, now: float, error: SampleError) -> None:
        self.errors[error.kind] = self.errors.get(error.kind, 0) + 1
        self.last_error = error
        if error.kind == "timeout":
            # An engine too busy to answer /metrics in time is an engine with work: keep waiting.
            self.failing_since = None
            return
        if self.failing_since is None:
            self.failing_since = now
        # Nothing readable there for a while: nothing we can wait for. The propagation phase still
        # runs its whole allowance (a blind sleep, the classic preStop), in case the URL is wrong.
        if self.phase is Phase.DRAIN and now - self.failing_since >= self.quiet_needed_s:
            self._finish(now, "unobservable")

    def _end_propagation(self, now: float, reason: str) -> None:
        self.propagation_ended_by = reason
        self.propagation_end = now
        self.phase = Phase.DRAIN

    def _finish(self, now: float, reason: str) -> None:
        if self.phase is Phase.PROPAGATION:
            self.propagation_ended_by = reason
            self.propagation_end = now
        self.outcome = reason
        self.end = now
        self.phase = Phase.DONE

    def _last(self) -> dict[str, float]:
        assert self.last is not None
        last = {"running": self.last.running, "waiting": self.last.waiting}
        if self.settings.pulls_url:
            last["pulls"] = self.last.pulls
        return last

    def summary(self, now: float) -> dict[str, Any]:
        """The one log line: phases, durations, last counts, errors."""
        end = self.end if self.end is not None else now
        propagation_end = self.propagation_end if self.propagation_end is not None else end
        drained = self.propagation_end is not None and self.propagation_ended_by in ("quiet", "allowance")
        return {
            "event": "drain-wait",
            "outcome": self.outcome or "running",
            "total_s": round(end - self.start, 3),
            "propagation": {
                "ended_by": self.propagation_ended_by,
                "seconds": round(propagation_end - self.start, 3),
            },
            "drain": (
                {"ended_by": self.outcome, "seconds": round(end - propagation_end, 3)} if drained else None
            ),
            "samples": self.samples,
            "arrivals_seen": self.arrivals,
            "last": None if self.last is None else self._last(),
            "errors": dict(self.errors),
            "last_error": None if self.last_error is None else str(self.last_error),
            "settings": asdict(self.settings),
        }


# --- reading /metrics ---------------------------------------------------------------------------


def _metric_line(line: str) -> tuple[str, str] | None:
    """(name, value text) of one exposition line, or None; label values may hold '}', ' ' or '\\"'."""
    end = len(line)
    for index, char in enumerate(line):
        if char in "{ \t":
            end = index
            break
    name, rest = line[:end], line[end:]
    if rest.startswith("{"):
        in_quotes = escaped = False
        for index, char in enumerate(rest):
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_quotes = not in_quotes
            elif char == "}" and not in_quotes:
                rest = rest[index + 1 :]
                break
        else:
            return None
    fields = rest.split()
    if not name or not fields:
        return None
    return name, fields[0]


def parse_sample(text: str) -> Result:
    """The few series drain-wait needs, summed; anything unusable is a SampleError, never an exception."""
    sums: dict[str, float] = {}
    for raw in text.split("\n"):
        line = raw.strip()
        if not line.startswith("vllm:"):
            continue
        parsed = _metric_line(line)
        if parsed is None or parsed[0] not in _WANTED:
            continue
        name, value_text = parsed
        try:
            value = float(value_text)
        except ValueError:
            return SampleError("malformed", f"{name} has value {value_text[:40]!r}")
        if not math.isfinite(value) or value < 0:
            return SampleError("malformed", f"{name} has value {value_text[:40]!r}")
        sums[name] = sums.get(name, 0.0) + value
    if RUNNING not in sums or WAITING not in sums:
        return SampleError("malformed", f"no {RUNNING} / {WAITING} series")
    admitted = None
    if PROMPT_TOKENS in sums or FIRST_TOKENS in sums:
        admitted = sums.get(PROMPT_TOKENS, 0.0) + sums.get(FIRST_TOKENS, 0.0)
    return Sample(sums[RUNNING], sums[WAITING], sums.get(FINISHED), admitted)


def _unchunk(body: bytes) -> bytes | None:
    """A chunked transfer-encoded body, decoded; None when malformed or cut short."""
    out = bytearray()
    while True:
        size_line, sep, rest = body.partition(b"\r\n")
        if not sep:
            return None
        try:
            size = int(size_line.split(b";", 1)[0].strip(), 16)
        except ValueError:
            return None
        if size == 0:
            return bytes(out)
        if len(rest) < size + 2 or rest[size : size + 2] != b"\r\n":
            return None
        out += rest[:size]
        body = rest[size + 2 :]


def parse_response(raw: bytes, max_bytes: int = MAX_METRICS_BYTES) -> Result:
    """A whole HTTP response (read to EOF) as a Sample, or why not."""
    head, sep, body = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = head.split(b"\r\n")
    fields = status_line.split(None, 2)
    if not sep or len(fields) < 2 or not fields[0].startswith(b"HTTP/") or not fields[1].isdigit():
        return SampleError("malformed", "not an HTTP response")
    if int(fields[1]) != 200:
        return SampleError("http-status", f"HTTP {int(fields[1])}")
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip().lower()
    if headers.get(b"transfer-encoding") == b"chunked":
        decoded = _unchunk(body)
        if decoded is None:
            return SampleError("malformed", "bad or truncated chunked body")
        body = decoded
    elif headers.get(b"content-length", b"").isdigit():
        length = int(headers[b"content-length"])
        if len(body) < length:
            return SampleError("malformed", f"body cut at {len(body)} of {length} bytes")
        body = body[:length]
    if len(body) > max_bytes:
        return SampleError("too-large", f"page over {max_bytes} bytes")
    return parse_sample(body.decode("utf-8", errors="replace"))


def fetch_metrics(
    url: str, budget_s: float, max_bytes: int = MAX_METRICS_BYTES, clock: Callable[[], float] = time.monotonic
) -> Result:
    """GET the metrics page within `budget_s` in total: every socket wait gets only the time left.

    A raw HTTP/1.0 exchange on one socket, no helper thread: nothing can block past the budget
    (a server that trickles bytes, a page that never ends), and nothing truncated is parsed.
    """
    parts = urllib.parse.urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    request = (
        f"GET {path} HTTP/1.0\r\nHost: {parts.netloc}\r\nAccept: text/plain\r\n"
        "Accept-Encoding: identity\r\nUser-Agent: drain-wait\r\nConnection: close\r\n\r\n"
    ).encode("latin-1")
    deadline = clock() + max(budget_s, 0.001)
    limit = max_bytes + 64 * 1024  # the page plus its headers
    received = bytearray()
    try:
        with socket.create_connection((host, port), timeout=max(deadline - clock(), 0.001)) as sock:
            sock.sendall(request)
            while True:
                left = deadline - clock()
                if left <= 0:
                    return SampleError("timeout", f"no complete page within {budget_s:.2f}s")
                sock.settimeout(left)
                chunk = sock.recv(65536)
                if not chunk:
                    break
                received += chunk
                if len(received) > limit:
                    return SampleError("too-large", f"page over {max_bytes} bytes")
    except ConnectionRefusedError as exc:
        return SampleError("refused", str(exc))
    except (socket.timeout, TimeoutError):  # noqa: UP041 (distinct classes before Python 3.10)
        return SampleError("timeout", f"no complete page within {budget_s:.2f}s")
    except (OSError, UnicodeError) as exc:
        return SampleError("error", f"{type(exc).__name__}: {str(exc)[:200]}")
    return parse_response(bytes(received), max_bytes)


# --- the loop -----------------------------------------------------------------------------------


def run(
    settings: Settings,
    fetch: Callable[[float], Result] | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    started: float | None = None,
) -> dict[str, Any]:
    """Poll until the state machine says done; returns the summary. `fetch(budget_s)` polls once.

    `started` (a `clock()` reading) is when the hook began, if before now: the deadline counts from it.
    """
    if fetch is None:

        def fetch(budget_s: float) -> Result:
            result = fetch_metrics(settings.metrics_url, budget_s)
            if settings.pulls_url and isinstance(result, Sample):
                pulls = fetch_pulls(settings, budget_s)
                if pulls is not None:
                    result = replace(result, pulls=pulls)
            return result

    machine = DrainWait(settings, clock() if started is None else min(started, clock()))
    moved = ask_move(settings) if settings.move_streams_url else None
    try:
        while machine.advance(clock()) is not Phase.DONE:
            result = fetch(machine.fetch_budget(clock()))
            if machine.observe(clock(), result) is Phase.DONE:
                break
            sleep(machine.pause(clock()))
    except (Interrupted, KeyboardInterrupt):
        machine.interrupt(clock())
    summary = machine.summary(clock())
    if moved is not None:
        summary["move_streams"] = moved
    return summary


def ask_move(settings: Settings) -> dict[str, Any]:
    """POST --move-streams-url once (the picker moves this replica's streams elsewhere); what it
    answered, or why it could not be asked. Never raises: the hook waits for idle either way. The
    drain it makes is the preStop hook's (`cause=prestop`, unless the URL names one): a rollout's
    `resume` never lifts it."""
    import urllib.request

    headers = {"User-Agent": "drain-wait"}
    try:
        if settings.admin_token_file:
            with open(settings.admin_token_file, encoding="utf-8") as handle:
                headers["Authorization"] = "Bearer " + handle.read().strip()
        url = prestop_url(settings.move_streams_url or "")
        request = urllib.request.Request(url, method="POST", headers=headers)
        with urllib.request.urlopen(request, timeout=max(settings.request_timeout_s, 0.1)) as response:
            answer = json.loads(response.read(64 * 1024) or b"{}")
            return {"status": response.status, "moved": answer.get("moved_streams")}
    except Exception as exc:  # a refusal (HTTPError), no picker, a bad token file: said, not raised
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}


def fetch_pulls(settings: Settings, budget_s: float) -> float | None:
    """kv_pulls_pending of this replica's entry on the picker's admin API (--pulls-url), or None when
    it cannot be read: then the engine's own figures decide, as without the flag. Never raises."""
    import urllib.request

    headers = {"User-Agent": "drain-wait", "Accept": "application/json"}
    try:
        if settings.admin_token_file:
            with open(settings.admin_token_file, encoding="utf-8") as handle:
                headers["Authorization"] = "Bearer " + handle.read().strip()
        request = urllib.request.Request(settings.pulls_url or "", headers=headers)
        with urllib.request.urlopen(request, timeout=max(budget_s, 0.05)) as response:
            pending = json.loads(response.read(64 * 1024)).get("kv_pulls_pending")
    except Exception:  # no picker, a refusal, a bad answer: the engine's figures decide
        return None
    if isinstance(pending, bool) or not isinstance(pending, int) or pending < 0:
        return None
    return float(pending)


def prestop_url(url: str) -> str:
    """The drain URL with `cause=prestop` added to its query, unless it names a cause already."""
    parts = urllib.parse.urlsplit(url)
    query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    if any(name == "cause" for name, _ in query):
        return url
    return urllib.parse.urlunsplit(
        parts._replace(query=urllib.parse.urlencode([*query, ("cause", "prestop")]))
    )


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting: a hook exits 0 even on bad flags (and logs why)."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        raise UsageError(message)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds >= 0")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--metrics-url",
        "--url",
        default=DEFAULT_METRICS_URL,
        help="the engine's Prometheus page (default %(default)s)",
    )
    parser.add_argument(
        "--quiet-interval",
        type=_seconds,
        default=2.0,
        help="proceed once no request arrived for two of these (default %(default)s)",
    )
    parser.add_argument(
        "--propagation-allowance",
        type=_seconds,
        default=20.0,
        help="longest wait for that quiet, then start waiting for idle anyway (default %(default)s)",
    )
    parser.add_argument(
        "--deadline",
        type=_seconds,
        default=60.0,
        help="the whole hook never runs longer (default %(default)s)",
    )
    parser.add_argument(
        "--poll-interval", type=_seconds, default=0.5, help="seconds between polls (default %(default)s)"
    )
    parser.add_argument(
        "--request-timeout",
        type=_seconds,
        default=1.0,
        help="budget of one /metrics request (default %(default)s)",
    )
    parser.add_argument(
        "--log-file",
        help="append the summary line here instead of stderr (e.g. /proc/1/fd/1 for kubectl logs)",
    )
    parser.add_argument(
        "--move-streams-url",
        help="picker proxy (streams.resume): POST this replica's drain URL with ?move_streams=true once "
        "at the start, so its streams continue on other replicas instead of holding the drain",
    )
    parser.add_argument(
        "--pulls-url",
        help="a prefill replica of a prefill / decode pool: its entry on the picker's admin API "
        "(http://<picker>:9090/admin/endpoints/<ip:port>); the drain also waits until no decode replica "
        "has KV left to pull from it (the picker bounds that wait: drain.kv_pull_timeout_s)",
    )
    parser.add_argument(
        "--admin-token-file", help="the picker's admin token, for --move-streams-url and --pulls-url"
    )


def build_parser(prog: str = "drain-wait") -> argparse.ArgumentParser:
    parser = _Parser(
        prog=prog,
        description="preStop hook: wait until the local vLLM engine is idle, then exit 0",
        allow_abbrev=False,  # a misspelt flag is an error, not silently another flag
    )
    add_arguments(parser)
    return parser


def parse_settings(argv: list[str] | None = None, prog: str = "drain-wait") -> Settings:
    """Settings from command-line arguments; UsageError names the problem."""
    args = build_parser(prog).parse_args(argv)
    parts = urllib.parse.urlsplit(args.metrics_url)
    try:
        parts.port  # noqa: B018 (raises on a port that is not one)
    except ValueError as exc:
        raise UsageError(f"--metrics-url {args.metrics_url!r}: {exc}") from exc
    if parts.scheme != "http" or not parts.hostname:
        raise UsageError(f"--metrics-url {args.metrics_url!r} is not an http:// URL with a host")
    if args.move_streams_url is not None:
        move = urllib.parse.urlsplit(args.move_streams_url)
        if move.scheme != "http" or not move.hostname or "move_streams=true" not in move.query:
            raise UsageError(
                f"--move-streams-url {args.move_streams_url!r}: "
                "not an http:// drain URL with ?move_streams=true"
            )
    if args.pulls_url is not None:
        pulls = urllib.parse.urlsplit(args.pulls_url)
        if (
            pulls.scheme not in ("http", "https")
            or not pulls.hostname
            or "/admin/endpoints/" not in pulls.path
        ):
            raise UsageError(
                f"--pulls-url {args.pulls_url!r}: not an http(s):// URL of /admin/endpoints/<address>"
            )
    if args.quiet_interval <= 0 or args.poll_interval <= 0 or args.request_timeout <= 0:
        raise UsageError("--quiet-interval, --poll-interval and --request-timeout must be > 0")
    return Settings(
        metrics_url=args.metrics_url,
        quiet_interval_s=args.quiet_interval,
        propagation_allowance_s=args.propagation_allowance,
        deadline_s=args.deadline,
        poll_interval_s=args.poll_interval,
        request_timeout_s=args.request_timeout,
        log_file=args.log_file,
        move_streams_url=args.move_streams_url,
        admin_token_file=args.admin_token_file,
        pulls_url=args.pulls_url,
    )


def _emit(record: dict[str, Any], log_file: str | None) -> None:
    line = json.dumps(record, sort_keys=False)
    if log_file:
        try:
            with open(log_file, "a", encoding="utf-8") as handle:
                handle.write(line + "\n")
            return
        except OSError as exc:
            record = {**record, "log_file_error": str(exc)}
            line = json.dumps(record)
    print(line, file=sys.stderr, flush=True)


def _on_sigterm(signum: int, frame: Any) -> None:
    raise Interrupted()


def main(argv: list[str] | None = None, prog: str = "drain-wait", started: float | None = None) -> int:
    """Run the hook; returns 0 in every case. `started`: the time.monotonic() the process began at."""
    try:
        settings = parse_settings(argv, prog)
    except UsageError as exc:
        _emit({"event": "drain-wait", "outcome": "bad-arguments", "error": str(exc)}, None)
        return 0
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        summary = run(settings, started=started)
    except Exception as exc:  # a bug here must not fail the hook: say so and let the pod stop
        summary = {
            "event": "drain-wait",
            "outcome": "internal-error",
            "error": f"{type(exc).__name__}: {exc}",
        }
    _emit(summary, settings.log_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
