"""``kubectl nodeagent``: the executable ``kubectl-nodeagent`` the package installs (a kubectl
plugin once on PATH, e.g. ``pip install`` of this repository).

  kubectl nodeagent status|timeline NODE [-n NAMESPACE] [-- ARGS...]
finds the agent's pod on NODE (label app.kubernetes.io/name=nodeagent, fieldSelector
spec.nodeName=NODE) and runs the agent's own CLI in it;
  kubectl nodeagent explain BUNDLE... [-- ARGS...]
runs ``nodeagent explain`` here, on a must-gather, a sosreport or logs: a bundle is read
where it was saved, no cluster needed. No shell: each command is an argv."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

COMMANDS = ("status", "timeline")
# A node's name is a DNS-1123 subdomain.
DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
USAGE = (
    "usage: kubectl nodeagent status|timeline NODE [-n NAMESPACE] [-- ARGS...]\n"
    "       kubectl nodeagent explain BUNDLE... [-- ARGS...]"
)


def fail(message: str) -> int:
    print(f"kubectl-nodeagent: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    if argv[:1] == ["explain"]:
        # Offline: the agent's own explain, in this process (no kubectl, no node).
        from nodeagent.cli import main as nodeagent_main

        return nodeagent_main([a for a in argv if a != "--"])
    extra: list[str] = []
    if "--" in argv:
        extra = argv[argv.index("--") + 1 :]
        argv = argv[: argv.index("--")]
    namespace = os.environ.get("NODEAGENT_NAMESPACE", "nodeagent")
    if len(argv) == 4 and argv[2] in ("-n", "--namespace"):
        namespace = argv[3]
        argv = argv[:2]
    if len(argv) != 2 or argv[0] not in COMMANDS:
        print(USAGE, file=sys.stderr)
        return 2
    command, node = argv
    if len(node) > 253 or not DNS1123.match(node):
        return fail(f"not a node name (DNS-1123): {node!r}")
    if len(namespace) > 63 or not DNS1123.match(namespace) or "." in namespace:
        return fail(f"not a namespace name: {namespace!r}")
    found = subprocess.run(
        [
            "kubectl", "get", "pods", "-n", namespace,
            "-l", "app.kubernetes.io/name=nodeagent",
            "--field-selector", f"spec.nodeName={node}",
            "-o", "json",
        ],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if found.returncode != 0:
        sys.stderr.write(found.stderr)
        return found.returncode
    pods = [
        pod["metadata"]["name"]
        for pod in json.loads(found.stdout).get("items", [])
        if pod.get("status", {}).get("phase") == "Running"
    ]
    if len(pods) != 1:
        return fail(f"{len(pods)} running nodeagent pods on {node} in {namespace}, want 1")
    exec_argv = ["kubectl", "exec", "-n", namespace, pods[0], "-c", "nodeagent", "--"]
    return subprocess.run([*exec_argv, "nodeagent", command, *extra], check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
