"""The exporters: one door, one list (node-problem-detector registers its exporters so).

An exporter makes something of the loop's output for someone outside it and
never decides: the journal and Prometheus read every record and pass result;
NFD's labels and NPD's files are published from every pass's verdicts. One
``Exporter`` shape covers them all (each overrides what it uses):

- ``on_record(rec)``: every timeline record;
- ``on_pass(result, exc)``: every pass, with its result or its exception;
- ``publish(verdicts)``: inside the pass, after the memory is saved and before
  the status (``passes.py``, rule 7): its problem, if any, is shown in that
  pass's ``status.json``, and is never held against a gate;
- ``beat()``: between passes, every ``RENEW_S`` with the leases, for those
  that keep a heartbeat (``needs_beat``);
- ``stop()``: when the loop stops (a label withdrawn, the heartbeat removed);
- ``close()``: when the process lets go (a server's socket).

A failing exporter is logged once and never breaks a pass. Adding one is an
entry in ``EXPORTERS``: a name and how to make it from the config. Those made
only by the daemon (``daemon_only``: a socket to the journal, a port to
scrape) are left out of the simulator's and the tests' agents.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nodeagent.config import Config
from nodeagent.core.guard import Verdict
from nodeagent.core.labels import FILE_NAME, node_labels
from nodeagent.guards.registry import GUARDS, GuardEntry, build_reconciler
from nodeagent.host.conditions import NpdFiles
from nodeagent.host.fs import HostRoot
from nodeagent.host.labels import FeatureFile

if TYPE_CHECKING:  # the library behind it is loaded only when metrics are served
    from nodeagent.metrics import MetricsExporter

log = logging.getLogger("nodeagent.exporters")


class Exporter:
    """The defaults do nothing: an exporter overrides the hooks it uses."""

    name = "exporter"
    needs_beat = False

    def on_record(self, rec: Mapping[str, Any]) -> None:
        return None

    def on_pass(self, result: Any, exc: Exception | None) -> None:
        return None

    def publish(self, verdicts: Mapping[str, Verdict]) -> str | None:
        return None

    def beat(self) -> None:
        return None

    def stop(self) -> None:
        return None

    def close(self) -> None:
        return None

    def writes(self) -> Mapping[str, Collection[str] | None]:
        """Where it writes files atomically (as ``GuardSide.writes``): a killed write's
        temp files there are removed at start."""
        return {}


class Exporters:
    def __init__(self, exporters: Sequence[Any] = ()) -> None:
        self.exporters: list[Any] = list(exporters)
        self._closers: list[Callable[[], None]] = []
        self._failing: set[str] = set()

    def add(self, exporter: Any, closer: Callable[[], None] | None = None) -> None:
        self.exporters.append(exporter)
        if closer is not None:
            self._closers.append(closer)

    def get(self, name: str) -> Any:
        return next((e for e in self.exporters if e.name == name), None)

    def _call(self, exporter: Any, hook: str, *args: Any) -> Any:
        fn = getattr(exporter, hook, None)
        if fn is None:
            return None
        try:
            return fn(*args)
        except Exception as exc:  # an exporter must never take the loop down
            if exporter.name not in self._failing:
                self._failing.add(exporter.name)
                log.error("exporter %s failed: %s: %s", exporter.name, type(exc).__name__, exc)
            if hook == "publish":  # shown in the pass's status, like a problem it returned
                return f"exporter {exporter.name} failed: {type(exc).__name__}: {exc}"
            return None

    def on_record(self, rec: Mapping[str, Any]) -> None:
        for e in self.exporters:
            self._call(e, "on_record", rec)

    def on_pass(self, result: Any, exc: Exception | None) -> None:
        for e in self.exporters:
            self._call(e, "on_pass", result, exc)

    def publish(self, verdicts: Mapping[str, Verdict]) -> list[str]:
        """Inside the pass: each exporter's problem, if it had one."""
        problems = [self._call(e, "publish", verdicts) for e in self.exporters]
        return [p for p in problems if p is not None]

    def needs_beat(self) -> bool:
        return any(getattr(e, "needs_beat", False) for e in self.exporters)

    def beat(self) -> None:
        for e in self.exporters:
            if getattr(e, "needs_beat", False):
                self._call(e, "beat")

    def stop(self) -> None:
        for e in self.exporters:
            self._call(e, "stop")

    def close(self) -> None:
        for closer in self._closers:
            closer()
        for e in self.exporters:
            e.close()

    def writes(self) -> list[tuple[str, Collection[str] | None]]:
        out: list[tuple[str, Collection[str] | None]] = []
        for e in self.exporters:
            if hasattr(e, "writes"):
                out += e.writes().items()
        return out


# -- the exporters -------------------------------------------------------------


