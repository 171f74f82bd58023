"""Support bundles for ``nodeagent explain``: which files are logs, and which node each is
about. Pure: given paths (relative to the bundle's top) and the text of a few small
files, it answers; ``walk.py`` walks a directory or a tar and feeds it.

The layouts, from the scripts that write them (docs/operations.md cites each):

- the GPU Operator's must-gather (``hack/must-gather.sh``): flat;
  ``gpu_operand_pod_<pod>.log`` and ``.previous.log`` hold every container of a pod,
  each line ``[pod/<pod>/<container>] <time> <message>``; the node of a pod is in
  ``gpu_operand_pods.status`` (``kubectl get pods -o wide``: a NODE column) or the
  pod's ``.descr`` (``Node: <node>/<ip>``); ``nvidia-bug-report_<node>.log.gz`` and
  ``gpu_device_usage_<node>.log`` name theirs. Under ``oc adm must-gather`` the same
  files sit one or two directories down.
- the Network Operator's sosreport (``kubectl netop-sosreport``, v26.1+):
  ``operator/components/<component>/pods/<pod>-<container>[-previous].log`` beside
  ``<pod>.yaml`` (``nodeName:``), ``ofed-driver/diagnostics/<node>-<what>.txt``.
- ``oc adm inspect``: ``namespaces/<ns>/pods/<pod>/<ctr>/<ctr>/logs/current.log``
  and ``previous.log`` beside ``pods/<pod>/<pod>.yaml``; the default must-gather's
  ``nodes/<node>/dmesg`` and ``<node>_logs_kubelet.gz``.
- a node's own sos report (``sos_commands/kernel/dmesg``, ``sos_commands/logs/
  journalctl_--no-pager``, ``var/log/messages``): one node, named by its ``hostname``
  file.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

# Files read for no evidence: object dumps and reports (a YAML dump holds the pods'
# specs, not their logs), checksums, archives inside the bundle.
_NOT_LOGS = (
    ".yaml",
    ".yml",
    ".json",
    ".html",
    ".sha256",
    ".descr",
    ".status",
    ".labels",
    ".list",
    ".tgz",
    ".tar",
    ".zip",
    ".png",
)
# The small files the node map is made from (read whole, bounded, before the logs).
MAP_FILE_MAX = 4 << 20
_NETOP_DIAG = (
    "diagnostic_status",
    "kernel_version",
    "infiniband_sysfs",
    "ibv_devinfo",
    "mst_status",
    "rdma_dev",
    "rdma_link",
    "devlink_dev",
    "devlink_info",
    "devlink_port",
    "ip_link",
    "ip_addr",
    "ibstat",
    "lsmod",
    "dmesg",
)
_NETOP_DIAG_FILE = re.compile(r"(?:^|/)diagnostics/(.+)-(?:" + "|".join(_NETOP_DIAG) + r")\.txt$")
_NODE_NAMED = (
    re.compile(r"(?:^|/)nvidia-bug-report_([^/]+)\.log(?:\.gz)?$"),  # GPU must-gather
    re.compile(r"(?:^|/)gpu_device_usage_([^/]+)\.log$"),
    re.compile(r"(?:^|/)nodes/([^/]+)/[^/]+$"),  # oc adm must-gather (gather_ppc)
    re.compile(r"(?:^|/)([^/]+)_logs_kubelet(?:\.gz)?$"),
)
_GPU_POD_LOG = re.compile(r"(?:^|/)gpu_operand_pod_(.+?)(?:\.previous)?\.log$")
_INSPECT_LOG = re.compile(r"^(.*?pods/)([^/]+)/([^/]+)/\3/logs/[^/]+$")
_NETOP_POD_LOG = re.compile(r"(?:^|/)(.*?pods/)([^/]+)\.log$")
_NODE_NAME_YAML = re.compile(r"(?m)^\s*nodeName:\s*['\"]?([\w.-]+)")
_DESCR_NODE = re.compile(r"(?m)^Node:\s+([\w.-]+)")


def is_log(path: str) -> bool:
    """A file worth reading for evidence (``path``: inside the bundle)."""
    low = path.lower()
    return not low.endswith(_NOT_LOGS) and not low.rsplit("/", 1)[-1].startswith(".")


def is_map_file(path: str) -> bool:
    """A small file the node map is made from."""
    name = path.rsplit("/", 1)[-1]
    return (
        name in ("gpu_operand_pods.status", "hostname")
        or path.endswith("sos_commands/host/hostname")
        or (name.startswith("gpu_operand_pod_") and name.endswith(".descr"))
        or ("pods/" in path and path.endswith(".yaml"))
    )


@dataclass
class NodeMap:
    """Which node each file of one bundle is about, from its paths and map files."""

    pod_node: dict[str, str] = field(default_factory=dict)  # pod name -> node
    pod_yaml: dict[str, str] = field(default_factory=dict)  # "<dir>/<pod>" -> node
    host: str = ""  # a sos report's whole node
    yaml_dirs: set[str] = field(default_factory=set)  # "<dir>/<pod>" with a <pod>.yaml

    def learn(self, path: str, text: str) -> None:
        """``text``: a map file's content (``is_map_file``)."""
        name = path.rsplit("/", 1)[-1]
        if name == "gpu_operand_pods.status":
            self._pods_table(text)
        elif name == "hostname" or path.endswith("sos_commands/host/hostname"):
            first = text.strip().splitlines()[:1]
            if first and re.fullmatch(r"[\w.-]{1,253}", first[0].strip()):
                self.host = first[0].strip()
        elif name.endswith(".descr"):
            pod = name[len("gpu_operand_pod_") : -len(".descr")]
            m = _DESCR_NODE.search(text)
            if m:
                self.pod_node.setdefault(pod, m.group(1))
        elif name.endswith(".yaml"):
            key = path[: -len(".yaml")]
            self.yaml_dirs.add(key)
            m = _NODE_NAME_YAML.search(text)
            if m:
                self.pod_yaml[key] = m.group(1)
                self.pod_node.setdefault(key.rsplit("/", 1)[-1], m.group(1))

    def _pods_table(self, text: str) -> None:
        """``kubectl get pods -o wide``: columns aligned under their headers (a header
        may be two words: NOMINATED NODE), NAME and NODE read at their headers' offsets."""
        lines = text.splitlines()
        for i, header in enumerate(lines):
            name = re.search(r"(?<!\S)NAME(?!\S)", header)
            node = re.search(r"(?<!\S)NODE(?!\S)", header)
            if not (name and node):
                continue
            for row in lines[i + 1 :]:
                pod = row[name.start() :].split()[:1]
                where = row[node.start() :].split()[:1]
                if pod and where and row[node.start() - 1 : node.start()].isspace():
                    self.pod_node.setdefault(pod[0], where[0])
            return

    def node_of(self, path: str) -> str:
        """The node ``path`` is about, or "" when the bundle does not say."""
        for pattern in (_NETOP_DIAG_FILE, *_NODE_NAMED):
            m = pattern.search(path)
            if m:
                return m.group(1)
        m = _GPU_POD_LOG.search(path)
        if m:
            return self.pod_node.get(m.group(1), "")
        m = _INSPECT_LOG.search(path)
        if m:
            key = f"{m.group(1)}{m.group(2)}/{m.group(2)}"
            return self.pod_yaml.get(key, self.pod_node.get(m.group(2), ""))
        m = _NETOP_POD_LOG.search(path)
        if m:
            return self._netop_pod(m.group(1), m.group(2))
        return self.host

    def _netop_pod(self, directory: str, stem: str) -> str:
        """``<pod>-<container>[-previous]``: both hold '-'; the pod is the longest stem
        prefix with a ``<pod>.yaml`` beside the log."""
        cut = len(stem)
        while cut > 0:
            key = directory + stem[:cut]
            if key in self.yaml_dirs:
                return self.pod_yaml.get(key, "")
            cut = stem.rfind("-", 0, cut)
        return self.host


def bundle_kind(paths: Iterable[str]) -> str:
    """What wrote the bundle, for the report's first line."""
    seen = set()
    for p in paths:
        name = p.rsplit("/", 1)[-1]
        if name in ("gpu_operand_pods.status", "gpu_operator_pod.log", "must-gather.log"):
            seen.add("GPU Operator must-gather")
        elif p.endswith("metadata/collection-info.txt") or "/operator/components/" in f"/{p}":
            seen.add("Network Operator sosreport")
        elif "/logs/current.log" in p or "/logs/previous.log" in p:
            seen.add("oc adm inspect")
        elif "sos_commands/" in p:
            seen.add("sos report")
    return ", ".join(sorted(seen)) or "a directory of logs"
