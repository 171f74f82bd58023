"""The chart's README (what `helm show readme` prints): in the packaged archive, and its
values table the one scripts/chart-readme.py makes from values.yaml and the schema."""

from __future__ import annotations

import runpy
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.helm_render import CHART

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "chart-readme.py"
readme_script = runpy.run_path(str(SCRIPT))


def test_the_readme_table_is_the_one_values_yaml_makes() -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


def test_a_changed_values_yaml_makes_the_table_stale() -> None:
    readme = (CHART / "README.md").read_text()
    values = (CHART / "values.yaml").read_text()
    changed = values.replace("resyncSeconds: 30", "resyncSeconds: 45")
    assert changed != values
    schema = readme_script["json"].loads((CHART / "values.schema.json").read_text())
    rows, undescribed = readme_script["rows"](changed, schema)
    assert "| `agent.resyncSeconds` | number | `45` |" in "\n".join(rows)
    assert not all(row in readme for row in rows)
    assert undescribed == []


def test_a_key_that_says_nothing_is_named() -> None:
    values = "image:\n  # where it is\n  registry: q.io\n  tag: v1\nports: [1, 2]  # the ports\n"
    rows, undescribed = readme_script["rows"](values, {})
    assert undescribed == ["image.tag"]
    assert [r.split("|")[1].strip() for r in rows] == ["`image.registry`", "`image.tag`", "`ports`"]


def test_a_list_written_out_is_one_row_not_keys_of_the_chart() -> None:
    values = (
        "# who may run\ntolerations:\n  - key: a\n    operator: Exists\n  - key: b\n"
        "    effect: NoSchedule\nafter: 1  # the next key\n"
    )
    rows, undescribed = readme_script["rows"](values, {})
    assert [r.split("|")[1].strip() for r in rows] == ["`tolerations`", "`after`"]
    assert undescribed == []


def test_every_leaf_value_is_in_the_table() -> None:
    readme = (CHART / "README.md").read_text()
    for key in ("image.digest", "monitoring.apiAvailable", "serviceMonitor.additionalLabels"):
        assert f"| `{key}` |" in readme


def test_the_packaged_chart_holds_the_readme(tmp_path: Path) -> None:
    helm = pytest.importorskip("helm_python", reason="helm-python-sdk is not installed")
    archive = helm.package(str(CHART), destination=str(tmp_path))
    with tarfile.open(archive) as tar:
        member = tar.extractfile("nodeagent/README.md")
        assert member is not None
        text = member.read().decode()
    assert text == (CHART / "README.md").read_text()
    assert "helm install nodeagent" in text and "| `image.digest` |" in text
