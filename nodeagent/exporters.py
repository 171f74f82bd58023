"""The exporters the agent feeds: one registry, called through the agent's hooks.

An exporter reads the agent's records (``on_record``) and pass results
(``on_pass``) and never decides. A failing exporter is logged once and never
breaks a pass. Adding an exporter is one entry in ``EXPORTERS``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from nodeagent.config import Config

log = logging.getLogger("nodeagent.exporters")


class Exporter(Protocol):
    name: str

    def on_record(self, rec: Mapping[str, Any]) -> None: ...

    def on_pass(self, result: Any, exc: Exception | None) -> None: ...

    def close(self) -> None: ...


class Exporters:
    def __init__(self, exporters: list[Exporter] | None = None) -> None:
        self.exporters: list[Exporter] = list(exporters or [])
        self._closers: list[Callable[[], None]] = []
        self._failing: set[str] = set()

    def add(self, exporter: Exporter, closer: Callable[[], None] | None = None) -> None:
        self.exporters.append(exporter)
        if closer is not None:
            self._closers.append(closer)

    def get(self, name: str) -> Exporter | None:
        return next((e for e in self.exporters if e.name == name), None)

    def _call(self, exporter: Exporter, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as exc:  # an exporter must never take the loop down
            if exporter.name not in self._failing:
                self._failing.add(exporter.name)
                log.error("exporter %s failed: %s: %s", exporter.name, type(exc).__name__, exc)

    def on_record(self, rec: Mapping[str, Any]) -> None:
        for e in self.exporters:
            self._call(e, lambda e=e: e.on_record(rec))  # type: ignore[misc]

    def on_pass(self, result: Any, exc: Exception | None) -> None:
        for e in self.exporters:
            self._call(e, lambda e=e: e.on_pass(result, exc))  # type: ignore[misc]

    def close(self) -> None:
        for closer in self._closers:
            closer()
        for e in self.exporters:
            e.close()


def _journal(cfg: Config, exporters: Exporters, once: bool) -> None:
    from nodeagent.host.fs import HostRoot
    from nodeagent.journal import JournalExporter

    if cfg.journal:
        host, rel = HostRoot(cfg.host_root), cfg.paths.journal_socket
        # Resolved inside the host root like every other path, the socket itself never
        # followed: an absolute symlink on the way stays inside the root.
        exporters.add(
            JournalExporter(str(host.path(rel)), lambda: host.open(rel, os.O_PATH, follow=False))
        )


def _metrics(cfg: Config, exporters: Exporters, once: bool) -> None:
    from nodeagent.agent import build_reconciler
    from nodeagent.metrics import MetricsExporter, MetricsServer

    if cfg.metrics_address == "off" or once:
        return  # one pass (--once) has nobody to scrape it, nor a port to hold
    metrics = MetricsExporter(
        build_reconciler(cfg).guards, mode=cfg.mode, liveness_seconds=cfg.liveness_seconds
    )
    server = MetricsServer(metrics, cfg.metrics_address)
    exporters.add(metrics, server.close)


EXPORTERS: tuple[Callable[[Config, Exporters, bool], None], ...] = (_journal, _metrics)


def build_exporters(cfg: Config, once: bool = False) -> Exporters:
    """Every configured exporter; a bad setting (e.g. a taken port) raises NodeagentError."""
    exporters = Exporters()
    try:
        for make in EXPORTERS:
            make(cfg, exporters, once)
    except BaseException:
        exporters.close()
        raise
    return exporters
