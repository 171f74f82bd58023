"""A real Prometheus (Debian's ``prometheus`` package) scrapes the running agent on loopback.

The agent runs as a user starts it (``python -m nodeagent run``, observe mode,
metrics on 127.0.0.1) on a healthy simulated node. MOFED's ready flag is
removed and the gate closes; Prometheus, started with a generated config that
scrapes the agent every second, must then show ``nodeagent_guard_ok{guard="peermem"}``
at 0 through its query API; the flag is created again and the same query must
turn 1, with the gate's state gauge and the MOFED condition following, and a
range query over the test's span holding the 0s followed by the 1s. Skipped,
with the reason, where Prometheus cannot be had (see tests/prometheus_setup.py).
Waits are bounded deadlines for correctness, never assertions on speed.
"""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest

from nodeagent.sim.node import READY
from tests.healthy import healthy_node
from tests.prometheus_setup import SetupError, ensure
from tests.waiting import WAIT

JOB = "nodeagent"
GATE_OK = 'nodeagent_guard_ok{guard="peermem"}'
# The gate's verdict word (open/closed/rebuild) and the condition that holds it.
GATE_OPEN = 'nodeagent_guard_state{guard="peermem",state="open"}'
GATE_CLOSED = 'nodeagent_guard_state{guard="peermem",state="closed"}'
FLAG_HOLDING = 'nodeagent_peermem_condition_holding{condition="mofed_ready_flag"}'
MOFED_READY = "nodeagent_peermem_mofed_ready"
DEADLINE = 60.0  # seconds, for each wait: a correctness bound, not a speed check
POLL = 0.2
STEP = 0.5  # the range query's resolution, seconds: finer than the scrapes
# Loopback only, and no proxy from the environment between the test and either server.
HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))

T = TypeVar("T")


def free_ports(n: int) -> list[int]:
    """n distinct free ports on 127.0.0.1 (all bound at once, then let go)."""
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def get(url: str) -> str | None:
    """The body, or None while the server is not (yet) answering."""
    try:
        with HTTP.open(url, timeout=WAIT) as r:
            body: bytes = r.read()
    except (urllib.error.URLError, OSError):
        return None
    return body.decode()


def log_tail(path: Path, lines: int = 15) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return f"--- {path.name} ---\n" + "\n".join(text.splitlines()[-lines:])


class Bench:
    """The two processes and their logs, for waits that fail fast when one dies."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, argv: list[str]) -> None:
        with (self.tmp / f"{name}.log").open("wb") as log:
            self.procs[name] = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )

    def logs(self) -> str:
        return "\n".join(log_tail(self.tmp / f"{name}.log") for name in self.procs)

    def until(self, probe: Callable[[], T | None], what: str) -> T:
        deadline = time.monotonic() + DEADLINE
        while True:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    pytest.fail(f"{name} exited ({proc.returncode}) {what}\n{self.logs()}")
            got = probe()
            if got is not None:
                return got
            if time.monotonic() > deadline:
                pytest.fail(f"no {what} within {DEADLINE:.0f}s\n{self.logs()}")
            time.sleep(POLL)

    def stop(self) -> None:
        for proc in reversed(self.procs.values()):
            if proc.poll() is None:
                proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


@contextmanager
def bench(tmp_path: Path) -> Iterator[Bench]:
    b = Bench(tmp_path)
    try:
        yield b
    finally:
        b.stop()


class Prom:
    """Prometheus's HTTP query API."""

    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}/api/v1/"

    def api(self, endpoint: str, **params: str) -> Any:
        body = get(self.base + endpoint + "?" + urllib.parse.urlencode(params))
        if body is None:
            return None
        reply = json.loads(body)
        assert reply["status"] == "success", reply
        return reply["data"]

    def value(self, expr: str) -> float | None:
        """The one series' value now, None when there is none (yet)."""
        data = self.api("query", query=expr)
        if not data or not data["result"]:
            return None
        (series,) = data["result"]
        return float(series["value"][1])

    def reads(self, expr: str, want: float) -> Callable[[], bool | None]:
        return lambda: True if self.value(expr) == want else None

    def values(self, *exprs: str) -> dict[str, float] | None:
        """Each series' value now; None while one has none (a scrape that timed out on a
        busy machine leaves them all stale until the next one)."""
        got = {expr: self.value(expr) for expr in exprs}
        return None if None in got.values() else got  # type: ignore[return-value]