class LabelsExporter(Exporter):
    """Node labels through NFD's features.d ([labels] nfd): what the cluster selects on."""

    name = "labels"

    def __init__(self, file: FeatureFile, prefix: str) -> None:
        self.file = file
        self.prefix = prefix

    def publish(self, verdicts: Mapping[str, Verdict]) -> str | None:
        return self.file.publish(node_labels(verdicts, self.prefix))

    def stop(self) -> None:
        self.file.remove()  # a stale "ok" label is worse than none

    def writes(self) -> Mapping[str, Collection[str] | None]:
        return {self.file.dir: (FILE_NAME,)}  # features.d is NFD's: only our file's temps


class NpdExporter(Exporter):
    """What node-problem-detector's plugin reads ([npd] enabled): conditions, events and
    the loop's heartbeat, so a dead or stuck agent reads as Unknown on the Node."""

    name = "npd"
    needs_beat = True

    def __init__(self, files: NpdFiles) -> None:
        self.files = files

    def on_record(self, rec: Mapping[str, Any]) -> None:
        self.files.on_record(rec)  # a Warning event for NPD, if it is one

    def publish(self, verdicts: Mapping[str, Verdict]) -> str | None:
        return self.files.publish(verdicts)

    def beat(self) -> None:
        self.files.beat()

    def stop(self) -> None:
        self.files.stop()  # no heartbeat: NPD's conditions read Unknown, not a stale OK

    def writes(self) -> Mapping[str, Collection[str] | None]:
        return {self.files.dir: None, f"{self.files.dir}/events": None}  # all its own


@dataclass(frozen=True)
class ExporterContext:
    cfg: Config
    host: HostRoot
    wall: Callable[[], float]
    guards: tuple[GuardEntry, ...]
    once: bool  # one pass (``run --once``): nobody to scrape it


def _journal(ctx: ExporterContext, exporters: Exporters) -> None:
    from nodeagent.journal import JournalExporter

    if ctx.cfg.journal:
        host, rel = ctx.host, ctx.cfg.paths.journal_socket
        # Resolved inside the host root like every other path, the socket itself never
        # followed: an absolute symlink on the way stays inside the root.
        exporters.add(
            JournalExporter(str(host.path(rel)), lambda: host.open(rel, os.O_PATH, follow=False))
        )


def metrics_exporter(cfg: Config, guards: tuple[GuardEntry, ...] = GUARDS) -> MetricsExporter:
    """The Prometheus exporter with every guard's series and what their host sides
    declare (the hold's, whether the hold is on or off)."""
    from nodeagent.metrics import MetricsExporter

    return MetricsExporter(
        build_reconciler(cfg.policies, cfg.paths, guards).guards,
        mode=cfg.mode,
        liveness_seconds=cfg.liveness_seconds,
        parts=tuple(t for e in guards if e.side is not None for t in e.side.telemetry),
    )


def _metrics(ctx: ExporterContext, exporters: Exporters) -> None:
    from nodeagent.metrics_server import MetricsServer

    if ctx.cfg.metrics_address == "off" or ctx.once:
        return  # one pass (--once) has nobody to scrape it, nor a port to hold
    metrics = metrics_exporter(ctx.cfg, ctx.guards)
    server = MetricsServer(metrics, ctx.cfg.metrics_address)
    exporters.add(metrics, server.close)


def _labels(ctx: ExporterContext, exporters: Exporters) -> None:
    labels = ctx.cfg.labels
    if labels.nfd:
        file = FeatureFile(ctx.host, labels.features_dir, labels.expiry_seconds, ctx.wall)
        exporters.add(LabelsExporter(file, labels.prefix))


def _npd(ctx: ExporterContext, exporters: Exporters) -> None:
    if ctx.cfg.npd.enabled:
        exporters.add(NpdExporter(NpdFiles(ctx.host, ctx.cfg.paths.state_dir)))


@dataclass(frozen=True)
class ExporterEntry:
    name: str
    make: Callable[[ExporterContext, Exporters], None]
    daemon_only: bool = False


EXPORTERS: tuple[ExporterEntry, ...] = (
    ExporterEntry("journal", _journal, daemon_only=True),
    ExporterEntry("metrics", _metrics, daemon_only=True),
    ExporterEntry("labels", _labels),
    ExporterEntry("npd", _npd),
)


def build_exporters(
    cfg: Config,
    once: bool = False,
    *,
    daemon: bool = True,
    guards: tuple[GuardEntry, ...] = GUARDS,
    wall: Callable[[], float] | None = None,
) -> Exporters:
    """Every configured exporter (``daemon=False``: only those an embedded agent keeps);
    a bad setting (e.g. a taken port) raises NodeagentError."""
    ctx = ExporterContext(cfg, HostRoot(cfg.host_root), wall or time.time, guards, once)
    exporters = Exporters()
    try:
        for entry in EXPORTERS:
            if daemon or not entry.daemon_only:
                entry.make(ctx, exporters)
    except BaseException:
        exporters.close()
        raise
    return exporters
