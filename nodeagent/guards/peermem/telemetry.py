"""The fanotify hold's series (``responder.py``, ``roots.py``), from its records.

Pure declarations and one pure function, no metrics library: the exporter
(``nodeagent.metrics``) is given ``HOLD_TELEMETRY`` and registers its families
at start, whether the hold is on or off (off, the counter has no series and the
gauge reads 0).

- ``held-open`` (one per held open, when its hold ended) adds 1 to
  ``nodeagent_peermem_held_opens_total{ended}``, ``ended`` being how the hold
  ended, its spaces as underscores (``HOLD_ENDINGS``; any other word is ``other``,
  so the label stays bounded);
- ``hold-root-marked`` / ``hold-root-gone`` (a driver container's root marked as
  it starts, unmarked as it goes) raise / lower
  ``nodeagent_peermem_hold_container_roots``;
- ``hold-overflow`` (one per burst of fanotify queue overflows, with its ``count``)
  adds ``count`` to ``nodeagent_peermem_hold_overflows_total``: each overflow is
  a time the kernel allowed opens it dropped, so a held-class open may have gone
  through;
- ``hold-over-cap`` (one per burst of module loaders' opens allowed at once past the
  caps on held opens) adds ``count`` to ``nodeagent_peermem_hold_over_cap_total``;
- ``hold-fault`` (one per burst of errors the responder survived, e.g. out of
  descriptors) adds ``count`` to ``nodeagent_peermem_hold_faults_total{fault}``,
  ``fault`` being ``EMFILE``, ``ENFILE`` or ``other``;
- ``hold-responder-died`` (the responder's process ended while the hold was on:
  what it held went on) adds 1 to ``nodeagent_peermem_hold_responder_deaths_total``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nodeagent.core.telemetry import MetricFamily, RecordTelemetry, Sample

HOLD_ENDINGS = frozenset({"gate_opened", "budget_expired", "responder_stopped", "opener_gone"})

HELD_OPENS = MetricFamily(
    "nodeagent_peermem_held_opens_total",
    "counter",
    "Module loaders' opens of nvidia-peermem.ko held by the fanotify hold, by how "
    "the hold ended (gate_opened, budget_expired, responder_stopped, opener_gone)",
    ("ended",),
)
CONTAINER_ROOTS = MetricFamily(
    "nodeagent_peermem_hold_container_roots",
    "gauge",
    "Driver containers' roots marked by the fanotify hold now (found as they start)",
)

OVERFLOWS = MetricFamily(
    "nodeagent_peermem_hold_overflows_total",
    "counter",
    "fanotify queue overflows seen by the hold: the kernel allowed the opens it dropped, "
    "so a held-class open (a load of nvidia-peermem) may have gone through",
)

OVER_CAP = MetricFamily(
    "nodeagent_peermem_hold_over_cap_total",
    "counter",
    "Module loaders' opens the fanotify hold allowed at once, gate closed, because the "
    "caps on held opens (per container, in all) were reached: a flood of loads",
)
FAULTS = MetricFamily(
    "nodeagent_peermem_hold_faults_total",
    "counter",
    "Errors the fanotify hold's responder survived, by kind (EMFILE, ENFILE: out of "
    "descriptors; other)",
    ("fault",),
)
FAULT_KINDS = frozenset({"EMFILE", "ENFILE"})
RESPONDER_DEATHS = MetricFamily(
    "nodeagent_peermem_hold_responder_deaths_total",
    "counter",
    "Times the fanotify hold's responder process ended while the hold was on: the kernel "
    "let what it held go on, and the agent started a new one",
)


def _count(rec: Mapping[str, Any]) -> float:
    n = rec.get("count")
    return float(n) if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1.0


def hold_samples(rec: Mapping[str, Any]) -> list[Sample]:
    """One record's changes to the hold's series (none for a record it does not read)."""
    kind = rec.get("kind")
    if kind == "held-open":
        ended = str(rec.get("ended")).replace(" ", "_")
        return [Sample(HELD_OPENS.name, {"ended": ended if ended in HOLD_ENDINGS else "other"})]
    if kind == "hold-root-marked":
        return [Sample(CONTAINER_ROOTS.name, value=1.0)]
    if kind == "hold-root-gone":
        return [Sample(CONTAINER_ROOTS.name, value=-1.0)]
    if kind == "hold-overflow":
        return [Sample(OVERFLOWS.name, value=_count(rec))]
    if kind == "hold-over-cap":
        return [Sample(OVER_CAP.name, value=_count(rec))]
    if kind == "hold-fault":
        fault = str(rec.get("fault"))
        labels = {"fault": fault if fault in FAULT_KINDS else "other"}
        return [Sample(FAULTS.name, labels, value=_count(rec))]
    if kind == "hold-responder-died":
        return [Sample(RESPONDER_DEATHS.name)]
    return []


HOLD_TELEMETRY = RecordTelemetry(
    "hold",
    (HELD_OPENS, CONTAINER_ROOTS, OVERFLOWS, OVER_CAP, FAULTS, RESPONDER_DEATHS),
    hold_samples,
)
