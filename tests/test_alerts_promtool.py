"""The PrometheusRule's alerts, evaluated by Prometheus's own promtool (Debian's
``prometheus`` package). Skipped, with the reason, where promtool is not installed;
``tests/test_deploy.py`` still checks every alert's metric names against the exporter.

Today: the rule groups parse (``promtool check rules``), and
``NodeagentPeermemNeedsRebuild`` fires after 2 minutes of a stale peermem build and
stays quiet otherwise (``promtool test rules``).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

RULE = Path(__file__).resolve().parent.parent / "deploy/base/prometheusrule.yaml"

REBUILD_TESTS: dict[str, Any] = {
    "rule_files": ["rules.yaml"],
    "evaluation_interval": "30s",
    "tests": [
        {
            "interval": "30s",
            "input_series": [
                {
                    "series": 'nodeagent_peermem_rebuild_needed{node="gpu-1"}',
                    "values": "0 0 1x10",
                },
                {
                    "series": 'nodeagent_peermem_rebuild_needed{node="gpu-2"}',
                    "values": "0x12",
                },
            ],
            "alert_rule_test": [
                {"eval_time": "1m", "alertname": "NodeagentPeermemNeedsRebuild", "exp_alerts": []},
                {
                    "eval_time": "4m",
                    "alertname": "NodeagentPeermemNeedsRebuild",
                    "exp_alerts": [
                        {
                            "exp_labels": {"node": "gpu-1", "severity": "warning"},
                            "exp_annotations": {
                                "summary": "nvidia-peermem on gpu-1 was built against another "
                                "MOFED: recreate the GPU driver pod",
                                "description": "",  # the rule's own text, set below
                                "runbook": "docs/operations.md#nodeagentpeermemneedsrebuild",
                            },
                        }
                    ],
                },
            ],
        }
    ],
}


def _rule(name: str) -> dict[str, Any]:
    doc = yaml.safe_load(RULE.read_text())
    for group in doc["spec"]["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == name:
                return dict(rule)
    raise AssertionError(f"{name} not in {RULE}")


@pytest.fixture
def promtool() -> str:
    tool = shutil.which("promtool")
    if tool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    return tool


def _write_rules(tmp_path: Path) -> None:
    doc = yaml.safe_load(RULE.read_text())
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": doc["spec"]["groups"]}))


def test_the_rule_groups_parse(promtool: str, tmp_path: Path) -> None:
    _write_rules(tmp_path)
    p = subprocess.run(
        [promtool, "check", "rules", "rules.yaml"], cwd=tmp_path, capture_output=True, text=True
    )
    assert p.returncode == 0, p.stdout + p.stderr


def test_the_rebuild_alert_fires_after_two_minutes_and_only_there(
    promtool: str, tmp_path: Path
) -> None:
    _write_rules(tmp_path)
    tests = REBUILD_TESTS
    expected = tests["tests"][0]["alert_rule_test"][1]["exp_alerts"][0]["exp_annotations"]
    expected["description"] = _rule("NodeagentPeermemNeedsRebuild")["annotations"]["description"]
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(tests))
    p = subprocess.run(
        [promtool, "test", "rules", "tests.yaml"], cwd=tmp_path, capture_output=True, text=True
    )
    assert p.returncode == 0, p.stdout + p.stderr
    # The same series with the alert's window not yet passed must not fire: a broken
    # expectation has to fail, or the test above proves nothing.
    tests["tests"][0]["alert_rule_test"][0]["eval_time"] = "2m"
    tests["tests"][0]["alert_rule_test"][0]["exp_alerts"] = [{"exp_labels": {"node": "gpu-1"}}]
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(tests))
    p = subprocess.run(
        [promtool, "test", "rules", "tests.yaml"], cwd=tmp_path, capture_output=True, text=True
    )
    assert p.returncode != 0, "promtool accepted an alert firing before its 2 minutes"
