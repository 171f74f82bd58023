"""The metrics endpoint bounds bytes, not only connections (issue 37).

``http.server`` keeps up to 100 header lines of 64 KiB per request: 32 connections that
each sent 99 header lines of 65,000 bytes and never the blank line took the agent from
30 to 139 MiB (213 MiB here) and a 128 MiB memory cgroup OOM-killed it. The endpoint now
reads every request through its own bounded reader: a line of at most
``MAX_LINE_BYTES``, at most ``MAX_HEADERS`` headers and ``MAX_REQUEST_BYTES`` in all;
past them ``414``/``431`` and the connection closed.

The status tests run the real ``MetricsServer`` in this process; the memory test runs it
in a process of its own (so the flood's client threads are not in the figure) and
samples that process's RSS with psutil while 40 fat and 8 slow-and-fat clients go at it.
The same flood against the real agent in a real 128 MiB memory cgroup:
``tests/realkernel/test_endpoint_memcg_real.py``.
"""

from __future__ import annotations

import contextlib
import platform
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from nodeagent import metrics_server as m
from nodeagent.metrics_server import MetricsServer
from tests.endpoint_flood import FAT_LINE, FAT_LINES, Flood, exporter, free_port, get, scraped
from tests.waiting import WAIT, until

REPO = Path(__file__).resolve().parent.parent
MIB = 2**20


@pytest.fixture
def server() -> Iterator[MetricsServer]:
    s = MetricsServer(exporter(), f"127.0.0.1:{free_port()}")
    try:
        yield s
    finally:
        s.close()


