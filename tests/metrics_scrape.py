"""What an exporter serves, read back as series (``test_metrics.py``,
``guards/sriov/test_sriov_metrics.py``), and a pass result to feed it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

from prometheus_client.parser import text_string_to_metric_families

from nodeagent.agent import PassResult
from nodeagent.core.actions import ActionOutcome
from nodeagent.core.snapshot import NodeSnapshot
from nodeagent.metrics import MetricsExporter

Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def value(series: Series, name: str, **labels: str) -> float | None:
    return series.get((name, tuple(sorted(labels.items()))))


def pass_result(
    verdicts: Mapping[str, Any], outcomes: Sequence[ActionOutcome], woken_by: Sequence[str]
) -> PassResult:
    return PassResult(
        cast(NodeSnapshot, None),  # the exporter reads no snapshot
        dict(verdicts),
        tuple(outcomes),
        None,
        woken_by=tuple(woken_by),
        started=100.0,
    )


def exporter_series(exp: MetricsExporter) -> Series:
    body, _ = exp.scrape(None)
    out: Series = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out
