"""deploy/helm/nodeagent: rendered and linted with real Helm (the helm-python-sdk package
embeds the Helm v4 library: no binary), every object validated against the Kubernetes
schemas of the oldest and newest version the chart supports, the values schema's
refusals, and no drift from the kustomize base it is made from (object by object).

helm-python-sdk is young (0.2.x, one maintainer): it is used here only; the chart is a
plain chart the helm CLI installs."""

from __future__ import annotations

import copy
import tomllib
from pathlib import Path
from typing import Any

import pytest

from nodeagent.config import config_from_mapping
from tests.helm_render import (
    CHART,
    HOLD_ON,
    TOGGLES,
    agent_toml,
    allowing_unset_image,
    chart,
    helm,
    notes,
    one,
    render,
)
from tests.kustomize_render import BASE, CRD_KINDS, HOLD, HOLD_OPENSHIFT, OPENSHIFT, rendered

# The oldest and newest Kubernetes the chart supports (Chart.yaml's kubeVersion), both
# known to kubernetes-validate.
KUBE_VERSIONS = ("1.25", "1.37")
# What Helm adds to every object's labels, and kustomize's config hash: left out of the
# comparison with the kustomize render.
HELM_LABELS = {
    "app.kubernetes.io/instance",
    "app.kubernetes.io/version",
    "app.kubernetes.io/managed-by",
    "helm.sh/chart",
}


@pytest.mark.parametrize("kube", KUBE_VERSIONS)
def test_the_chart_lints_clean(kube: str) -> None:
    for values in TOGGLES.values():
        # helm lint logs a template's fail and goes on: the unset image's refusal
        # does not fail it (tests/test_chart_install.py)
        report = helm.lint(str(CHART), values, strict=True, kube_version=f"v{kube}.0")
        assert report["errors"] == [] and report["messages"] == [], (values, report)


@pytest.mark.parametrize("kube", KUBE_VERSIONS)
@pytest.mark.parametrize("toggle", TOGGLES)
def test_every_rendered_object_validates_against_kubernetes(kube: str, toggle: str) -> None:
    import kubernetes_validate

    docs = render(TOGGLES[toggle])
    assert {"ServiceAccount", "ConfigMap", "DaemonSet"} <= {d["kind"] for d in docs}
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            continue  # kubernetes-validate knows no CRDs (tests/test_deploy.py shape-checks)
        kubernetes_validate.validate(doc, kube, strict=True)


@pytest.mark.parametrize("toggle", TOGGLES)
def test_the_config_file_is_one_the_agent_accepts(toggle: str) -> None:
    config_from_mapping(agent_toml(render(TOGGLES[toggle])))


def test_each_guards_switch_reaches_agent_toml_and_the_agent() -> None:
    """Issue 54: agent.<guard>.enabled (auto by default, as the kustomize base)."""
    default = config_from_mapping(agent_toml(render()))
    assert [default.policies[g].enabled for g in ("peermem", "storage", "sriov")] == ["auto"] * 3
    switched = agent_toml(render(TOGGLES["guards switched"]))
    assert switched["peermem"] == {"enabled": False, "mofed": "none"}
    assert switched["storage"] == {"enabled": True}
    assert switched["sriov"]["enabled"] is False
    cfg = config_from_mapping(switched)
    assert [cfg.policies[g].enabled for g in ("peermem", "storage", "sriov")] == [
        False, True, False,
    ]  # fmt: skip


