"""deploy/helm/nodeagent as a new user installs it (issue 53): a chart with no symlinks (its
files/ are copies of deploy/'s, kept equal by scripts/sync-chart.sh), rendered from a
checkout that dropped every symlink, as Flux's Git source does (flux2#4088)."""

from __future__ import annotations

import dataclasses
import http.server
import json
import os
import shutil
import ssl
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.helm_render import (
    CHART,
    MONITORING_API,
    TOGGLES,
    agent_toml,
    allowing_unset_image,
    helm,
    notes,
    one,
    render,
)

ROOT = CHART.parent.parent.parent
DEPLOY = ROOT / "deploy"
# The chart's files/ directories and the deploy/ directory each copies from.
COPIED_FROM = {
    "base": "base",
    "openshift": "overlays/openshift",
    "hold-openshift": "components/peermem-hold-openshift",
    "npd": "npd",
}


def test_the_chart_holds_no_symlink() -> None:
    links = [p for p in CHART.rglob("*") if p.is_symlink()]
    assert links == [], "a Git source that drops symlinks breaks the chart: copy instead"


def test_every_copied_file_is_its_deploy_original() -> None:
    copies = [p for p in (CHART / "files").rglob("*") if p.is_file()]
    assert len(copies) >= 10
    for copy in copies:
        top, *rest = copy.relative_to(CHART / "files").parts
        original = DEPLOY / COPIED_FROM[top] / Path(*rest)
        assert copy.read_bytes() == original.read_bytes(), (
            f"{copy} differs from {original}: run scripts/sync-chart.sh"
        )
        assert copy.stat().st_mode == original.stat().st_mode, copy
    check = subprocess.run(["bash", str(ROOT / "scripts/sync-chart.sh"), "--check"], check=False)
    assert check.returncode == 0


def test_the_sync_check_names_a_stale_copy_and_the_sync_mends_it(tmp_path: Path) -> None:
    for part in ("scripts", "deploy"):
        shutil.copytree(ROOT / part, tmp_path / part)
    (tmp_path / "deploy/base/service.yaml").write_text("# edited\n")
    script = str(tmp_path / "scripts/sync-chart.sh")
    check = subprocess.run(["bash", script, "--check"], capture_output=True, text=True)
    assert check.returncode == 1
    assert "files/base/service.yaml differs from deploy/base/service.yaml" in check.stderr
    subprocess.run(["bash", script], check=True)
    copy = tmp_path / "deploy/helm/nodeagent/files/base/service.yaml"
    assert copy.read_text() == "# edited\n"
    assert subprocess.run(["bash", script, "--check"]).returncode == 0


def test_a_checkout_without_symlinks_renders_and_lints_the_same(tmp_path: Path) -> None:
    """As Flux would fetch it: the chart's directory with every symlink dropped."""
    copy = tmp_path / "nodeagent"
    shutil.copytree(CHART, copy, symlinks=True)
    for path in list(copy.rglob("*")):
        if path.is_symlink():
            os.unlink(path)
    ours, theirs = helm.Chart.load(str(copy)), helm.Chart.load(str(CHART))
    for values in TOGGLES.values():
        args = {"name": "nodeagent", "namespace": "nodeagent", "is_install": True}
        assert ours.render(allowing_unset_image(values), **args) == theirs.render(
            allowing_unset_image(values), **args
        )
    report = helm.lint(str(copy), {}, strict=True)
    assert report["errors"] == [] and report["messages"] == [], report


@pytest.mark.parametrize("values", [{}, TOGGLES["openshift+hold"]])
def test_the_chart_fails_naming_the_sync_when_a_copy_is_missing(
    tmp_path: Path, values: dict[str, object]
) -> None:
    copy = tmp_path / "nodeagent"
    shutil.copytree(CHART, copy)
    (copy / "files/base/daemonset.yaml").unlink()
    with pytest.raises(helm.HelmError, match=r"run scripts/sync-chart\.sh"):
        helm.Chart.load(str(copy)).render(
            allowing_unset_image(values), name="nodeagent", namespace="nodeagent"
        )


# ---------------------------------------------------------------- monitoring


def kinds(docs: list[dict[str, Any]]) -> set[str]:
    return {d["kind"] for d in docs}


