"""deploy/: renders with kustomize, validates offline, and says what the agent really does.

Built-in kinds are validated against the Kubernetes schemas (kubernetes-validate,
strict). The CRD kinds (ServiceMonitor, PrometheusRule, OpenShift's
SecurityContextConstraints) have no schema there: their shape is checked here,
and every metric an alert or the dashboard uses must be one the agent exports.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from nodeagent.config import Config, config_from_mapping, parse_address
from nodeagent.loop.exporters import metrics_exporter
from tests.kustomize_render import (
    BASE,
    CRD_KINDS,
    DEPLOY,
    HOLD,
    HOLD_COMPONENT,
    HOLD_OPENSHIFT,
    OPENSHIFT,
    REPO,
    rendered,
)

# What the hold adds to the base's capabilities, and nothing else.
HOLD_CAPS = ["SYS_ADMIN", "SYS_PTRACE"]
OPERATIONS = REPO / "docs" / "operations.md"
# What the issue asks the rules to cover, by alert name.
ALERTS = {
    "NodeagentPeermemGateHeldWhileMofedReady",
    "NodeagentStorageChainBlockingMofed",
    "NodeagentVFsDegraded",
    "NodeagentNotReconciling",
    "NodeagentModuleLoadFailed",
}
# /etc/modprobe.d: the storage guard's default policy "hold" writes its hold file there.
WRITTEN_HOST_PATHS = {
    "/run/nodeagent",
    "/var/lib/nodeagent",
    "/etc/modprobe.d",
    "/etc/kubernetes/node-feature-discovery/features.d",  # [labels] nfd: its one file
}


def by_kind(docs: tuple[dict[str, Any], ...], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"one {kind}, got {len(found)}"
    return found[0]


def exported_metric_names() -> set[str]:
    """What the daemon exports: the exporter as the daemon builds it (the guards' series and
    what their host sides declare: the hold's)."""
    exp = metrics_exporter(Config(mode="observe"))
    names: set[str] = set()
    for fam in exp.registry.collect():
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
        names |= {fam.name + s for s in suffixes.get(fam.type, ("",))}
    return names


def metric_names_in(expr: str) -> set[str]:
    return set(re.findall(r"\bnodeagent_[a-z0-9_]+", expr))


@pytest.mark.parametrize(
    "directory",
    [BASE, OPENSHIFT, HOLD, HOLD_OPENSHIFT],
    ids=["base", "openshift", "peermem-hold", "peermem-hold-openshift"],
)
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
    # deploy/helm: the chart's own files (tests/test_helm.py renders them); its files/
    # are links to these directories
    chart = DEPLOY / "helm"
    files = {
        f.resolve()
        for f in DEPLOY.rglob("*")
        if f.is_file() and f.name != "README.md" and chart not in f.parents
    }
    assert files - used == set(), "files no kustomization uses"


def test_the_configmap_holds_a_config_the_agent_accepts() -> None:
    data = tomllib.loads((BASE / "agent.toml").read_text())
    cfg = config_from_mapping(data)
    assert cfg.mode == "observe", "installs observing; enforce is a deliberate switch"


def daemonset_container(docs: tuple[dict[str, Any], ...]) -> tuple[dict[str, Any], Any]:
    ds = by_kind(docs, "DaemonSet")
    spec = ds["spec"]["template"]["spec"]
    (container,) = [c for c in spec["containers"] if c["name"] == ds["metadata"]["name"]]
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
    # The agent's endpoint stays on loopback (its default): nothing in the pod moves it.
    assert "NODEAGENT_METRICS_ADDRESS" not in env and "ports" not in c
    assert "metrics_address" not in tomllib.loads(agent_config(rendered(BASE)))
    host, port = parse_address(Config().metrics_address)
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        get = c[probe]["httpGet"]
        assert (get["host"], get["port"], get["path"]) == (host, port, path)
    assert c["resources"]["limits"]["memory"] and c["resources"]["requests"]["memory"]
    assert c["args"][:2] == ["supervise", "run"]  # an agent crash is not a pod death


def test_servicemonitor_scrapes_the_service() -> None:
    docs = rendered(BASE)
    svc, sm = by_kind(docs, "Service"), by_kind(docs, "ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    labels = svc["metadata"]["labels"]
    assert sm["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ports = {p["name"] for p in svc["spec"]["ports"]}
    for ep in sm["spec"]["endpoints"]:
        assert ep["port"] in ports and ep["path"] == "/metrics"
        assert ep["scheme"] == "https" and ep["bearerTokenFile"].endswith("/token")
    proxy = proxy_container(docs)
    assert {p["name"] for p in proxy["ports"]} >= ports


def proxy_container(docs: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    spec = by_kind(docs, "DaemonSet")["spec"]["template"]["spec"]
    (proxy,) = [c for c in spec["containers"] if c["name"] == "kube-rbac-proxy"]
    return proxy


@pytest.mark.parametrize("directory", [BASE, OPENSHIFT, HOLD], ids=["base", "openshift", "hold"])
def test_metrics_reach_the_cluster_only_through_kube_rbac_proxy(directory: Path) -> None:
    """As kube-prometheus ships node-exporter: the agent on loopback, the proxy on the
    node's address with TLS, checking each scrape's token; only the proxy holds one."""
    docs = rendered(directory)
    spec, agent = daemonset_container(docs)
    proxy = proxy_container(docs)
    args = dict(a.split("=", 1) for a in proxy["args"])
    host, port = parse_address(Config().metrics_address)
    assert host == "127.0.0.1", "the agent's own default is loopback"
    assert args["--upstream"] == f"http://{host}:{port}/"
    assert args["--secure-listen-address"] == f"[$(IP)]:{port}"
    assert args["--allow-paths"] == "/metrics"
    assert args["--tls-min-version"] == "VersionTLS12"
    env = {e["name"]: e for e in proxy["env"]}
    assert env["IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    sc = proxy["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    # The token: projected into the proxy alone; the pod mounts none.
    assert spec["automountServiceAccountToken"] is False
    token_dir = "/var/run/secrets/kubernetes.io/serviceaccount"
    (mount,) = [m for m in proxy["volumeMounts"] if m["mountPath"] == token_dir]
    volumes = {v["name"]: v for v in spec["volumes"]}
    sources = volumes[mount["name"]]["projected"]["sources"]
    assert any("serviceAccountToken" in src for src in sources)
    assert not any(m["name"] == mount["name"] for m in agent["volumeMounts"])
    roles = [d for d in docs if d["kind"] == "ClusterRole"
             and d["metadata"]["name"] == "nodeagent-kube-rbac-proxy"]  # fmt: skip
    (role,) = roles
    assert role["rules"] == [
        {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"],
         "verbs": ["create"]},
        {"apiGroups": ["authorization.k8s.io"], "resources": ["subjectaccessreviews"],
         "verbs": ["create"]},
    ]  # fmt: skip


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
    (role,) = [d for d in docs if d["kind"] == "ClusterRole"
               and d["metadata"]["name"] != "nodeagent-kube-rbac-proxy"]  # fmt: skip
    assert role["rules"] == [
        {
            "apiGroups": ["security.openshift.io"],
            "resources": ["securitycontextconstraints"],
            "resourceNames": [scc["metadata"]["name"]],
            "verbs": ["use"],
        }
    ]
    (binding,) = [d for d in docs if d["kind"] == "ClusterRoleBinding"
                  and d["roleRef"]["name"] == role["metadata"]["name"]]  # fmt: skip
    (subject,) = binding["subjects"]
    assert (subject["name"], subject["namespace"]) == ("nodeagent", "nodeagent")


# -- the opt-in peermem hold (deploy/components/peermem-hold) ----------------------


def agent_config(docs: tuple[dict[str, Any], ...]) -> str:
    """The agent.toml the DaemonSet mounts (by the name its config volume refers to)."""
    spec, _ = daemonset_container(docs)
    (name,) = [v["configMap"]["name"] for v in spec["volumes"] if v["name"] == "config"]
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == name]
    assert name.startswith("nodeagent-config-"), "generated, with its content hash"
    assert set(cm["data"]) == {"agent.toml"}
    text: str = cm["data"]["agent.toml"]
    return text


@pytest.mark.parametrize("directory", [BASE, OPENSHIFT], ids=["base", "openshift"])
def test_the_shipped_default_grants_no_hold_privileges(directory: Path) -> None:
    docs = rendered(directory)
    spec, c = daemonset_container(docs)
    assert spec["hostPID"] is False
    added = set(c["securityContext"]["capabilities"]["add"])
    assert added.isdisjoint(HOLD_CAPS)
    assert agent_config(docs) == (BASE / "agent.toml").read_text()
    assert "hold_loads" not in tomllib.loads(agent_config(docs)).get("peermem", {})


@pytest.mark.parametrize(
    ("plain", "with_hold"), [(BASE, HOLD), (OPENSHIFT, HOLD_OPENSHIFT)], ids=["base", "openshift"]
)
def test_the_hold_component_adds_host_pids_two_capabilities_and_a_grace_only(
    plain: Path, with_hold: Path
) -> None:
    before, after = by_kind(rendered(plain), "DaemonSet"), by_kind(rendered(with_hold), "DaemonSet")
    spec, c = daemonset_container(rendered(with_hold))
    assert spec["hostPID"] is True, "the hold names openers by host pid, and finds containers"
    sc = c["securityContext"]
    base_caps = daemonset_container(rendered(plain))[1]["securityContext"]["capabilities"]["add"]
    assert sc["capabilities"]["add"] == [*base_caps, *HOLD_CAPS], "the base's kept, two appended"
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["seccompProfile"]["type"] == "RuntimeDefault"
    assert not spec.get("hostIPC") and spec["automountServiceAccountToken"] is False

    # Nothing else differs: the plain DaemonSet with those changes is the hold's, but for
    # the config's name (its content hash changes with hold_loads).
    expected = copy.deepcopy(before)
    pod = expected["spec"]["template"]["spec"]
    pod["hostPID"] = True
    pod["containers"][0]["securityContext"]["capabilities"]["add"] += HOLD_CAPS
    # A stop with a load held drains up to the hold's budget (900 s): issue 52.
    assert spec["terminationGracePeriodSeconds"] == 930
    pod["terminationGracePeriodSeconds"] = 930
    (config,) = [v for v in pod["volumes"] if v["name"] == "config"]
    (hold_config,) = [v for v in spec["volumes"] if v["name"] == "config"]
    assert hold_config["configMap"]["name"] != config["configMap"]["name"]
    config["configMap"]["name"] = hold_config["configMap"]["name"]
    assert after == expected


@pytest.mark.parametrize("directory", [HOLD, HOLD_OPENSHIFT], ids=["base", "openshift"])
def test_the_hold_config_is_the_base_config_plus_hold_loads(directory: Path) -> None:
    text = agent_config(rendered(directory))
    assert text == (HOLD_COMPONENT / "agent.toml").read_text()
    data = tomllib.loads(text)
    expected = tomllib.loads((BASE / "agent.toml").read_text())
    expected.setdefault("peermem", {})["hold_loads"] = "fanotify"
    assert data == expected, "the base's settings, every one, plus hold_loads"
    cfg = config_from_mapping(data)
    assert cfg.policy("peermem").hold_loads == "fanotify"
    assert cfg.mode == "observe", "as the base: enforce is a deliberate switch"


def test_the_hold_openshift_scc_allows_exactly_what_the_daemonset_asks() -> None:
    docs = rendered(HOLD_OPENSHIFT)
    scc = by_kind(docs, "SecurityContextConstraints")
    spec, c = daemonset_container(docs)
    sc = c["securityContext"]
    assert sorted(scc["allowedCapabilities"]) == sorted(sc["capabilities"]["add"])
    assert scc["allowHostPID"] is spec["hostPID"] is True
    assert scc["requiredDropCapabilities"] == ["ALL"]
    assert scc["allowPrivilegedContainer"] is False and scc["allowPrivilegeEscalation"] is False
    assert scc["allowHostIPC"] is False and scc["readOnlyRootFilesystem"] is True
    # The same SCC as the openshift overlay's but for host PIDs, the two capabilities and
    # its description; the openshift overlay's own SCC is not widened.
    plain = by_kind(rendered(OPENSHIFT), "SecurityContextConstraints")
    assert plain["allowHostPID"] is False
    assert not set(HOLD_CAPS) & set(plain["allowedCapabilities"])
    expected = copy.deepcopy(plain)
    expected["allowHostPID"] = True
    expected["allowedCapabilities"] += HOLD_CAPS
    description = "kubernetes.io/description"
    assert "hostPID" in scc["metadata"]["annotations"][description]
    expected["metadata"]["annotations"][description] = scc["metadata"]["annotations"][description]
    assert scc == expected
    # Everything else the openshift overlay renders is there unchanged.
    others = [
        d
        for d in rendered(OPENSHIFT)
        if d["kind"] not in ("DaemonSet", "ConfigMap", "SecurityContextConstraints")
    ]
    for d in others:
        assert d in docs, f"{d['kind']} {d['metadata']['name']}"


# -- node-problem-detector: deploy/npd, a component for NPD's own manifests ----------------

NPD_COMPONENT = DEPLOY / "npd"
# The shape of NPD's deployment/node-problem-detector.yaml (written here, not copied):
# the container's command, a ConfigMap at /config, hostPath volumes.
NPD_DAEMONSET = {
    "apiVersion": "apps/v1",
    "kind": "DaemonSet",
    "metadata": {"name": "node-problem-detector", "namespace": "kube-system"},
    "spec": {
        "selector": {"matchLabels": {"app": "node-problem-detector"}},
        "template": {
            "metadata": {"labels": {"app": "node-problem-detector"}},
            "spec": {
                "containers": [
                    {
                        "name": "node-problem-detector",
                        "image": "registry.k8s.io/node-problem-detector/node-problem-detector",
                        "command": [
                            "/node-problem-detector",
                            "--logtostderr",
                            "--config.system-log-monitor=/config/kernel-monitor.json",
                        ],
                        "volumeMounts": [{"name": "config", "mountPath": "/config"}],
                    }
                ],
                "volumes": [
                    {"name": "config", "configMap": {"name": "node-problem-detector-config"}}
                ],
            },
        },
    },
}


def test_the_npd_component_mounts_the_agents_files_and_adds_the_monitor(tmp_path: Path) -> None:
    import kubernetes_validate

    (tmp_path / "npd.yaml").write_text(yaml.safe_dump(NPD_DAEMONSET))
    (tmp_path / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "namespace": "kube-system",
                "resources": ["npd.yaml"],
                "components": [os.path.relpath(NPD_COMPONENT, tmp_path)],
            }
        )
    )
    docs = rendered(tmp_path)
    for doc in docs:
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
    spec, c = daemonset_container(docs)
    assert (
        "--config.custom-plugin-monitor=/opt/nodeagent-npd/nodeagent-monitor.json" in c["command"]
    )
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert mounts["/run/nodeagent"]["readOnly"] is True, "NPD only reads the agent's files"
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes[mounts["/run/nodeagent"]["name"]]["hostPath"]["path"] == "/run/nodeagent"
    cm_volume = volumes[mounts["/opt/nodeagent-npd"]["name"]]["configMap"]
    assert cm_volume["defaultMode"] == 0o555, "the plugin must be executable"
    cm = by_kind(docs, "ConfigMap")
    assert cm["metadata"]["name"] == cm_volume["name"]
    assert cm["data"]["nodeagent-npd-check"] == (NPD_COMPONENT / "nodeagent-npd-check").read_text()
    monitor = json.loads(cm["data"]["nodeagent-monitor.json"])
    assert {r["path"] for r in monitor["rules"]} == {"/opt/nodeagent-npd/nodeagent-npd-check"}
