"""Prometheus metrics and the health endpoints: ``/metrics``, ``/healthz``, ``/readyz``.

The exporter only reads what each pass produced (``PassResult``) and never
decides. Guard series come from the guards themselves (``core/telemetry``):
every guard's verdict words become ``nodeagent_guard_state`` states, and the
families a guard declares are registered here at start, so a new guard's
metrics arrive with the guard.

Liveness (``/healthz``) says only that the loop reconciles: a pass completed
within ``liveness_seconds`` (counted from start until the first pass).
Readiness (``/readyz``) says a pass has completed since start and no gate file
is stuck (one the agent cannot withdraw; its lease ends it anyway). Neither does
anything: a probe is never the way to reload or act.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import psutil
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from nodeagent import __version__
from nodeagent.config import parse_address
from nodeagent.core.actions import (
    Action,
    ActionOutcome,
    LoadModule,
    LoadModuleFile,
    RemoveFile,
    UnloadModule,
    WriteFile,
)
from nodeagent.core.telemetry import (
    LATENCY_BUCKETS,
    MetricFamily,
    guard_families,
    guard_samples,
    verdict_ok,
    verdict_words,
)
from nodeagent.errors import NodeagentError

log = logging.getLogger("nodeagent.metrics")

# What woke a pass, by the first word of each wake-up (events.py, agent.py).
WAKE_SOURCES = frozenset({"start", "once", "resync", "inotify", "uevent", "stop"})
ACTION_KINDS: dict[type, str] = {
    LoadModuleFile: "load",
    LoadModule: "load",
    UnloadModule: "unload",
    WriteFile: "write_file",
    RemoveFile: "remove_file",
}
# How a guard's declared family is made (prometheus-client adds a counter's _total).
FAMILY_MAKERS: dict[str, Callable[[MetricFamily, CollectorRegistry], Any]] = {
    "gauge": lambda f, r: Gauge(f.name, f.help, list(f.labels), registry=r),
    "counter": lambda f, r: Counter(
        f.name.removesuffix("_total"), f.help, list(f.labels), registry=r
    ),
    "histogram": lambda f, r: Histogram(
        f.name, f.help, list(f.labels), buckets=f.buckets, registry=r
    ),
}
# How a guard's sample updates its family: gauges are set, counters add, histograms observe.
UPDATE: dict[str, Callable[[Any, float], None]] = {
    "gauge": lambda m, v: m.set(v),
    "counter": lambda m, v: m.inc(v),
    "histogram": lambda m, v: m.observe(v),
}


HOLD_ENDINGS = frozenset({"gate_opened", "budget_expired", "responder_stopped", "opener_gone"})


def action_kind(action: Action) -> str:
    return ACTION_KINDS.get(type(action)) or str(getattr(action, "kind", type(action).__name__))


def wake_source(reason: str) -> str:
    word = reason.split(" ", 1)[0]
    return word if word in WAKE_SOURCES else "other"


class ProcessCollector:
    """The agent's own RSS, CPU and descriptors (psutil), ``nodeagent_process_*``."""

    def __init__(self) -> None:
        self._proc = psutil.Process()

    def collect(self) -> Iterable[Metric]:
        with self._proc.oneshot():
            rss = self._proc.memory_info().rss
            cpu = self._proc.cpu_times()
            fds = self._proc.num_fds()
            threads = self._proc.num_threads()
        yield GaugeMetricFamily(
            "nodeagent_process_resident_memory_bytes", "Resident set size of the agent", rss
        )
        yield CounterMetricFamily(
            "nodeagent_process_cpu_seconds",
            "CPU time the agent has used (user + system)",
            cpu.user + cpu.system,
        )
        yield GaugeMetricFamily("nodeagent_process_open_fds", "Open file descriptors", fds)
        yield GaugeMetricFamily("nodeagent_process_threads", "Threads of the agent", threads)