def test_the_default_render_follows_the_operators_conventions() -> None:
    docs = render()
    ds = one(docs, "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    assert pod["priorityClassName"] == "system-node-critical"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    assert ds["spec"]["updateStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 1},
    }
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    keys = {e["key"] for t in terms["nodeSelectorTerms"] for e in t["matchExpressions"]}
    assert "feature.node.kubernetes.io/pci-10de.present" in keys, "NFD's PCI label: GPU nodes"
    assert "feature.node.kubernetes.io/pci-15b3.present" in keys, "and Mellanox NICs"
    # least privilege as the base: no hostPID, two capabilities, observe
    assert pod["hostPID"] is False
    assert pod["containers"][0]["securityContext"]["capabilities"]["add"] == [
        "SYS_MODULE",
        "NET_ADMIN",
    ]
    assert agent_toml(docs)["mode"] == "observe"
    assert all(d["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm" for d in docs)
    text = notes()
    assert "observe mode" in text and "nodeagent status" in text and "agent.mode=enforce" in text


def test_the_toggles_do_what_they_say() -> None:
    hold = render(HOLD_ON)
    pod = one(hold, "DaemonSet")["spec"]["template"]["spec"]
    assert pod["hostPID"] is True
    assert pod["containers"][0]["securityContext"]["capabilities"]["add"][-2:] == [
        "SYS_ADMIN",
        "SYS_PTRACE",
    ]
    assert agent_toml(hold)["peermem"]["hold_loads"] == "fanotify"
    # A stop drains a held load up to the hold's budget: the grace follows it (issue 52).
    assert pod["terminationGracePeriodSeconds"] == 930
    budget = {
        **HOLD_ON,
        "agent": {"mode": "enforce", "extraConfig": {"peermem": {"hold_budget_seconds": 300}}},
    }
    short = one(render(budget), "DaemonSet")["spec"]["template"]["spec"]
    assert short["terminationGracePeriodSeconds"] == 330
    plain = one(render(), "DaemonSet")["spec"]["template"]["spec"]
    assert plain["terminationGracePeriodSeconds"] == 30
    assert "The peermem hold is on" in notes(HOLD_ON)
    scc = one(render(TOGGLES["openshift+hold"]), "SecurityContextConstraints")
    assert scc["allowHostPID"] is True and "SYS_PTRACE" in scc["allowedCapabilities"]
    bare = render(TOGGLES["no metrics"])
    kinds = {d["kind"] for d in bare}
    assert not kinds & {"Service", "ServiceMonitor", "ClusterRole"}
    containers = one(bare, "DaemonSet")["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["nodeagent"]
    port = render(TOGGLES["numvfs by the agent, another port"])
    agent = one(port, "DaemonSet")["spec"]["template"]["spec"]["containers"][0]
    assert agent["livenessProbe"]["httpGet"]["port"] == 9818
    assert agent_toml(port)["metrics_address"] == "127.0.0.1:9818"
    (sys_mount,) = [m for m in agent["volumeMounts"] if m["name"] == "sys"]
    assert sys_mount["readOnly"] is False, "numvfs_owner agent writes sriov_numvfs"
    custom = one(render(TOGGLES["daemonset settings"]), "DaemonSet")
    assert custom["spec"]["updateStrategy"] == {"type": "OnDelete"}
    assert custom["spec"]["template"]["spec"]["nodeSelector"] == {
        "nvidia.com/gpu.deploy.nodeagent": "true"
    }
    assert custom["spec"]["template"]["spec"]["containers"][0]["image"] == (
        "registry.example/nodeagent:0.1.1"
    )
    assert one(render(TOGGLES["extraObjects"]), "ConfigMap", "x")["data"] == {}
    extra = {"agent": {"extraConfig": {"storage": {"policy": "unload"}}}}
    assert agent_toml(render(extra))["storage"] == {"enabled": "auto", "policy": "unload"}


BAD_VALUES: list[tuple[dict[str, Any], str]] = [
    ({"agent": {"mode": "enforcing"}}, "/agent/mode"),
    ({"hold": {"enabled": True}}, "/agent/mode"),  # the hold needs enforce
    ({"agent": {"resyncSeconds": 0}}, "/agent/resyncSeconds"),
    ({"agent": {"sriov": {"numvfsOwner": "nobody"}}}, "/agent/sriov/numvfsOwner"),
    ({"metrics": {"port": 80}}, "/metrics/port"),
    ({"daemonsets": {"updateStrategy": "Recreate"}}, "/daemonsets/updateStrategy"),
    ({"agentt": {"mode": "enforce"}}, "'agentt' not allowed"),  # a misspelt key
    ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
    ({"monitoring": {"apiAvailable": "yes"}}, "/monitoring/apiAvailable"),
    ({"serviceMonitor": {"token": "bearer"}}, "/serviceMonitor/token"),
    ({"prometheusRule": {"additionalLabels": {"release": 1}}}, "/prometheusRule/additionalLabels"),
]


@pytest.mark.parametrize(("values", "where"), BAD_VALUES)
def test_the_schema_refuses_bad_values_naming_the_key(values: dict[str, Any], where: str) -> None:
    with pytest.raises(helm.HelmValuesError) as err:
        chart().validate_schema(chart().merge_values(values))
    assert where in str(err.value)
    with pytest.raises(helm.HelmError):  # and an install's render refuses them too
        render(values)


# ---------------------------------------------------------------- no drift from kustomize


def normalized(doc: dict[str, Any]) -> dict[str, Any]:
    """What both renders must agree on: the objects' own labels, kustomize's config hash
    and the chart's checksum annotation taken off (a pod template's labels are kept)."""
    doc = copy.deepcopy(doc)
    labels = doc["metadata"].get("labels", {})
    # the chart labels every object; kustomize's `labels` reach only the base's (not
    # the OpenShift overlay's SCC and its RBAC)
    for key in (*HELM_LABELS, "app.kubernetes.io/name", "app.kubernetes.io/part-of"):
        labels.pop(key, None)
    if not labels:
        doc["metadata"].pop("labels", None)
    if doc["kind"] == "ConfigMap" and doc["metadata"]["name"].startswith("nodeagent-config"):
        doc["metadata"]["name"] = "nodeagent-config"
        doc["data"] = {"agent.toml": tomllib.loads(doc["data"]["agent.toml"])}
    if doc["kind"] == "DaemonSet":
        tmpl = doc["spec"]["template"]
        tmpl["metadata"].pop("annotations", None)
        for vol in tmpl["spec"]["volumes"]:
            if vol["name"] == "config":
                vol["configMap"]["name"] = "nodeagent-config"
    return doc


# kustomize directory, the chart's values that match it (the hold overlays install
# observing; the chart refuses the hold in observe, so it is compared in enforce with mode
# set back)
MATCHING = [
    pytest.param(BASE, TOGGLES["monitoring API"], id="base"),
    pytest.param(OPENSHIFT, TOGGLES["openshift"], id="openshift"),
    pytest.param(HOLD, TOGGLES["hold"], id="peermem-hold"),
    pytest.param(HOLD_OPENSHIFT, TOGGLES["openshift+hold"], id="hold-openshift"),
]


@pytest.mark.parametrize(("directory", "values"), MATCHING)
def test_the_chart_and_the_kustomize_render_are_the_same_objects(
    directory: Path, values: dict[str, Any]
) -> None:
    kustomized = {}
    for d in rendered(directory):
        if d["kind"] == "Namespace":
            continue  # Helm's convention: the release's namespace exists (README)
        n = normalized(d)
        kustomized[(n["kind"], n["metadata"]["name"])] = n
    charted = {}
    for d in render(values):
        if "helm.sh/hook" in d["metadata"].get("annotations", {}):
            continue  # helm test's objects (tests/test_chart_install.py)
        n = normalized(d)
        charted[(n["kind"], n["metadata"]["name"])] = n
    assert sorted(charted) == sorted(kustomized)
    for key, doc in kustomized.items():
        mine = charted[key]
        if key == ("ConfigMap", "nodeagent-config") and values.get("hold"):
            assert mine["data"]["agent.toml"].pop("mode") == "enforce"
            doc["data"]["agent.toml"].pop("mode")
        assert mine == doc, key


def test_the_packaged_chart_holds_the_copied_files_and_renders_the_same(tmp_path: Path) -> None:
    """The archive a repository serves holds files/' copies of deploy/: it is whole."""
    archive = helm.package(str(CHART), destination=str(tmp_path))
    packed = helm.Chart.load_archive(Path(archive).read_bytes())
    for values in (TOGGLES["defaults"], TOGGLES["openshift+hold"]):
        ours = packed.render(
            allowing_unset_image(values), name="nodeagent", namespace="nodeagent", is_install=True
        )
        assert ours == chart().render(
            allowing_unset_image(values), name="nodeagent", namespace="nodeagent", is_install=True
        )
    names = {f["name"] for f in packed.files}
    assert {"files/base/daemonset.yaml", "files/openshift/scc.yaml"} <= names
