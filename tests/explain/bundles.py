"""The operators' support bundles, built in the layouts their scripts write
(``explain/nodes.py`` cites each): ``test_explain_bundles.py``, ``test_kubectl_plugin.py``
and ``bench/explain.py`` build theirs with these."""

from __future__ import annotations

import gzip
import tarfile
from pathlib import Path
from typing import Any

EINVAL = "modprobe: ERROR: could not insert 'nvidia_peermem': Invalid argument"


DRIVER_POD_1 = "nvidia-driver-daemonset-7xk2p"


DRIVER_POD_2 = "nvidia-driver-daemonset-q9d4m"


def by_node(doc: dict[str, Any]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for inc in doc["incidents"]:
        out.setdefault(inc.get("node", ""), []).append(inc["kind"])
    return out


def write(root: Path, files: dict[str, bytes | str]) -> Path:
    for rel, body in files.items():
        f = root / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(body.encode() if isinstance(body, str) else body)
    return root


def tar(root: Path, out: Path, mode: str = "w:gz") -> Path:
    with tarfile.open(out, mode) as t:
        t.add(root, arcname=root.name)
    return out


def multistream_gzip(*sections: str) -> bytes:
    """nvidia-bug-report.sh appends each section with `gzip -c >>`: one gzip stream each."""
    return b"".join(gzip.compress(s.encode()) for s in sections)


def gpu_must_gather() -> dict[str, bytes | str]:
    """hack/must-gather.sh (v26.3+): flat; operand pods' logs with --all-containers
    --prefix --timestamps; the NODE column in gpu_operand_pods.status."""
    status = (
        "NAME                              READY   STATUS             RESTARTS   AGE   IP"
        "           NODE    NOMINATED NODE   READINESS GATES\n"
        f"{DRIVER_POD_1}     1/2     CrashLoopBackOff   7          1h    10.0.0.11"
        "    gpu-1   <none>           <none>\n"
        f"{DRIVER_POD_2}     1/2     CrashLoopBackOff   7          1h    10.0.0.12"
        "    gpu-2   <none>           <none>\n"
    )
    p1 = f"[pod/{DRIVER_POD_1}/"
    p2 = f"[pod/{DRIVER_POD_2}/"
    return {
        "must-gather.log": "+ kubectl get pods\n",
        "gpu_operand_pods.status": status,
        # a pod spec that quotes the words: YAML is not read
        "gpu_operand_pods.yaml": f"items:\n- metadata:\n    annotations:\n      x: {EINVAL}\n",
        # node gpu-1: k8s-driver-manager waits for MOFED, then the driver's load fails
        f"gpu_operand_pod_{DRIVER_POD_1}.log": (
            f'{p1}k8s-driver-manager] 2026-11-21T11:51:41.000000001Z time="2026-11-21T11:51:41Z"'
            ' level=info msg="Waiting for MOFED to be installed"\n'
            f"{p1}nvidia-driver-ctr] 2026-11-21T11:52:10.1Z Loading NVIDIA Peer Memory kernel "
            "module...\n"
            f"{p1}nvidia-driver-ctr] 2026-11-21T11:52:10.2Z {EINVAL}\n"
        ),
        f"gpu_operand_pod_{DRIVER_POD_1}.previous.log": "",
        # node gpu-2: the same failed load, with the kernel's reason in its bug report
        f"gpu_operand_pod_{DRIVER_POD_2}.log": (
            f"{p2}nvidia-driver-ctr] 2026-11-21T12:00:00.5Z {EINVAL}\n"
        ),
        "nvidia-bug-report_gpu-2.log.gz": multistream_gzip(
            "_" * 44 + "\n\n*** /proc/modules\nnvidia 1 0 - Live\n",
            "_" * 44 + "\n\ndmesg:\n\n"
            "[Fri Nov 21 12:00:00 2026] nvidia_peermem: disagrees about version of symbol "
            "ib_register_peer_memory_client\n"
            "[Fri Nov 21 12:00:00 2026] nvidia_peermem: Unknown symbol "
            "ib_register_peer_memory_client (err -22)\n",
        ),
    }


def many_nodes(nodes: int, lines: int) -> dict[str, bytes | str]:
    """A must-gather of ``nodes`` nodes, each driver pod's log ``lines`` failed loads of
    4 KB (the adversarial pass's shape: a ~1 MB bundle, 400 nodes, 378 MB peak); bench/explain.py
    builds its bundle with it too."""
    row = "{:<32}{:<8}{:<19}{:<11}{:<6}{:<11}{:<12}{:<17}{}"
    status = [row.format("NAME", "READY", "STATUS", "RESTARTS", "AGE", "IP", "NODE",
                         "NOMINATED NODE", "READINESS GATES")]  # fmt: skip
    files: dict[str, bytes | str] = {}
    for n in range(nodes):
        pod = f"nvidia-driver-daemonset-{n:05d}"
        status.append(
            row.format(pod, "1/2", "CrashLoopBackOff", "7", "1h", "10.0.0.1", f"gpu-{n:04d}",
                       "<none>", "<none>")
        )  # fmt: skip
        pre = f"[pod/{pod}/nvidia-driver-ctr] 2026-11-21T12:00:00.5Z {EINVAL} "
        files[f"gpu_operand_pod_{pod}.log"] = "".join(
            f"{pre}{i:06d} {'x' * 3900}\n" for i in range(lines)
        )
    files["gpu_operand_pods.status"] = "\n".join(status) + "\n"
    return files
