"""deploy/helm/nodeagent rendered by the Helm v4 library (helm-python-sdk, no binary), for
``test_helm.py``, ``test_chart_install.py`` and ``test_chart_readme.py``. Importing it
skips the importing test file where helm-python-sdk is not installed."""

from __future__ import annotations

import copy
import logging
import tomllib
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

CHART = Path(__file__).resolve().parent.parent / "deploy" / "helm" / "nodeagent"


helm = pytest.importorskip("helm_python", reason="helm-python-sdk is not installed")
logging.getLogger("helm_python").setLevel(logging.WARNING)


@cache
def chart() -> Any:
    return helm.Chart.load(str(CHART))


def allowing_unset_image(values: dict[str, Any] | None = None) -> dict[str, Any]:
    """The values with the escape hatch for the chart's unpublished default image (an install
    with it fails, tests/test_chart_install.py), unless they set it themselves."""
    values = copy.deepcopy(values or {})
    values.setdefault("image", {}).setdefault("allowUnset", True)
    return values


def render(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    out = chart().render(
        allowing_unset_image(values), name="nodeagent", namespace="nodeagent", is_install=True
    )
    docs = []
    for path, text in sorted(out.items()):
        if path.endswith("NOTES.txt"):
            continue
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def notes(values: dict[str, Any] | None = None) -> str:
    out = chart().render(
        allowing_unset_image(values), name="nodeagent", namespace="nodeagent", is_install=True
    )
    text: str = out["nodeagent/templates/NOTES.txt"]
    return text


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, f"one {kind} {name or ''}: {len(found)}"
    return found[0]


HOLD_ON = {"hold": {"enabled": True}, "agent": {"mode": "enforce"}}


# The Helm library here takes no API versions (helm's --api-versions): the chart's value
# says the Prometheus Operator's API is served.
MONITORING_API = {"monitoring": {"apiAvailable": True}}


TOGGLES: dict[str, dict[str, Any]] = {
    "defaults": {},
    "monitoring API": MONITORING_API,
    "kube-prometheus-stack": {
        **MONITORING_API,
        "serviceMonitor": {"additionalLabels": {"release": "kps"}},
        "prometheusRule": {"additionalLabels": {"release": "kps"}},
        "dashboard": {"additionalLabels": {"release": "kps"}},
    },
    "hold": {**HOLD_ON, **MONITORING_API},
    "openshift": {"platform": {"openshift": True}, **MONITORING_API},
    "openshift user-workload monitoring": {
        "platform": {"openshift": True},
        **MONITORING_API,
        "serviceMonitor": {"token": "secret"},
    },
    "openshift+hold": {"platform": {"openshift": True}, **HOLD_ON, **MONITORING_API},
    "no metrics": {"metrics": {"enabled": False}, **MONITORING_API},
    "no monitoring objects": {
        **MONITORING_API,
        "serviceMonitor": {"enabled": False},
        "prometheusRule": {"enabled": False},
        "dashboard": {"enabled": False},
    },
    "npd plugin, no labels": {"npd": {"pluginConfigMap": True}, "labels": {"nfd": False}},
    "numvfs by the agent, another port": {
        "agent": {"sriov": {"numvfsOwner": "agent"}},
        "metrics": {"port": 9818},
    },
    "daemonset settings": {
        "daemonsets": {
            "priorityClassName": "gpu-critical",
            "nodeSelector": {"nvidia.com/gpu.deploy.nodeagent": "true"},
            "updateStrategy": "OnDelete",
            "labels": {"team": "gpu"},
            "annotations": {"a": "b"},
        },
        "image": {"repository": "registry.example/nodeagent", "tag": "0.1.1"},
        "imagePullSecrets": [{"name": "pull"}],
    },
    "names, digests, pod metadata": {
        "nameOverride": "gpu-agent",
        "fullnameOverride": "gpu-node-agent",
        "image": {
            "registry": "registry.example:5000",
            "repository": "ml/nodeagent",
            "tag": "ignored",
            "digest": "sha256:" + "a" * 64,
        },
        "metrics": {"kubeRbacProxy": {"image": {"registry": "mirror.example", "tag": "v0.19.0"}}},
        "podAnnotations": {"example.com/owner": "gpu"},
        "podLabels": {"team": "gpu", "app.kubernetes.io/name": "not-the-selector"},
        "platform": {"openshift": True},
        **MONITORING_API,
        "serviceMonitor": {"token": "secret"},
        "dashboard": {"enabled": True},
        "npd": {"pluginConfigMap": True},
    },
    "guards switched": {
        "agent": {
            "peermem": {"enabled": False, "mofed": "none"},
            "storage": {"enabled": True},
            "sriov": {"enabled": False},
        }
    },
    "extraObjects": {
        "extraObjects": [
            {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}, "data": {}}
        ]
    },
}


def agent_toml(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (config,) = [d for d in docs if d["metadata"]["name"].endswith("-config")]
    return tomllib.loads(config["data"]["agent.toml"])
