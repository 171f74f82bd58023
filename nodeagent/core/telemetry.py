"""What a guard tells the exporters about itself: its verdict words and its own metrics.

Pure declarations, no metrics library: ``nodeagent.metrics`` turns them into
Prometheus series, ``nodeagent.journal`` into journal fields. A new guard
brings its own series by declaring them here, next to its decision code:

- ``verdict_words``: every verdict word the guard can return, in order (the
  states of ``nodeagent_guard_state{guard,state}``); default ``open, closed``.
  ``not-applicable`` and ``disabled`` (core/applicability.py) follow every
  guard's own.
- ``metric_families``: extra families (name, kind, help, label names).
- ``metric_samples(verdict, outcomes)``: the values for one pass, from the
  verdict it just returned and the outcomes of its actions in that pass
  (``ActionOutcome.seconds``: how long each took, when performed).
  Gauge families are replaced every pass (a series not sampled disappears);
  counter samples add, histogram samples are observations.

Labels must be bounded: names from config, condition names, PCI addresses;
never free text such as a reason or an error message.

The coupling to the guard and verdict shape lives here and only here
(``verdict_words``, ``verdict_ok``), so a change of that shape is one edit.

A part that is not a guard but writes timeline records (the fanotify hold:
``guards/peermem/telemetry.py``) declares its series the same way, as a
``RecordTelemetry``: its ``families`` and a pure ``samples(record)``. The
exporter is given the parts, registers their families at start beside the
guards' (one name space, same checks), and feeds every record to each part.
A record's samples are changes: a counter's value is added, a gauge's value is
added too (negative to lower it: a gauge counts what is there now), a
histogram's value is observed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from nodeagent.core.actions import ActionOutcome
from nodeagent.core.applicability import WORDS as SHARED_WORDS
from nodeagent.core.guard import Verdict

MetricKind = Literal["gauge", "counter", "histogram"]

DEFAULT_VERDICT_WORDS: tuple[str, ...] = ("open", "closed")

# Seconds: from sub-millisecond module operations to a slow VF re-creation.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)


@dataclass(frozen=True)
class MetricFamily:
    """One metric family a guard or a part adds (full name, ``nodeagent_`` prefix included)."""

    name: str
    kind: MetricKind
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = LATENCY_BUCKETS  # histograms only


@dataclass(frozen=True)
class Sample:
    family: str
    labels: Mapping[str, str] = field(default_factory=dict)
    value: float = 1.0


class GuardTelemetry(Protocol):
    """The optional part of a guard the exporters read (all members optional)."""

    name: str
    verdict_words: tuple[str, ...]
    metric_families: tuple[MetricFamily, ...]

    def metric_samples(
        self, verdict: Verdict, outcomes: Sequence[ActionOutcome]
    ) -> Iterable[Sample]: ...


@dataclass(frozen=True)
class RecordTelemetry:
    """A part fed by timeline records: the families it adds and how one record samples them.

    ``samples`` is pure (no state, no clock): a record in, its samples out (none for a
    record the part does not read); a gauge sample's value is a change, not a level.
    """

    name: str
    families: tuple[MetricFamily, ...]
    samples: Callable[[Mapping[str, Any]], Iterable[Sample]]


def verdict_words(guard: Any) -> tuple[str, ...]:
    """The guard's own words, then the ones every guard shares (core/applicability.py)."""
    own = tuple(getattr(guard, "verdict_words", DEFAULT_VERDICT_WORDS))
    return own + tuple(w for w in SHARED_WORDS if w not in own)


def verdict_ok(verdict: Verdict) -> bool:
    return bool(verdict.ok)


def guard_families(guard: Any) -> tuple[MetricFamily, ...]:
    return tuple(getattr(guard, "metric_families", ()))


def guard_samples(guard: Any, verdict: Verdict, outcomes: Sequence[ActionOutcome]) -> list[Sample]:
    sampler = getattr(guard, "metric_samples", None)
    return [] if sampler is None else list(sampler(verdict, outcomes))
