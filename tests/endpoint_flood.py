"""A flood of fat and slow clients against a metrics endpoint, and a scrape of it:
``test_endpoint_bounds.py`` floods the server in a process of its own,
``realkernel/test_endpoint_memcg_real.py`` the real agent in a 128 MiB memory cgroup."""

from __future__ import annotations

import socket
import threading
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from nodeagent import metrics_server as m
from nodeagent.agent import build_reconciler
from nodeagent.config import Config
from nodeagent.metrics import MetricsExporter
from tests.waiting import WAIT

FAT_LINE = b"X-Fat: " + b"a" * (65_000 - 9) + b"\r\n"  # 65,000 bytes, as in the finding


FAT_LINES = 99  # ~6.4 MB of headers a connection: http.server's own cap is 100 lines


def free_port() -> int:
    with socket.socket() as s:  # the address parser refuses port 0
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def exporter() -> MetricsExporter:
    return MetricsExporter(build_reconciler(Config()).guards, mode="observe", liveness_seconds=60)


class Flood:
    """``fat`` clients that each try to send ``FAT_LINES`` x 65,000 bytes of headers (a
    reconnect each time the server cuts them off) and ``slow`` clients that send lines
    just under the caps a few at a time, holding their connection to its deadline."""

    def __init__(self, port: int, fat: int, slow: int) -> None:
        self.port = port
        self.stop = threading.Event()
        self.attempted = 0  # header bytes the fat clients tried to send (sendall called)
        self.connections = 0
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._fat, daemon=True) for _ in range(fat)]
        self.threads += [threading.Thread(target=self._slow, daemon=True) for _ in range(slow)]

    def _count(self, connections: int = 0, attempted: int = 0) -> None:
        with self.lock:
            self.connections += connections
            self.attempted += attempted

    def _fat(self) -> None:
        while not self.stop.is_set():
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=2) as c:
                    self._count(connections=1)
                    c.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
                    for _ in range(FAT_LINES):
                        self._count(attempted=len(FAT_LINE))
                        c.sendall(FAT_LINE)
                        if self.stop.is_set():
                            break
            except OSError:
                pass  # cut off (431, reset, a send past the deadline): go again

    def _slow(self) -> None:
        line = b"X-Slow: " + b"s" * (m.MAX_LINE_BYTES - 12) + b"\r\n"
        while not self.stop.is_set():
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=2) as c:
                    self._count(connections=1)
                    c.sendall(b"GET /metrics HTTP/1.1\r\n")
                    while not self.stop.wait(0.2):  # ~3 lines of 4 KiB, then a line a beat
                        c.sendall(line[:1024])
            except OSError:
                pass

    def __enter__(self) -> Flood:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(WAIT)


def get(port: int, path: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=WAIT) as r:
        return r.status, r.read()


def scraped(port: int) -> bool:
    status, body = get(port, "/metrics")
    names = {f.name for f in text_string_to_metric_families(body.decode())}
    return status == 200 and "nodeagent_build_info" in names
