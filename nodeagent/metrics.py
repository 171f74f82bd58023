"""The Prometheus exporter: the registry, its exposition and the health answers.

The exporter only reads what each pass produced (``PassResult``) and the
timeline records, and never decides. Guard series come from the guards
themselves (``core/telemetry``): every guard's verdict words become
``nodeagent_guard_state`` states, and the families a guard declares are
registered here at start, so a new guard's metrics arrive with the guard. A
part fed by records declares its families the same way (``RecordTelemetry``,
given to the exporter as ``parts``) and samples each record it reads.
The HTTP endpoint that serves ``scrape()``, ``live()`` and ``ready()`` is
``nodeagent.metrics_server``.

Liveness (``/healthz``) says only that the loop reconciles: a pass completed
within ``liveness_seconds`` (counted from start until the first pass).
Readiness (``/readyz``) says a pass has completed since start and no gate file
is stuck (one the agent cannot withdraw; its lease ends it anyway). Neither does
anything: a probe is never the way to reload or act.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
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
    RecordTelemetry,
    Sample,
    guard_families,
    guard_samples,
    verdict_ok,
    verdict_words,
)
from nodeagent.errors import NodeagentError

log = logging.getLogger("nodeagent.metrics")

# What woke a pass, by the first word of each wake-up (events.py, agent.py).
WAKE_SOURCES = frozenset({"start", "once", "resync", "scheduled", "inotify", "uevent", "stop"})
ACTION_KINDS: dict[type, str] = {
    LoadModuleFile: "load",
    LoadModule: "load",
    UnloadModule: "unload",
    WriteFile: "write_file",
    RemoveFile: "remove_file",
}
# How a declared family is made (prometheus-client adds a counter's _total).
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
# How a record's sample changes its family: counters add, gauges add (or subtract),
# histograms observe.
RECORD_UPDATE: dict[str, Callable[[Any, float], None]] = {
    "gauge": lambda m, v: m.inc(v),
    "counter": lambda m, v: m.inc(v),
    "histogram": lambda m, v: m.observe(v),
}


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
        parts: Iterable[RecordTelemetry] = (),
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        disable_created_metrics()
        self.guards = dict(guards)
        self.parts = tuple(parts)
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
        self.gate_stuck = Gauge(
            "nodeagent_gate_withdrawal_failing",
            "1 while the agent cannot withdraw this gate's file (it retries every second; "
            "readers see it closed when its lease ends)",
            ["gate"],
            registry=r,
        )
        self.stuck: set[str] = set()
        r.register(ProcessCollector())

        # Every word a guard declares (or was seen to use): all but the current are 0.
        self.words: dict[str, list[str]] = {}
        for name, guard in self.guards.items():
            self.words[name] = list(verdict_words(guard))
            for word in self.words[name]:
                self.guard_state.labels(name, word).set(0)
            self.guard_ok.labels(name).set(0)
        # The families guards and parts declare, one name space (a name taken is refused).
        self.family_metrics: dict[str, Gauge | Counter | Histogram] = {}
        for guard in self.guards.values():
            for fam in guard_families(guard):
                self.family_metrics[fam.name] = self._family(fam)
        for part in self.parts:
            for fam in part.families:
                self.family_metrics[fam.name] = self._family(fam)

    def _family(self, fam: MetricFamily) -> Gauge | Counter | Histogram:
        if fam.name in self.family_metrics or not fam.name.startswith("nodeagent_"):
            raise NodeagentError(f"metric family {fam.name}: duplicate or not nodeagent_-prefixed")
        return FAMILY_MAKERS[fam.kind](fam, self.registry)

    # -- exporter hooks -------------------------------------------------------

    def on_record(self, rec: Mapping[str, Any]) -> None:
        self.records.labels(str(rec.get("kind", "record"))).inc()
        if rec.get("kind") == "gate-withdrawal":
            gate = str(rec.get("gate"))
            self.gate_stuck.labels(gate).set(0.0 if rec.get("ok") else 1.0)
            if rec.get("ok"):
                self.stuck.discard(gate)
            else:
                self.stuck.add(gate)
        for part in self.parts:
            self._part_samples(part, rec)

    def _part_samples(self, part: RecordTelemetry, rec: Mapping[str, Any]) -> None:
        self._apply(f"part {part.name}", part.families, part.samples(rec), RECORD_UPDATE)

    def _apply(
        self,
        who: str,
        families: Iterable[MetricFamily],
        samples: Iterable[Sample],
        update: Mapping[str, Callable[[Any, float], None]],
    ) -> None:
        """Samples into the families ``who`` declared (a sample of another is refused)."""
        declared = {f.name: f for f in families}
        for s in samples:
            family = declared.get(s.family)
            if family is None:
                raise ValueError(f"{who} sampled undeclared family {s.family}")
            metric: Any = self.family_metrics[family.name]
            if family.labels:
                metric = metric.labels(**{k: s.labels[k] for k in family.labels})
            update[family.kind](metric, s.value)

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
                self.family_metrics[fam.name].clear()
        self._apply(f"guard {guard.name}", fams, guard_samples(guard, verdict, actions), UPDATE)

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