def exchange(port: int, data: bytes) -> tuple[int, bytes, bool]:
    """Send ``data`` (as much as the server takes), read the answer to its end: the status,
    the header block, and whether the server closed the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as c:
        # Closed while we sent: its answer is still there to read.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            c.sendall(data)
        got = b""
        closed = False
        while True:
            try:
                chunk = c.recv(65536)
            except ConnectionResetError:
                closed = True
                break
            if not chunk:
                closed = True
                break
            got += chunk
    head = got.split(b"\r\n\r\n", 1)[0]
    status = int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/") else 0
    return status, head, closed


def request(target: bytes = b"/healthz", headers: list[bytes] | None = None) -> bytes:
    lines = [b"GET " + target + b" HTTP/1.1", b"Host: 127.0.0.1", *(headers or [])]
    return b"\r\n".join(lines) + b"\r\n\r\n"


# -- each cap: the right status and a closed connection ------------------------------------


def test_an_oversize_request_line_is_414_and_closed(server: MetricsServer) -> None:
    status, head, closed = exchange(server.port, request(b"/" + b"a" * m.MAX_LINE_BYTES))
    assert (status, closed) == (414, True), head
    assert b"Connection: close" in head


def test_a_request_line_at_the_cap_is_read(server: MetricsServer) -> None:
    # "GET " + target + " HTTP/1.1\r\n" is exactly MAX_LINE_BYTES: the target is read whole.
    target = b"/healthz?" + b"a" * (m.MAX_LINE_BYTES - len(b"GET  HTTP/1.1\r\n/healthz?"))
    status, head, closed = exchange(server.port, request(target))
    assert status in (200, 503) and closed, head


def test_an_oversize_header_line_is_431_and_closed(server: MetricsServer) -> None:
    fat = b"X-Fat: " + b"a" * m.MAX_LINE_BYTES
    status, head, closed = exchange(server.port, request(headers=[fat]))
    assert (status, closed) == (431, True), head
    assert b"Connection: close" in head


def test_too_many_headers_is_431_and_closed(server: MetricsServer) -> None:
    many = [b"X-H%d: v" % i for i in range(m.MAX_HEADERS)]  # with Host: one too many
    status, head, closed = exchange(server.port, request(headers=many))
    assert (status, closed) == (431, True), head
    status, head, _ = exchange(server.port, request(headers=many[1:]))  # exactly the cap
    assert status in (200, 503), head


def test_a_request_over_the_total_is_431_and_closed(server: MetricsServer) -> None:
    # Each line under its cap, the count under its cap, the sum over MAX_REQUEST_BYTES.
    line = b"X-Big: " + b"a" * (m.MAX_LINE_BYTES - 16)
    n = m.MAX_REQUEST_BYTES // len(line) + 1
    assert n < m.MAX_HEADERS
    status, head, closed = exchange(server.port, request(headers=[line] * n))
    assert (status, closed) == (431, True), head
    status, head, _ = exchange(server.port, request(headers=[line] * (n - 2)))  # under it
    assert status in (200, 503), head


def test_a_fat_client_that_never_ends_its_headers_is_answered_431(server: MetricsServer) -> None:
    """The finding's client: 99 lines of 65,000 bytes, no blank line. It is cut at the
    first line (the server reads MAX_LINE_BYTES of it, not 6 MB)."""
    status, head, closed = exchange(server.port, b"GET /metrics HTTP/1.1\r\n" + FAT_LINE * 99)
    assert (status, closed) == (431, True), head


def test_the_listening_socket_keeps_a_small_receive_buffer(server: MetricsServer) -> None:
    """Unread input of a fat client sits in the kernel (charged to the pod's cgroup):
    accepted connections inherit the listener's SO_RCVBUF (the kernel doubles it)."""
    rcvbuf = server._httpd.socket.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
    assert rcvbuf <= 2 * m.MAX_REQUEST_BYTES


# -- a flood of fat and slow clients ---------------------------------------------------------

SERVE = """
import sys
from tests.endpoint_flood import exporter
from nodeagent.metrics_server import MetricsServer
s = MetricsServer(exporter(), "127.0.0.1:" + sys.argv[1])
print("serving", flush=True)
sys.stdin.read()  # until the test closes it
"""


def test_memory_stays_flat_under_a_flood_of_fat_and_slow_clients() -> None:
    """40 fat clients (each trying to send 99 x 65,000 bytes of headers, ~6.4 MB, again
    and again) and 8 slow ones, against a process serving the endpoint: its RSS grows by
    less than 8 MiB (before: +184 MiB for 32 such clients), a scrape and /healthz are
    answered during the flood and after it."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE, str(port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=REPO,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "serving"
        agent = psutil.Process(proc.pid)
        # Warm every path once (a scrape, a probe, a refusal) before the baseline.
        assert scraped(port)
        assert get(port, "/healthz")[0] == 200
        assert exchange(port, b"GET / HTTP/1.1\r\n" + FAT_LINE)[0] == 431
        baseline = agent.memory_info().rss
        peak = [baseline]
        sampling = threading.Event()

        def sample() -> None:
            while not sampling.is_set():
                peak[0] = max(peak[0], agent.memory_info().rss)
                sampling.wait(0.005)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        fat = 40
        with Flood(port, fat=fat, slow=8) as flood:
            # Until every fat client has tried to send a whole request's worth (~6 MB).
            until(
                lambda: flood.attempted >= fat * FAT_LINES * len(FAT_LINE),
                "the fat clients trying to send ~6 MB each",
                timeout=10 * WAIT,
            )
            assert scraped(port), "a scrape during the flood"
            assert get(port, "/healthz")[0] == 200, "/healthz during the flood"
            during = flood.connections
        sampling.set()
        sampler.join(WAIT)
        assert proc.poll() is None
        assert scraped(port), "a scrape after the flood"
        assert get(port, "/healthz")[0] == 200
        grew = (peak[0] - baseline) / MIB
        print(
            f"RSS {baseline / MIB:.1f} MiB before, peak {peak[0] / MIB:.1f} MiB "
            f"(+{grew:.1f}) under {during} connections, {flood.attempted / MIB:.0f} MiB "
            f"of headers tried"
        )
        assert grew < 8, f"RSS grew {grew:.1f} MiB under the flood"
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(WAIT)


def _switches(tid: int) -> int:
    for line in Path(f"/proc/self/task/{tid}/status").read_text().splitlines():
        if line.startswith("voluntary_ctxt_switches:"):
            return int(line.split()[1])
    raise AssertionError("no voluntary_ctxt_switches")


# poll, select, epoll_wait, pselect6, ppoll, epoll_pwait, epoll_pwait2, by architecture
WAIT_SYSCALLS = {
    "x86_64": {"7", "23", "232", "270", "271", "281", "441"},
    "aarch64": {"22", "72", "73", "441"},
}.get(platform.machine(), set())


def _waiting_in_selector(tid: int) -> bool:
    try:
        first = Path(f"/proc/self/task/{tid}/syscall").read_text().split()[0]
    except (OSError, IndexError):
        return False
    return first in WAIT_SYSCALLS


def test_the_server_sleeps_while_nobody_connects_and_wakes_for_a_scrape(
    server: MetricsServer,
) -> None:
    """No poll: ``serve_forever`` woke every 0.5 s (three wakes in 1.5 s) on every node for
    its life; the thread now sleeps until a connection or ``close``. A scrape still wakes
    it, and ``close`` returns a sleeping server at once (the fixture's)."""
    tid = server._thread.native_id
    assert tid is not None
    urllib.request.urlopen(f"http://127.0.0.1:{server.port}/healthz", timeout=WAIT).read()
    # The response read, the thread may still be closing the connection (or waiting for
    # the GIL: a switch too): counted from when it is back in its selector's wait.
    until(lambda: _waiting_in_selector(tid), "the server never went back to its wait")
    before = _switches(tid)
    done = threading.Event()
    done.wait(1.5)  # a window to count wakes in: nothing else happens in it
    assert _switches(tid) == before
    body = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/healthz", timeout=WAIT).read()
    assert body and _switches(tid) > before