def config(agent_port: int) -> str:
    """prometheus.yml (JSON is YAML): the agent alone, every second, nothing remote."""
    return json.dumps(
        {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
            "scrape_configs": [
                {
                    "job_name": JOB,
                    "static_configs": [{"targets": [f"127.0.0.1:{agent_port}"]}],
                }
            ],
        },
        indent=2,
    )


def test_prometheus_sees_the_peermem_gate_close_and_open(tmp_path: Path) -> None:
    try:
        prometheus = ensure()
    except SetupError as err:
        pytest.skip(str(err))
    root = tmp_path / "node"
    healthy_node(root).kernel.uevent_source.close()
    agent_port, prom_port = free_ports(2)
    metrics = f"http://127.0.0.1:{agent_port}/metrics"
    (tmp_path / "prometheus.yml").write_text(config(agent_port))
    prom = Prom(prom_port)
    span_start = time.time()

    with bench(tmp_path) as b:
        b.start(
            "agent",
            [sys.executable, "-m", "nodeagent", "run", "--host-root", str(root),
             "--mode", "observe", "--metrics-address", f"127.0.0.1:{agent_port}"],
        )  # fmt: skip
        b.until(lambda: get(metrics), "agent /metrics")
        # MOFED restarts: its ready flag goes, and the agent closes the gate.
        (root / READY).unlink()
        b.until(
            lambda: True if f"{GATE_OK} 0.0\n" in (get(metrics) or "") else None,
            "closed gate on the agent's /metrics",
        )

        b.start(
            "prometheus",
            [prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{prom_port}",
             "--log.level=warn"],
        )  # fmt: skip
        b.until(prom.reads(f'up{{job="{JOB}"}}', 1.0), "target up in Prometheus")
        b.until(prom.reads(GATE_OK, 0.0), f"{GATE_OK} == 0 in Prometheus")
        closed = b.until(lambda: prom.values(GATE_OPEN, GATE_CLOSED, FLAG_HOLDING, MOFED_READY),
                         "the gate's series in Prometheus")  # fmt: skip
        assert closed == {GATE_OPEN: 0.0, GATE_CLOSED: 1.0, FLAG_HOLDING: 1.0, MOFED_READY: 0.0}

        # MOFED is ready again: the flag reappears and the gate opens.
        (root / READY).touch()
        b.until(prom.reads(GATE_OK, 1.0), f"{GATE_OK} == 1 in Prometheus")
        b.until(prom.reads(GATE_OPEN, 1.0), f"{GATE_OPEN} == 1 in Prometheus")
        opened = b.until(lambda: prom.values(GATE_CLOSED, FLAG_HOLDING, MOFED_READY),
                         "the gate's series in Prometheus")  # fmt: skip
        assert opened == {GATE_CLOSED: 0.0, FLAG_HOLDING: 0.0, MOFED_READY: 1.0}

        # Steps counted back from now, so the last one sees the newest sample.
        end = time.time()
        start = end - STEP * math.ceil((end - span_start) / STEP)
        data = prom.api(
            "query_range", query=GATE_OK, start=f"{start:.3f}", end=f"{end:.3f}", step=str(STEP)
        )
        assert data is not None and data["resultType"] == "matrix", data
        (series,) = data["result"]
        assert series["metric"]["job"] == JOB
        values = [float(v) for _, v in series["values"]]
        # Closed from the first scrape until the flag came back, then open: 0s, then 1s.
        assert set(values) == {0.0, 1.0}, values
        assert values == sorted(values), values
