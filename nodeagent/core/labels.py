"""What the cluster sees of the node as labels: NFD's local source, no API credentials.

node-feature-discovery's worker reads every file in
``/etc/kubernetes/node-feature-discovery/features.d/`` (dot-files ignored,
so a file is written as one and renamed) and publishes each ``<ns>/<name>=<value>``
line as a node label (NFD's ``source/local``; validate.go: the key a qualified
name under a DNS-subdomain prefix, ``kubernetes.io`` denied except
``feature.node.kubernetes.io``; the value a label value of at most 63
characters). The set here is small and stable, one line per fact:

- ``nodeagent-peermem-gate``  ``open`` | ``closed`` | ``n-a``: the gate RDMA workloads wait
                              on (``n-a``: not applicable here, or turned off);
- ``nodeagent-<guard>-ok``    ``true`` | ``false``: each guard's ``ok``;
- ``nodeagent-gpudirect``     ``dmabuf`` | ``peermem`` | ``unknown``: which GPUDirect
                              RDMA path the node can take (core/gpudirect.py);
- ``nodeagent-vfs-restored``  ``true`` | ``false`` | ``n-a``: every SR-IOV PF stable or
                              restored (``n-a``: no PF here, or turned off).

A guard that does not apply (core/applicability.py) is ``ok``: its ``-ok`` label
is ``true``, as nothing there is wrong.

Each file carries ``# +expiry-time=``: an agent killed without its clean stop
leaves labels that NFD drops at its first re-discovery past that time, so a
stale ``ok`` does not outlive the agent by more than the expiry. Pure.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from nodeagent.core.applicability import WORDS as SHELVED
from nodeagent.core.guard import Verdict
from nodeagent.errors import NodeagentError

DEFAULT_PREFIX = "feature.node.kubernetes.io"
FILE_NAME = "nodeagent"  # in features.d; written as .nodeagent.tmp.<pid>, then renamed
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
_VALUE_BAD = re.compile(r"[^-A-Za-z0-9_.]+")
VALUE_MAX = 63


def check_prefix(key: str, prefix: object) -> str:
    """A label namespace NFD accepts: a DNS subdomain, not ``kubernetes.io``'s own (only
    ``feature.node.kubernetes.io`` and its subdomains are allowed there)."""
    if not isinstance(prefix, str) or not prefix:
        raise NodeagentError(f"config {key}: expected a DNS subdomain, got {prefix!r}")
    if len(prefix) > 253 or not all(_DNS_LABEL.fullmatch(p) for p in prefix.split(".")):
        raise NodeagentError(
            f"config {key}: {prefix[:80]!r} is not a DNS subdomain (lower-case letters, digits, "
            "'-' and '.', at most 253 characters)"
        )
    kube = prefix == "kubernetes.io" or prefix.endswith(".kubernetes.io")
    feature = prefix == DEFAULT_PREFIX or prefix.endswith(f".{DEFAULT_PREFIX}")
    if kube and not feature:
        raise NodeagentError(
            f"config {key}: {prefix!r} is under kubernetes.io, which NFD refuses "
            f"(except {DEFAULT_PREFIX})"
        )
    return prefix


def label_value(text: str) -> str:
    """Any text as a valid label value: runs of other characters become '-', at most 63,
    starting and ending alphanumeric; nothing left is ``unknown``."""
    value = _VALUE_BAD.sub("-", text)[:VALUE_MAX].strip("-_.")
    return value or "unknown"


NA = "n-a"  # a guard not applicable on this node, or turned off


def _shelved(v: Verdict) -> bool:
    return v.verdict in SHELVED


def _gpudirect(verdicts: Mapping[str, Verdict]) -> str:
    peermem = verdicts.get("peermem")
    gd = peermem.evidence.get("gpudirect") if peermem is not None else None
    capable = gd.get("dmabuf_capable") if isinstance(gd, Mapping) else None
    if capable is True:
        return "dmabuf"
    return "peermem" if capable is False else "unknown"


def node_labels(verdicts: Mapping[str, Verdict], prefix: str) -> dict[str, str]:
    """The label set, key -> value, for these verdicts."""
    labels: dict[str, str] = {}
    if "peermem" in verdicts:
        gate = "open" if verdicts["peermem"].ok else "closed"
        labels["nodeagent-peermem-gate"] = NA if _shelved(verdicts["peermem"]) else gate
        labels["nodeagent-gpudirect"] = _gpudirect(verdicts)
    for guard, verdict in verdicts.items():
        labels[f"nodeagent-{label_value(guard)}-ok"] = "true" if verdict.ok else "false"
    if "sriov" in verdicts:
        restored = verdicts["sriov"].verdict in ("stable", "restored")
        vfs = "true" if restored else "false"
        labels["nodeagent-vfs-restored"] = NA if _shelved(verdicts["sriov"]) else vfs
    out = {}
    for name, value in sorted(labels.items()):
        if not _NAME.fullmatch(name):  # a guard name that is no label name: left out
            continue
        out[f"{prefix}/{name}"] = label_value(value)
    return out


def features_file(labels: Mapping[str, str], expires: str) -> str:
    """The features.d file: a header, the expiry directive (``expires``: RFC 3339, UTC),
    one ``key=value`` per label."""
    lines = [
        "# Written by nodeagent; rewritten when a value changes, removed when it stops.",
        f"# +expiry-time={expires}",
        *(f"{k}={v}" for k, v in sorted(labels.items())),
    ]
    return "\n".join(lines) + "\n"


__all__ = [
    "DEFAULT_PREFIX",
    "FILE_NAME",
    "check_prefix",
    "features_file",
    "label_value",
    "node_labels",
]