def test_defaults_render_no_monitoring_object_where_the_api_is_absent() -> None:
    """helm install on a cluster without the Prometheus Operator: no ServiceMonitor to fail
    the install on its kind; the notes say why and how to scrape."""
    docs = render()
    assert not [d for d in docs if d["apiVersion"].startswith("monitoring.coreos.com/")]
    assert "ConfigMap" in kinds(docs) and "Service" in kinds(docs)
    assert "No ServiceMonitor or PrometheusRule" in notes()
    assert "No ServiceMonitor" not in notes(MONITORING_API)
    forced_off = {"monitoring": {"apiAvailable": False}}
    assert not kinds(render(forced_off)) & {"ServiceMonitor", "PrometheusRule"}
    assert {"ServiceMonitor", "PrometheusRule"} <= kinds(render(MONITORING_API))


def matches(selector: dict[str, str], obj: dict[str, Any]) -> bool:
    labels = obj["metadata"].get("labels", {})
    return all(labels.get(k) == v for k, v in selector.items())


def test_kube_prometheus_stacks_default_selectors_pick_the_objects_up() -> None:
    """kube-prometheus-stack's Prometheus selects ServiceMonitors and PrometheusRules with
    matchLabels {release: <its release>} (serviceMonitorSelectorNilUsesHelmValues)."""
    selector = {"release": "kps"}
    plain = render(MONITORING_API)
    assert not matches(selector, one(plain, "ServiceMonitor"))
    docs = render(TOGGLES["kube-prometheus-stack"])
    for kind in ("ServiceMonitor", "PrometheusRule"):
        obj = one(docs, kind)
        assert matches(selector, obj), kind
        assert obj["metadata"]["labels"]["app.kubernetes.io/name"] == "nodeagent"
    dashboard = one(docs, "ConfigMap", "nodeagent-grafana-dashboard")
    assert matches({"release": "kps", "grafana_dashboard": "1"}, dashboard)


def test_openshift_user_workload_monitoring_reads_the_token_from_a_secret() -> None:
    docs = render(TOGGLES["openshift user-workload monitoring"])
    (endpoint,) = one(docs, "ServiceMonitor")["spec"]["endpoints"]
    assert "bearerTokenFile" not in endpoint, "refused where file access is denied"
    credentials = endpoint["authorization"]["credentials"]
    assert endpoint["authorization"]["type"] == "Bearer"
    secret = one(docs, "Secret", credentials["name"])
    assert secret["type"] == "kubernetes.io/service-account-token"
    reader = secret["metadata"]["annotations"]["kubernetes.io/service-account.name"]
    assert one(docs, "ServiceAccount", reader)["automountServiceAccountToken"] is False
    role = one(docs, "ClusterRole", "nodeagent-metrics-reader")
    assert role["rules"] == [{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}]
    binding = one(docs, "ClusterRoleBinding", "nodeagent-metrics-reader")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": reader, "namespace": "nodeagent"}
    ]
    # where file access is allowed, Prometheus's own token file, and no Secret
    file_docs = render(MONITORING_API)
    (file_endpoint,) = one(file_docs, "ServiceMonitor")["spec"]["endpoints"]
    assert file_endpoint["bearerTokenFile"].endswith("serviceaccount/token")
    assert "Secret" not in kinds(file_docs)


# ---------------------------------------------------------------- agent.extraConfig's schema


def test_the_charts_extra_config_schema_is_the_one_the_field_tables_make() -> None:
    from nodeagent.config_schema import CHART_SCHEMA, agent_toml_schema

    checked_in = json.loads(CHART_SCHEMA.read_text())
    extra = checked_in["properties"]["agent"]["properties"]["extraConfig"]
    assert extra == agent_toml_schema(), (
        "values.schema.json is stale: python -m nodeagent.config_schema --chart"
    )


def test_the_schema_has_every_key_the_agent_reads() -> None:
    from nodeagent.config import Config
    from nodeagent.config_schema import TABLE_DATACLASSES, agent_toml_schema
    from nodeagent.guards.registry import GUARDS

    props = agent_toml_schema()["properties"]
    top = {f.name for f in dataclasses.fields(Config)} - {"policies"}
    assert set(props) == top | {g.name for g in GUARDS}
    for name, cls in TABLE_DATACLASSES.items():
        assert set(props[name]["properties"]) == {f.name for f in dataclasses.fields(cls)}


def bounds() -> list[tuple[str, str, dict[str, Any]]]:
    from nodeagent.config_schema import agent_toml_schema

    props = agent_toml_schema()["properties"]
    found = [("", k, s) for k, s in props.items() if "properties" not in s]
    for section, s in props.items():
        found += [(section, k, v) for k, v in s.get("properties", {}).items()]
    return found


