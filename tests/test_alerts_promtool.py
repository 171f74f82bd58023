"""The PrometheusRule's alerts, evaluated by Prometheus's own promtool (Debian's
``prometheus`` package). Skipped, with the reason, where promtool is not installed;
``tests/test_deploy.py`` still checks every alert's metric names against the exporter.

The rule groups parse (``promtool check rules``), and every alert is run through
``promtool test rules`` on series shaped like the exporter's (``node``, ``instance``,
``job`` as the ServiceMonitor scrapes them): it fires on the node with the problem once
its ``for:`` has passed, with its severity, summary, description and runbook, and stays
quiet before that, on healthy nodes, on problems shorter than ``for:`` and on series its
expression must not match. Each firing check is also run inverted (no alert expected),
which promtool must reject, so no check passes by matching nothing.

- NodeagentPeermemGateHeldWhileMofedReady: gate closed with MOFED ready for 10m, per node.
- NodeagentPeermemNeedsRebuild: ``rebuild_needed`` 1 for 2m.
- NodeagentStorageChainBlockingMofed, NodeagentVFsDegraded, NodeagentGuardNotOk: their
  guards' ``nodeagent_guard_ok`` 0 for 5m, 5m, 30m, and only their guards.
- NodeagentNotReconciling: ``seconds_since_last_pass`` above 120 in two scrapes of 15m.
- NodeagentDown: ``up{job="nodeagent"}`` 0 for 5m.
- NodeagentModuleLoadFailed: a failed-load counter that rises, for the 15m after.

Two alerts were wrong and are fixed (their tests were expected failures first):
NodeagentModuleLoadFailed missed a module's first failed load (the counter is born at 1,
so ``increase`` saw nothing: a series new within 15 minutes now counts), and
NodeagentNotReconciling could not fire while the DaemonSet's liveness probe restarts a
wedged agent within about 3 minutes (the metric starts from 0 with each process and
never passed 300: now two scrapes past 2 minutes within 15 minutes, a stall that
survives a restart).

Rules are evaluated every 10 s and series scraped every 30 s, so every check falls
between two samples and no range starts on one: Prometheus 3 (the clusters') opens
ranges on the left, promtool 2.42 closes them.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

RULE = Path(__file__).resolve().parent.parent / "deploy/base/prometheusrule.yaml"
TESTED = {
    "NodeagentPeermemGateHeldWhileMofedReady",
    "NodeagentPeermemNeedsRebuild",
    "NodeagentStorageChainBlockingMofed",
    "NodeagentVFsDegraded",
    "NodeagentNotReconciling",
    "NodeagentDown",
    "NodeagentModuleLoadFailed",
    "NodeagentGuardNotOk",
}
# "nvlink": a guard added later, which only NodeagentGuardNotOk covers.
GUARDS = ("peermem", "storage", "sriov", "nvlink")

Check = dict[str, Any]
REBUILD = "nodeagent_peermem_rebuild_needed"
SINCE = "nodeagent_seconds_since_last_pass"
LOADS = "nodeagent_module_actions_total"
PEERMEM = {"guard": "peermem", "module": "nvidia_peermem"}


def _groups() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULE.read_text())
    return list(doc["spec"]["groups"])


def _rule(name: str) -> dict[str, Any]:
    for group in _groups():
        for rule in group["rules"]:
            if rule.get("alert") == name:
                return dict(rule)
    raise AssertionError(f"{name} not in {RULE}")


def _target(node: str) -> dict[str, str]:
    """The labels the ServiceMonitor's scrape gives every series of one node's agent."""
    ip = f"10.0.0.{node.removeprefix('gpu-')}"
    return {"node": node, "instance": f"{ip}:9808", "job": "nodeagent"}


def _series(metric: str, values: str, node: str, **labels: str) -> dict[str, str]:
    inner = ",".join(f'{k}="{v}"' for k, v in sorted({**labels, **_target(node)}.items()))
    return {"series": f"{metric}{{{inner}}}", "values": values}


def _firing(name: str, severity: str, summary: str, node: str, **labels: str) -> Check:
    """One alert as promtool must see it: the series' labels, the rule's severity, the
    summary as written here, the description as the rule writes it, the runbook anchor."""
    got = {**labels, **_target(node)}
    description = str(_rule(name)["annotations"]["description"])
    description = re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: got[m.group(1)], description)
    return {
        "exp_labels": {**got, "severity": severity},
        "exp_annotations": {
            "summary": summary,
            "description": description,
            "runbook": f"docs/operations.md#{name.lower()}",
        },
    }


def _at(eval_time: str, name: str, *alerts: Check) -> Check:
    return {"eval_time": eval_time, "alertname": name, "exp_alerts": list(alerts)}


@pytest.fixture
def promtool() -> str:
    tool = shutil.which("promtool")
    if tool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    return tool


def _write_rules(tmp_path: Path) -> None:
    # promtool reads a plain rules file, not the PrometheusRule CRD around it.
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": _groups()}))


def _promtool_test(
    promtool: str, tmp_path: Path, series: list[dict[str, str]], checks: list[Check]
) -> subprocess.CompletedProcess[str]:
    _write_rules(tmp_path)
    tests = {
        "rule_files": ["rules.yaml"],
        "evaluation_interval": "10s",
        "tests": [{"interval": "30s", "input_series": series, "alert_rule_test": checks}],
    }
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(tests, sort_keys=False))
    return subprocess.run(
        [promtool, "test", "rules", "tests.yaml"], cwd=tmp_path, capture_output=True, text=True
    )


def _assert_alerts(
    promtool: str, tmp_path: Path, series: list[dict[str, str]], checks: list[Check]
) -> None:
    p = _promtool_test(promtool, tmp_path, series, checks)
    assert p.returncode == 0, p.stdout + p.stderr
    # The same series with no alert expected anywhere must fail: a firing check that
    # matched nothing (a misspelt metric, a label the expression drops) proves nothing.
    assert any(c["exp_alerts"] for c in checks)
    quiet = [{**c, "exp_alerts": []} for c in checks]
    p = _promtool_test(promtool, tmp_path, series, quiet)
    assert p.returncode != 0, "promtool accepted silence where an alert must fire"


def _assert_fires_after(
    promtool: str,
    tmp_path: Path,
    series: list[dict[str, str]],
    name: str,
    fired: Check,
    quiet: tuple[str, ...],
    firing: tuple[str, ...],
) -> None:
    """``name`` quiet at the times ``quiet``, and only ``fired`` at the times ``firing``."""
    checks = [_at(t, name) for t in quiet] + [_at(t, name, fired) for t in firing]
    _assert_alerts(promtool, tmp_path, series, checks)


def test_the_rule_groups_parse(promtool: str, tmp_path: Path) -> None:
    _write_rules(tmp_path)
    p = subprocess.run(
        [promtool, "check", "rules", "rules.yaml"], cwd=tmp_path, capture_output=True, text=True
    )
    assert p.returncode == 0, p.stdout + p.stderr


def test_every_alert_of_the_rule_is_tested_here() -> None:
    alerts = {r["alert"] for g in _groups() for r in g["rules"] if "alert" in r}
    assert alerts == TESTED


def test_the_gate_alert_fires_after_ten_minutes_closed_with_mofed_ready(
    promtool: str, tmp_path: Path
) -> None:
    name = "NodeagentPeermemGateHeldWhileMofedReady"
    ok, ready = "nodeagent_guard_ok", "nodeagent_peermem_mofed_ready"
    series = [
        # gpu-1: closed from 1m with MOFED ready: fires at 11m.
        _series(ok, "1 1 0x60", "gpu-1", guard="peermem"),
        _series(ready, "1x62", "gpu-1"),
        # gpu-2: closed while MOFED is not ready (restarting): gpu-1's ready is not its.
        _series(ok, "0x62", "gpu-2", guard="peermem"),
        _series(ready, "0x62", "gpu-2"),
        # gpu-3: open with MOFED ready; gpu-4: closed 8m30s with MOFED ready, then open.
        _series(ok, "1x62", "gpu-3", guard="peermem"),
        _series(ready, "1x62", "gpu-3"),
        _series(ok, "1 1 0x16 1x44", "gpu-4", guard="peermem"),
        _series(ready, "1x62", "gpu-4"),
        # gpu-5: another guard closed with MOFED ready.
        _series(ok, "0x62", "gpu-5", guard="storage"),
        _series(ready, "1x62", "gpu-5"),
        # gpu-6: closed for a rebuild with MOFED ready: NodeagentPeermemNeedsRebuild's.
        _series(ok, "0x62", "gpu-6", guard="peermem"),
        _series(ready, "1x62", "gpu-6"),
        _series("nodeagent_peermem_rebuild_needed", "1x62", "gpu-6"),
    ]
    summary = "nvidia_peermem gate closed for 10m on gpu-1 although MOFED is ready"
    fired = _firing(name, "warning", summary, "gpu-1", guard="peermem")
    quiet, firing = ("5m10s", "10m50s"), ("11m10s", "30m10s")
    _assert_fires_after(promtool, tmp_path, series, name, fired, quiet, firing)


@pytest.mark.parametrize(
    ("name", "series", "severity", "summary", "quiet", "firing"),
    [
        pytest.param(
            "NodeagentPeermemNeedsRebuild",
            [
                _series(REBUILD, "0 0 1x30", "gpu-1"),  # rebuild from 1m: fires at 3m
                _series(REBUILD, "0x32", "gpu-2"),
                _series(REBUILD, "0 0 1x2 0x28", "gpu-3"),  # a rebuild verdict of 1m30s
            ],
            "warning",
            "nvidia-peermem on gpu-1 was built against another MOFED: recreate the GPU driver pod",
            ("1m10s", "2m50s"),
            ("3m10s", "15m10s"),
            id="rebuild-after-2m",
        ),
        # The expression turns true at the second scrape past 120 s without a pass
        # (2m30s: 150, 3m: 180), and the alert fires a minute later.
        pytest.param(
            "NodeagentNotReconciling",
            [
                _series(SINCE, "0+30x40", "gpu-1"),  # no pass since 0s
                _series(SINCE, "5 20 5 20x38", "gpu-2"),  # a pass every resync (30s)
                _series(SINCE, "0+30x4 5x36", "gpu-3"),  # 2 minutes without, then passes
            ],
            "critical",
            "nodeagent on gpu-1 keeps stalling: no pass for 2m, again after restarts",
            ("50s", "3m50s"),
            ("4m10s", "20m10s"),
            id="no-pass-twice-past-2m",
        ),
        pytest.param(
            "NodeagentDown",
            [
                _series("up", "1 1 0x40", "gpu-1"),  # down from 1m: fires at 6m
                _series("up", "1x42", "gpu-2"),
                _series("up", "1 1 0x7 1x33", "gpu-3"),  # down 3m30s (a restart)
                # Another job's target down on the same node.
                {
                    "series": 'up{instance="10.0.0.1:9100",job="node-exporter",node="gpu-1"}',
                    "values": "0x42",
                },
            ],
            "critical",
            "nodeagent on 10.0.0.1:9808 cannot be scraped",
            ("50s", "5m50s"),
            ("6m10s", "20m10s"),
            id="down-for-5m",
        ),
    ],
)
def test_a_one_metric_alert_fires_on_gpu_1_after_its_for_and_only_there(
    promtool: str,
    tmp_path: Path,
    name: str,
    series: list[dict[str, str]],
    severity: str,
    summary: str,
    quiet: tuple[str, ...],
    firing: tuple[str, ...],
) -> None:
    fired = _firing(name, severity, summary, "gpu-1")
    _assert_fires_after(promtool, tmp_path, series, name, fired, quiet, firing)


@pytest.mark.parametrize(
    ("name", "guard", "minutes", "severity", "summary"),
    [
        pytest.param(
            "NodeagentStorageChainBlockingMofed",
            "storage",
            5,
            "critical",
            "Storage modules block the MOFED driver on gpu-1",
            id="storage",
        ),
        pytest.param(
            "NodeagentVFsDegraded",
            "sriov",
            5,
            "warning",
            "SR-IOV VFs degraded on gpu-1",
            id="sriov",
        ),
        pytest.param(
            "NodeagentGuardNotOk",
            "nvlink",
            30,
            "warning",
            "nodeagent guard nvlink not ok for 30m on gpu-1",
            id="any-other-guard",
        ),
    ],
)
def test_a_guard_alert_fires_after_its_for_and_only_for_its_guard(
    promtool: str,
    tmp_path: Path,
    name: str,
    guard: str,
    minutes: int,
    severity: str,
    summary: str,
) -> None:
    n = 2 * (minutes + 15)  # samples every 30s, to 15 minutes past the alert's for:
    short = 2 * minutes - 3  # not ok for a minute less than for:
    ok = "nodeagent_guard_ok"
    series = [
        _series(ok, f"1 1 0x{n}", "gpu-1", guard=guard),  # not ok from 1m
        _series(ok, f"1x{n + 2}", "gpu-2", guard=guard),
        _series(ok, f"1 1 0x{short} 1x{n - short}", "gpu-3", guard=guard),
        # gpu-4: every other guard not ok all along.
        *(_series(ok, f"0x{n + 2}", "gpu-4", guard=g) for g in GUARDS if g != guard),
    ]
    fired = _firing(name, severity, summary, "gpu-1", guard=guard)
    quiet, firing = ("50s", f"{minutes}m50s"), (f"{minutes + 1}m10s", f"{minutes + 14}m10s")
    _assert_fires_after(promtool, tmp_path, series, name, fired, quiet, firing)


def test_the_reconcile_alert_fires_for_an_agent_the_liveness_probe_keeps_restarting(
    promtool: str, tmp_path: Path
) -> None:
    name = "NodeagentNotReconciling"
    wedged = " ".join(["0+30x5"] * 10)  # each process wedged at once, killed after 150s
    series = [
        _series(SINCE, wedged, "gpu-1"),
        _series(SINCE, "0+30x60", "gpu-2"),  # one process without a pass: does fire
        # gpu-3: one stall (restarted at 12m30s), then passes again: quiet.
        _series(SINCE, "0x20 0+30x5 0x30", "gpu-3"),
        _series(SINCE, "0x60", "gpu-4"),  # healthy
    ]
    summary = "nodeagent on {} keeps stalling: no pass for 2m, again after restarts"
    checks = [
        _at(
            "25m10s",
            name,
            _firing(name, "critical", summary.format("gpu-1"), "gpu-1"),
            _firing(name, "critical", summary.format("gpu-2"), "gpu-2"),
        ),
    ]
    _assert_alerts(promtool, tmp_path, series, checks)


def test_the_load_alert_fires_while_failed_loads_rose_in_15_minutes(
    promtool: str, tmp_path: Path
) -> None:
    name = "NodeagentModuleLoadFailed"
    # Every series exists for 16 minutes before the checks' 0 (OLD samples): a counter
    # seen for the first time counts as a failure for its first 15 minutes (below).
    old = 32
    series = [
        # gpu-1: a load failed before (1), fails again at 5m30s and 6m: fires at once,
        # until the rise leaves the 15-minute window (20m30s).
        _series(LOADS, f"1x{old + 10} 2 3x50", "gpu-1", **PEERMEM, action="load",
                result="failed"),
        # gpu-2: loads that succeed, unloads that fail, loads observe mode only decides.
        _series(LOADS, f"1+1x{old + 60}", "gpu-2", **PEERMEM, action="load", result="ok"),
        _series(LOADS, f"1+1x{old + 60}", "gpu-2", **PEERMEM, action="unload",
                result="failed"),
        _series(LOADS, f"1+1x{old + 60}", "gpu-2", **PEERMEM, action="load",
                result="not_performed"),
        # gpu-3: the agent restarted at 8m30s (its counter gone, then reset) and the load
        # failed again at 10m: the reset counts, until 8m30s leaves the window (23m30s).
        _series(LOADS, f"2x{old + 17} _x2 1x40", "gpu-3", **PEERMEM, action="load",
                result="failed"),
    ]  # fmt: skip
    summary = "nodeagent failed to load nvidia_peermem on {}"
    labels = {**PEERMEM, "action": "load", "result": "failed"}
    gpu1 = _firing(name, "warning", summary.format("gpu-1"), "gpu-1", **labels)
    gpu3 = _firing(name, "warning", summary.format("gpu-3"), "gpu-3", **labels)
    checks = [
        _at(f"{16 + m}m{sec}s", name, *alerts)  # after the 16 minutes of OLD samples
        for m, sec, alerts in (
            (5, 20, ()),
            (5, 40, (gpu1,)),
            (11, 10, (gpu1, gpu3)),
            (20, 10, (gpu1, gpu3)),
            (20, 40, (gpu3,)),
            (23, 40, ()),
        )
    ]
    _assert_alerts(promtool, tmp_path, series, checks)


def test_the_load_alert_fires_on_a_modules_first_failed_load(promtool: str, tmp_path: Path) -> None:
    name = "NodeagentModuleLoadFailed"
    series = [
        # gpu-1: the first failed load since the agent started, at 5m30s.
        _series(LOADS, "_x11 1x50", "gpu-1", **PEERMEM, action="load", result="failed"),
        # gpu-2: a later failure of a module that failed before: does fire.
        _series(LOADS, "1x11 2x50", "gpu-2", **PEERMEM, action="load", result="failed"),
    ]
    summary = "nodeagent failed to load nvidia_peermem on {}"
    labels = {**PEERMEM, "action": "load", "result": "failed"}
    checks = [
        _at(
            "7m10s",
            name,
            _firing(name, "warning", summary.format("gpu-1"), "gpu-1", **labels),
            _firing(name, "warning", summary.format("gpu-2"), "gpu-2", **labels),
        ),
    ]
    _assert_alerts(promtool, tmp_path, series, checks)


def test_no_alert_fires_on_a_guard_that_does_not_apply_and_the_real_case_still_does(
    promtool: str, tmp_path: Path
) -> None:
    """Issue 54: a NIC-only node (peermem and sriov ``not-applicable``, MOFED ready) and a
    node whose guards are turned off (``disabled``), as the exporter shows them (ok 1, the
    state series of the shared word), for 30 minutes: every guard alert stays quiet there,
    while gpu-1's gate, closed with MOFED ready, fires as before."""
    ok, ready, state = (
        "nodeagent_guard_ok",
        "nodeagent_peermem_mofed_ready",
        "nodeagent_guard_state",
    )
    series = [
        _series(ok, "1 1 0x60", "gpu-1", guard="peermem"),
        _series(ready, "1x62", "gpu-1"),
    ]
    for node, word in (("gpu-7", "not-applicable"), ("gpu-8", "disabled")):
        for g in ("peermem", "storage", "sriov"):
            series.append(_series(ok, "1x62", node, guard=g))
            series.append(_series(state, "1x62", node, guard=g, state=word))
        series.append(_series(ready, "1x62", node))
        series.append(_series(REBUILD, "0x62", node))
    name = "NodeagentPeermemGateHeldWhileMofedReady"
    summary = "nvidia_peermem gate closed for 10m on gpu-1 although MOFED is ready"
    fired = _firing(name, "warning", summary, "gpu-1", guard="peermem")
    others = sorted(TESTED - {name})
    checks = [
        _at("30m10s", name, fired),
        *(_at(t, a) for a in others for t in ("10m10s", "30m10s")),
    ]
    _assert_alerts(promtool, tmp_path, series, checks)