class MetricsExporter:
    name = "metrics"

    def __init__(
        self,
        guards: Mapping[str, Any],
        *,
        mode: str,
        liveness_seconds: float,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        disable_created_metrics()
        self.guards = dict(guards)
        self.clock = clock
        self.monotonic = monotonic
        self.liveness_seconds = liveness_seconds
        self.lock = threading.Lock()  # one pass's updates are seen whole by a scrape
        self.started_mono = monotonic()
        self.last_pass_mono: float | None = None
        self.passes_ok = 0
        self._undone: set[str] = set()  # actions decided, not performed, last pass
        r = self.registry = CollectorRegistry()

        info = Gauge("nodeagent_build_info", "Version and mode", ["version", "mode"], registry=r)
        info.labels(__version__, mode).set(1)
        self.guard_state = Gauge(
            "nodeagent_guard_state",
            "1 for the guard's current verdict word, 0 for its other words",
            ["guard", "state"],
            registry=r,
        )
        self.guard_ok = Gauge(
            "nodeagent_guard_ok", "1 while the guard's verdict is ok", ["guard"], registry=r
        )
        self.module_actions = Counter(
            "nodeagent_module_actions",
            "Actions decided by guards; result ok, failed or not_performed (observe mode)",
            ["guard", "module", "action", "result"],
            registry=r,
        )
        self.event_to_action = Histogram(
            "nodeagent_event_to_action_seconds",
            "From the wake-up that started a pass to the end of an action it performed",
            ["guard", "action"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.action_duration = Histogram(
            "nodeagent_action_duration_seconds",
            "How long a performed action took",
            ["guard", "action"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.passes = Counter(
            "nodeagent_passes", "Reconcile passes by result (ok, error)", ["result"], registry=r
        )
        self.pass_duration = Histogram(
            "nodeagent_pass_duration_seconds",
            "Observe + decide + act, one pass",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.wakeups = Counter(
            "nodeagent_wakeups", "Passes by what woke them", ["source"], registry=r
        )
        self.last_pass = Gauge(
            "nodeagent_last_pass_timestamp_seconds",
            "When the last pass completed (Unix time)",
            registry=r,
        )
        since = Gauge(
            "nodeagent_seconds_since_last_pass",
            "Seconds since the last completed pass (since start, before the first)",
            registry=r,
        )
        since.set_function(self.seconds_since_last_pass)
        self.records = Counter(
            "nodeagent_records", "Timeline records written, by kind", ["kind"], registry=r
        )
        self.held_opens = Counter(
            "nodeagent_peermem_held_opens",
            "Module loaders' opens of nvidia-peermem.ko held by the fanotify hold, by how "
            "the hold ended (gate_opened, budget_expired, responder_stopped, opener_gone)",
            ["ended"],
            registry=r,
        )
        self.gate_stuck = Gauge(
            "nodeagent_gate_withdrawal_failing",
            "1 while the agent cannot withdraw this gate's file (it retries every second; "
            "readers see it closed when its lease ends)",
            ["gate"],
            registry=r,
        )
        self.stuck: set[str] = set()
        self.container_roots = Gauge(
            "nodeagent_peermem_hold_container_roots",
            "Driver containers' roots marked by the fanotify hold now (found as they start)",
            registry=r,
        )
        r.register(ProcessCollector())

        # Every word a guard declares (or was seen to use): all but the current are 0.
        self.words: dict[str, list[str]] = {}
        for name, guard in self.guards.items():
            self.words[name] = list(verdict_words(guard))
            for word in self.words[name]:
                self.guard_state.labels(name, word).set(0)
            self.guard_ok.labels(name).set(0)
        self.guard_metrics: dict[str, Gauge | Counter | Histogram] = {}
        for guard in self.guards.values():
            for fam in guard_families(guard):
                self.guard_metrics[fam.name] = self._family(fam)

    def _family(self, fam: MetricFamily) -> Gauge | Counter | Histogram:
        if fam.name in self.guard_metrics or not fam.name.startswith("nodeagent_"):
            raise NodeagentError(f"metric family {fam.name}: duplicate or not nodeagent_-prefixed")
        return FAMILY_MAKERS[fam.kind](fam, self.registry)

    # -- exporter hooks -------------------------------------------------------

    def on_record(self, rec: Mapping[str, Any]) -> None:
        self.records.labels(str(rec.get("kind", "record"))).inc()
        if rec.get("kind") == "held-open":
            ended = str(rec.get("ended")).replace(" ", "_")
            self.held_opens.labels(ended if ended in HOLD_ENDINGS else "other").inc()
        elif rec.get("kind") == "gate-withdrawal":
            gate = str(rec.get("gate"))
            self.gate_stuck.labels(gate).set(0.0 if rec.get("ok") else 1.0)
            if rec.get("ok"):
                self.stuck.discard(gate)
            else:
                self.stuck.add(gate)
        elif rec.get("kind") == "hold-root-marked":
            self.container_roots.inc()
        elif rec.get("kind") == "hold-root-gone":
            self.container_roots.dec()

    def on_pass(self, result: Any, exc: Exception | None) -> None:
        if result is None:
            self.passes.labels("error").inc()
            return
        end = self.clock()
        with self.lock:
            self._pass(result, end)
            self.last_pass_mono = self.monotonic()
            self.passes_ok += 1

    def _pass(self, result: Any, end: float) -> None:
        self.passes.labels("ok").inc()
        self.pass_duration.observe(max(0.0, end - result.started))
        self.last_pass.set(end)
        for source in {wake_source(w) for w in result.woken_by}:
            self.wakeups.labels(source).inc()

        per_guard: dict[str, list[ActionOutcome]] = defaultdict(list)
        undone: set[str] = set()
        for outcome in result.outcomes:
            action = outcome.action
            kind = action_kind(action)
            module = getattr(action, "module", None)
            if outcome.performed:
                res = "ok" if outcome.ok else "failed"
                if outcome.finished_at is not None:
                    # From the pass that decided it (its worker's outcome comes a pass later).
                    began = outcome.decided_at if outcome.decided_at is not None else result.started
                    self.event_to_action.labels(action.guard, kind).observe(
                        max(0.0, outcome.finished_at - began)
                    )
                if outcome.seconds is not None:
                    self.action_duration.labels(action.guard, kind).observe(outcome.seconds)
            else:
                res = "not_performed"
                undone.add(action.describe())
                if action.describe() in self._undone:
                    module = None  # observe mode decides it every pass: count it once
            if module is not None:
                self.module_actions.labels(action.guard, module, kind, res).inc()
            per_guard[action.guard].append(outcome)
        self._undone = undone

        for name, verdict in result.verdicts.items():
            guard = self.guards.get(name)
            words = self.words.setdefault(name, [])
            if verdict.verdict not in words:
                words.append(verdict.verdict)
            for word in words:
                self.guard_state.labels(name, word).set(1 if word == verdict.verdict else 0)
            self.guard_ok.labels(name).set(1 if verdict_ok(verdict) else 0)
            if guard is not None:
                self._guard_samples(guard, verdict, per_guard.get(name, []))

    def _guard_samples(self, guard: Any, verdict: Any, actions: list[ActionOutcome]) -> None:
        fams = guard_families(guard)
        for fam in fams:
            if fam.kind == "gauge":
                self.guard_metrics[fam.name].clear()
        declared = {f.name: f for f in fams}
        for s in guard_samples(guard, verdict, actions):
            family = declared.get(s.family)
            if family is None:
                raise ValueError(f"guard {guard.name} sampled undeclared family {s.family}")
            metric: Any = self.guard_metrics[family.name]
            if family.labels:
                metric = metric.labels(**{k: s.labels[k] for k in family.labels})
            UPDATE[family.kind](metric, s.value)

    def close(self) -> None:
        """Nothing to release; the server is stopped by whoever started it."""

    # -- health ---------------------------------------------------------------

    def seconds_since_last_pass(self) -> float:
        since = self.started_mono if self.last_pass_mono is None else self.last_pass_mono
        return max(0.0, self.monotonic() - since)

    def live(self) -> tuple[bool, str]:
        age = self.seconds_since_last_pass()
        if age <= self.liveness_seconds:
            return True, f"reconciling: last pass {age:.1f}s ago\n"
        return False, f"not reconciling: no pass for {age:.1f}s (> {self.liveness_seconds:g}s)\n"

    def ready(self) -> tuple[bool, str]:
        if self.stuck:
            gates = ", ".join(sorted(self.stuck))
            return False, f"not ready: cannot withdraw the gate file of {gates} (retrying)\n"
        if self.passes_ok:
            return True, f"ready: {self.passes_ok} passes completed since start\n"
        return False, "not ready: no pass completed since start\n"

    def scrape(self, accept: str | None) -> tuple[bytes, str]:
        encoder, content_type = choose_encoder(accept or "")
        with self.lock:
            return encoder(self.registry), content_type


# The endpoint is bounded: a scraper, the kubelet's probes and a person's curl need a
# handful of connections; a flood of slow clients (1000 held 1028 threads and +28 MB,
# never given back) must cost neither memory nor the loop. Past the cap a connection is
# closed unread; each request has one deadline for reading it and writing the answer.
MAX_CONNECTIONS = 32
REQUEST_DEADLINE_S = 5.0


class _Server(ThreadingHTTPServer):
    """At the connection cap, the oldest connection still sending its request is closed to
    make room: a slow client loses its place, a scraper or probe (its request sent at
    once) gets one, and a flood of slow clients starves neither."""

    daemon_threads = True
    exporter: MetricsExporter

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._reading: dict[Any, float] = {}  # connection -> when it came, until its request is in
        self._lock = threading.Lock()
        self.evicted = 0  # slow connections closed to make room

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self._evict_oldest_reader()
            if not self._slots.acquire(timeout=1.0):
                self.shutdown_request(request)  # every slot busy answering: no thread
                return
        with self._lock:
            self._reading[request] = time.monotonic()
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._done(request)
            raise

    def request_read(self, request: Any) -> None:
        """The handler has its whole request: it is no longer a candidate to close."""
        with self._lock:
            self._reading.pop(request, None)

    def _evict_oldest_reader(self) -> None:
        with self._lock:
            if not self._reading:
                return
            oldest = min(self._reading, key=self._reading.__getitem__)
            del self._reading[oldest]
        self.evicted += 1
        with contextlib.suppress(OSError):
            oldest.shutdown(socket.SHUT_RDWR)  # its handler's read ends; its slot comes back

    def _done(self, request: Any) -> None:
        with self._lock:
            self._reading.pop(request, None)
        self._slots.release()

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._done(request)


class _Server6(_Server):
    address_family = socket.AF_INET6


class _DeadlineReader:
    """The request's bytes under one deadline for all of them: a per-read timeout lets a
    client that sends a byte every few seconds keep its thread for ever (slowloris)."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock, self.deadline, self.buf = sock, deadline, b""
        self.closed = False

    def _fill(self) -> bool:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("request not received within its deadline")
        self.sock.settimeout(left)
        chunk = self.sock.recv(4096)
        self.buf += chunk
        return bool(chunk)

    def readline(self, limit: int = -1) -> bytes:
        while True:
            i = self.buf.find(b"\n")
            if i >= 0 or 0 <= limit <= len(self.buf) or not self._fill():
                end = i + 1 if i >= 0 else len(self.buf)
                if limit >= 0:
                    end = min(end, limit)
                line, self.buf = self.buf[:end], self.buf[end:]
                return line

    def read(self, n: int = -1) -> bytes:
        while (n < 0 or len(self.buf) < n) and self._fill():
            pass
        end = len(self.buf) if n < 0 else n
        data, self.buf = self.buf[:end], self.buf[end:]
        return data

    def close(self) -> None:
        self.closed = True


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = REQUEST_DEADLINE_S

    def setup(self) -> None:
        super().setup()
        self._deadline = time.monotonic() + REQUEST_DEADLINE_S
        self.rfile = _DeadlineReader(self.connection, self._deadline)  # type: ignore[assignment]

    def do_GET(self) -> None:
        self.server.request_read(self.connection)
        exporter = self.server.exporter
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            body, ctype = exporter.scrape(self.headers.get("Accept"))
            self._reply(200, body, ctype)
            return
        probe = {"/healthz": exporter.live, "/readyz": exporter.ready}.get(path)
        if probe is None:
            self._reply(404, b"not found: /metrics, /healthz, /readyz\n")
            return
        ok, text = probe()
        self._reply(200 if ok else 503, text.encode())

    def _reply(self, code: int, body: bytes, ctype: str = "text/plain; charset=utf-8") -> None:
        # The answer is written within what is left of the request's deadline.
        self.connection.settimeout(max(0.05, self._deadline - time.monotonic()))
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes and probes are not worth a log line each."""


class MetricsServer:
    """The HTTP endpoint in a daemon thread; ``close()`` stops it."""

    def __init__(self, exporter: MetricsExporter, address: str) -> None:
        host, port = parse_address(address)
        server = _Server6 if ":" in host else _Server
        try:
            self._httpd = server((host, port), _Handler)
        except OSError as exc:
            raise NodeagentError(f"metrics address {address}: {exc.strerror or exc}") from None
        self._httpd.exporter = exporter
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._serve, name="nodeagent-metrics", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        # SIGTERM/SIGINT belong to the agent's loop (host/events.StopOnSignal); this
        # thread and the request threads it starts (they inherit the mask) never take them.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
        self._httpd.serve_forever()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)
