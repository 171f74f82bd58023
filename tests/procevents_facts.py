"""Print the kernel's answers that ``nodeagent/host/procevents.py`` relies on (needs root).

    .venv/bin/python tests/procevents_facts.py
    .venv/bin/python -m tests.realkernel.vm .venv/bin/python tests/procevents_facts.py  # 6.1

Not a test: the raw answers behind the facts in ``docs/design.md`` ("The container
scan wakes on exec"); ``tests/test_procevents.py`` asserts what the agent needs of them.
"""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nodeagent.host.procevents import (
    CN_IDX_PROC,
    NETLINK_CONNECTOR,
    PROC_CN_MCAST_LISTEN,
    PROC_EVENT_EXEC,
    ConnectorRefused,
    ExecEvents,
    _request,
    parse,
)

SUBSCRIBE = (
    "import sys; sys.path.insert(0, sys.argv[1])\n"
    "from nodeagent.host.procevents import ExecEvents, ConnectorRefused\n"
    "try:\n    ExecEvents(ack_timeout_s=1).close(); print('subscribed', flush=True)\n"
    "except ConnectorRefused as e:\n    print('refused:', e, flush=True)\n"
)


def drain(s: socket.socket) -> list[tuple[str, int, int, int]]:
    """(what, cn ack, value, cn seq) of each event queued."""
    s.setblocking(False)
    out = []
    while True:
        try:
            d = s.recv(8192)
        except BlockingIOError:
            return out
        seq = struct.unpack_from("=I", d, 24)[0]
        out.extend((hex(what), ack, value, seq) for what, ack, value in parse(d))


def main() -> None:
    print("kernel", os.uname().release)
    root = str(Path(__file__).resolve().parent.parent)
    s = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_CONNECTOR)
    s.bind((0, CN_IDX_PROC))
    s.sendto(_request(PROC_CN_MCAST_LISTEN, 100), (0, 0))
    time.sleep(0.05)
    print("4-byte LISTEN, ack field 100 -> (what, ack, err, seq):", drain(s))
    s.sendto(_request(PROC_CN_MCAST_LISTEN, 200, event_mask=PROC_EVENT_EXEC), (0, 0))
    subprocess.run(["/bin/true"])
    time.sleep(0.05)
    print("8-byte LISTEN(EXEC) then one /bin/true -> (what, ack, value, seq):", drain(s))
    s.close()
    for prefix in (
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"],
        ["unshare", "--user", "--map-root-user"],
        ["unshare", "--pid", "--fork"],
        ["unshare", "--net"],
    ):
        p = subprocess.run([*prefix, sys.executable, "-c", SUBSCRIBE, root], capture_output=True)
        print(" ".join(prefix), "->", (p.stdout + p.stderr).decode(errors="replace").strip())
    try:
        ev = ExecEvents()
    except ConnectorRefused as exc:
        print("refused here:", exc)
        return
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "procexec-script"
        script.write_text("#!/bin/sh\nread x\n")
        script.chmod(0o755)
        c = subprocess.Popen([str(script), "init"], stdin=subprocess.PIPE)
        time.sleep(0.3)
        pids, _lost = ev.read()
        cmd = Path(f"/proc/{c.pid}/cmdline").read_bytes()
        print(f"a #! script: {pids.count(c.pid)} exec event(s) for its pid, cmdline then {cmd!r}")
        c.communicate(b"\n")
    ev.close()


if __name__ == "__main__":
    main()