def as_config(section: str, key: str, value: Any) -> dict[str, Any]:
    return {section: {key: value}} if section else {key: value}


@pytest.mark.parametrize(
    ("section", "key", "schema"),
    [b for b in bounds() if "enum" in b[2] or "minimum" in b[2]],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_each_bound_and_choice_is_the_agents(
    section: str, key: str, schema: dict[str, Any]
) -> None:
    """The schema refuses what the agent refuses, and no more: its ranges and choices are the
    agent's own (each checked at its edges against config_from_mapping)."""
    from nodeagent.config import config_from_mapping
    from nodeagent.errors import NodeagentError

    if "enum" in schema:
        good, bad = list(schema["enum"]), ["no-such-choice"]
    else:
        lo, hi = schema["minimum"], schema["maximum"]
        good = [lo, hi]
        step = 1 if schema["type"] == "integer" else min(lo / 2, 0.001) if lo else 0.001
        bad = [lo - step, hi + (1 if schema["type"] == "integer" else hi * 0.01)]
    for value in good:
        config_from_mapping(as_config(section, key, value))
    for value in bad:
        with pytest.raises(NodeagentError):
            config_from_mapping(as_config(section, key, value))


BAD_EXTRA_CONFIG = [
    ({"storage": {"policy": "unlod"}}, "/agent/extraConfig/storage/policy"),
    ({"storage": {"polcy": "unload"}}, "'polcy' not allowed"),
    ({"stroage": {"policy": "unload"}}, "'stroage' not allowed"),
    ({"peermem": {"hold_budget_seconds": 5000}}, "/agent/extraConfig/peermem/hold_budget_seconds"),
    ({"sriov": {"parallel": 1.5}}, "/agent/extraConfig/sriov/parallel"),
    ({"labels": {"nfd": "yes"}}, "/agent/extraConfig/labels/nfd"),
]


@pytest.mark.parametrize(("extra", "where"), BAD_EXTRA_CONFIG)
def test_a_bad_extra_config_key_or_value_is_refused_at_render_naming_it(
    extra: dict[str, Any], where: str
) -> None:
    with pytest.raises(helm.HelmError) as err:
        render({"agent": {"extraConfig": extra}})
    assert where in str(err.value)


def test_a_good_extra_config_renders_as_the_agent_reads_it() -> None:
    """Helm reads values' numbers as floats: a whole-number key (sriov.parallel) must reach
    agent.toml as 4, not 4.0, which the agent refuses."""
    extra = {
        "storage": {"policy": "hold", "modules": ["nvme_rdma"], "reload": False},
        "peermem": {"hold_budget_seconds": 300, "load_params": []},
        "sriov": {"parallel": 4},
        "timeline_keep": 5,
    }
    from nodeagent.config import config_from_mapping

    docs = render({"agent": {"extraConfig": extra}})
    config_from_mapping(agent_toml(docs))
    assert agent_toml(docs)["sriov"]["parallel"] == 4
    assert agent_toml(docs)["storage"]["policy"] == "hold"


# ---------------------------------------------------------------- names, images, pod metadata


def test_name_overrides_rename_every_object_and_every_reference() -> None:
    docs = render(TOGGLES["names, digests, pod metadata"])
    full, name = "gpu-node-agent", "gpu-agent"
    for doc in docs:
        assert not doc["metadata"]["name"].startswith("nodeagent"), doc["metadata"]["name"]
        assert doc["metadata"]["labels"]["app.kubernetes.io/name"] == name, doc["kind"]
    ds = one(docs, "DaemonSet", full)
    pod = ds["spec"]["template"]
    assert ds["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": name}
    assert pod["metadata"]["labels"]["app.kubernetes.io/name"] == name, "podLabels lose here"
    assert pod["metadata"]["labels"]["team"] == "gpu"
    assert pod["metadata"]["annotations"]["example.com/owner"] == "gpu"
    assert "checksum/config" in pod["metadata"]["annotations"]
    one(docs, "ServiceAccount", pod["spec"]["serviceAccountName"])
    (config,) = [v for v in pod["spec"]["volumes"] if v["name"] == "config"]
    one(docs, "ConfigMap", config["configMap"]["name"])
    assert one(docs, "Service", full)["spec"]["selector"] == {"app.kubernetes.io/name": name}
    sm = one(docs, "ServiceMonitor", full)
    assert sm["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": name}
    one(docs, "Secret", sm["spec"]["endpoints"][0]["authorization"]["credentials"]["name"])
    for binding in (d for d in docs if d["kind"] == "ClusterRoleBinding"):
        one(docs, "ClusterRole", binding["roleRef"]["name"])
        for subject in binding["subjects"]:
            one(docs, "ServiceAccount", subject["name"])
    (role,) = [
        d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == f"{full}-scc"
    ]
    assert role["rules"][0]["resourceNames"] == [full]
    one(docs, "SecurityContextConstraints", full)
    exprs = [r["expr"] for g in one(docs, "PrometheusRule")["spec"]["groups"] for r in g["rules"]]
    assert any(f'job="{full}"' in e for e in exprs) and not any(
        'job="nodeagent"' in e for e in exprs
    )
    text = notes(TOGGLES["names, digests, pod metadata"])
    assert f"app.kubernetes.io/name={name}" in text and f"daemonset/{full}" in text


def test_the_image_is_registry_repository_and_the_digest_wins_over_the_tag() -> None:
    containers = {
        c["name"]: c
        for c in one(render(TOGGLES["names, digests, pod metadata"]), "DaemonSet")["spec"][
            "template"
        ]["spec"]["containers"]
    }
    assert containers["nodeagent"]["image"] == (
        "registry.example:5000/ml/nodeagent@sha256:" + "a" * 64
    )
    assert containers["kube-rbac-proxy"]["image"] == "mirror.example/brancz/kube-rbac-proxy:v0.19.0"
    assert containers["kube-rbac-proxy"]["imagePullPolicy"] == "IfNotPresent"
    plain = one(render(), "DaemonSet")["spec"]["template"]["spec"]["containers"]
    assert plain[0]["image"] == "nodeagent:0.1.0", "the tag defaults to the chart's appVersion"
    assert plain[1]["image"] == "quay.io/brancz/kube-rbac-proxy:v0.19.1"
    no_tag = {"metrics": {"kubeRbacProxy": {"image": {"tag": ""}}}}
    with pytest.raises(helm.HelmError, match=r"metrics\.kubeRbacProxy\.image\.tag or"):
        render(no_tag)


BAD_NAMES_AND_IMAGES = [
    ({"image": {"digest": "sha256:abc"}}, "/image/digest"),
    ({"image": {"tag": "0.1.0@sha256:" + "a" * 64}}, "/image/tag"),
    ({"image": {"repository": "x/nodeagent:0.1.0"}}, "/image/repository"),
    ({"nameOverride": "Bad_Name"}, "/nameOverride"),
    ({"podLabels": {"team": 1}}, "/podLabels"),
    ({"metrics": {"kubeRbacProxy": {"image": "quay.io/x:1"}}}, "/metrics/kubeRbacProxy/image"),
]


@pytest.mark.parametrize(("values", "where"), BAD_NAMES_AND_IMAGES)
def test_bad_names_and_images_are_refused_naming_the_key(
    values: dict[str, Any], where: str
) -> None:
    with pytest.raises(helm.HelmError) as err:
        render(values)
    assert where in str(err.value)


# ---------------------------------------------------------------- the unpublished default image


def test_an_install_with_the_unpublished_default_image_fails_saying_what_to_set() -> None:
    """Not an ImagePullBackOff on every node: one line, what to set and how to build it."""
    for values in ({}, {"image": {"tag": "0.1.0"}}, {"image": {"digest": "sha256:" + "b" * 64}}):
        with pytest.raises(helm.HelmError) as err:
            helm.Chart.load(str(CHART)).render(values, name="nodeagent", namespace="nodeagent")
        message = str(err.value)
        assert "the image nodeagent is published nowhere" in message
        assert "build and push yours" in message and "image.registry=" in message
        assert "image.allowUnset=true" in message
    lint = helm.lint(str(CHART), {}, strict=True)  # lint logs a fail and goes on
    assert lint["errors"] == [] and lint["messages"] == [], lint
    for mine in (
        {"image": {"registry": "registry.example"}},
        {"image": {"repository": "registry.example/nodeagent"}},
        {"image": {"allowUnset": True}},
    ):
        helm.Chart.load(str(CHART)).render(mine, name="nodeagent", namespace="nodeagent")


# ---------------------------------------------------------------- helm test


def hook_objects(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["metadata"].get("annotations", {}).get("helm.sh/hook") == "test"]


def test_helm_test_reads_the_verdicts_through_the_proxy_with_a_token_allowed_metrics() -> None:
    docs = render()
    hooks = {(d["kind"], d["metadata"]["name"]): d for d in hook_objects(docs)}
    pod = hooks["Pod", "nodeagent-test"]
    assert hooks["ClusterRole", "nodeagent-test"]["rules"] == [
        {"nonResourceURLs": ["/metrics"], "verbs": ["get"]}
    ]
    binding = hooks["ClusterRoleBinding", "nodeagent-test"]
    assert binding["subjects"][0]["name"] == pod["spec"]["serviceAccountName"]
    assert ("ServiceAccount", pod["spec"]["serviceAccountName"]) in hooks
    (container,) = pod["spec"]["containers"]
    assert (
        container["image"]
        == one(docs, "DaemonSet")["spec"]["template"]["spec"]["containers"][0]["image"]
    )
    env = {e["name"]: e["value"] for e in container["env"]}
    # the headless Service's name: every node's proxy, on the metrics port
    assert env["METRICS_URL"] == "https://nodeagent.nodeagent.svc:9808/metrics"
    other = render({"metrics": {"port": 9818}, "fullnameOverride": "gpu"})
    (moved,) = [d for d in hook_objects(other) if d["kind"] == "Pod"]
    assert (
        moved["spec"]["containers"][0]["env"][0]["value"]
        == "https://gpu.nodeagent.svc:9818/metrics"
    )
    assert not hook_objects(render({"metrics": {"enabled": False}})), "no proxy, nothing to read"
    assert "helm test nodeagent -n nodeagent --logs" in notes()


class FakeProxy(http.server.BaseHTTPRequestHandler):
    """kube-rbac-proxy's answers: 401 without the token, /metrics only."""

    token = "t0ken"
    body = b""

    def do_GET(self) -> None:
        if self.headers.get("Authorization") != f"Bearer {self.token}":
            self.send_error(401)
        elif self.path != "/metrics":
            self.send_error(404)
        else:
            self.send_response(200)
            self.send_header("Content-Length", str(len(self.body)))
            self.end_headers()
            self.wfile.write(self.body)

    def log_message(self, *args: Any) -> None:
        pass


def run_helm_test_script(
    tmp_path: Path, body: bytes, token: str
) -> subprocess.CompletedProcess[str]:
    """The rendered pod's command, run here against a TLS server with a self-signed
    certificate (as the proxy's)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: no self-signed certificate to serve")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
         "-nodes", "-subj", "/CN=proxy", "-days", "1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    (tmp_path / "token").write_text(token + "\n")
    FakeProxy.body = body
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeProxy)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        (pod,) = [d for d in hook_objects(render()) if d["kind"] == "Pod"]
        command = pod["spec"]["containers"][0]["command"]
        assert command[:2] == ["python3", "-c"]
        env = {
            **os.environ,
            "METRICS_URL": f"https://127.0.0.1:{server.server_address[1]}/metrics",
            "TOKEN_FILE": str(tmp_path / "token"),
        }
        return subprocess.run(
            [sys.executable, "-c", command[2]], env=env, capture_output=True, text=True, timeout=60
        )
    finally:
        server.shutdown()
        server.server_close()


METRICS = b"""# HELP nodeagent_guard_ok 1 while the guard's verdict is ok
# TYPE nodeagent_guard_ok gauge
nodeagent_guard_ok{guard="peermem"} 1.0
nodeagent_guard_ok{guard="storage"} 0.0
nodeagent_up 1.0
"""


def test_the_helm_test_script_prints_the_verdicts(tmp_path: Path) -> None:
    done = run_helm_test_script(tmp_path, METRICS, FakeProxy.token)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[:2] == [
        'nodeagent_guard_ok{guard="peermem"} 1.0',
        'nodeagent_guard_ok{guard="storage"} 0.0',
    ]


def test_the_helm_test_script_fails_without_a_verdict_or_when_refused(tmp_path: Path) -> None:
    empty = run_helm_test_script(tmp_path, b"nodeagent_up 1.0\n", FakeProxy.token)
    assert empty.returncode == 1 and "no nodeagent_guard_ok" in empty.stderr
    refused = run_helm_test_script(tmp_path, METRICS, "wrong")
    assert refused.returncode == 1 and "401" in refused.stderr
