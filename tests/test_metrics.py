"""Metrics: ``nodeagent run`` serves /metrics, /healthz, /readyz; series follow the guards.

The acceptance test starts the agent as a user would (a ``nodeagent run``
process) on a temp host root prepared by the simulated kernel, scrapes it,
checks names and types, and watches the gate's series change when MOFED's
ready flag appears.
"""

from __future__ import annotations

import errno
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from nodeagent.agent import build_reconciler
from nodeagent.cli import main
from nodeagent.config import Config, load_config
from nodeagent.core.actions import ActionOutcome, LoadModuleFile, UnloadModule
from nodeagent.core.guard import Verdict
from nodeagent.core.telemetry import MetricFamily, RecordTelemetry, Sample
from nodeagent.errors import NodeagentError
from nodeagent.metrics import MetricsExporter, wake_source
from nodeagent.metrics_server import MetricsServer
from nodeagent.sim.node import READY, Node
from tests.metrics_scrape import Series, exporter_series, pass_result, value
from tests.waiting import WAIT, until

# name -> type, as Prometheus sees them (counters without the _total suffix).
EXPECTED_TYPES = {
    "nodeagent_build_info": "gauge",
    "nodeagent_guard_state": "gauge",
    "nodeagent_guard_ok": "gauge",
    "nodeagent_module_actions": "counter",
    "nodeagent_event_to_action_seconds": "histogram",
    "nodeagent_action_duration_seconds": "histogram",
    "nodeagent_passes": "counter",
    "nodeagent_pass_duration_seconds": "histogram",
    "nodeagent_wakeups": "counter",
    "nodeagent_last_pass_timestamp_seconds": "gauge",
    "nodeagent_seconds_since_last_pass": "gauge",
    "nodeagent_records": "counter",
    "nodeagent_process_resident_memory_bytes": "gauge",
    "nodeagent_process_cpu_seconds": "counter",
    "nodeagent_peermem_condition_holding": "gauge",
    "nodeagent_peermem_mofed_ready": "gauge",
    "nodeagent_peermem_load_failures": "gauge",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=WAIT) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:
        return 0, ""


def scrape(base: str) -> tuple[dict[str, str], Series]:
    status, text = get(base + "/metrics")
    assert status == 200
    types: dict[str, str] = {}
    series: Series = {}
    for fam in text_string_to_metric_families(text):
        types[fam.name] = fam.type
        for s in fam.samples:
            series[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return types, series


@pytest.fixture
def running(booting_node: Node, tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    port = free_port()
    cfg = tmp_path / "agent.toml"
    cfg.write_text("uevents = false\nresync_seconds = 30\n")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "nodeagent",
            "run",
            "--host-root",
            str(booting_node.root),
            "--config",
            str(cfg),
            "--metrics-address",
            f"127.0.0.1:{port}",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        until(lambda: get(base + "/readyz")[0] == 200, "the agent's first pass")
        yield base, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=WAIT)


def test_run_serves_metrics_and_the_gate_series_follow_the_ready_flag(
    booting_node: Node,
    running: tuple[str, subprocess.Popen[str]],
) -> None:
    base, proc = running
    types, series = scrape(base)
    for name, kind in EXPECTED_TYPES.items():
        assert types.get(name) == kind, f"{name}: {types.get(name)} (want {kind})"
    assert not [n for n in types if not n.startswith("nodeagent_")], "nodeagent_ prefix only"
    assert not [k for k in series if k[0].endswith("_created")], "_created series are off"

    # Closed: no ready flag yet, and the metrics say which condition holds it.
    assert value(series, "nodeagent_guard_state", guard="peermem", state="closed") == 1
    assert value(series, "nodeagent_guard_state", guard="peermem", state="open") == 0
    assert value(series, "nodeagent_guard_ok", guard="peermem") == 0
    holding = "nodeagent_peermem_condition_holding"
    assert value(series, holding, condition="mofed_ready_flag") == 1
    assert value(series, holding, condition="rdma_stack_live") == 0
    assert value(series, "nodeagent_peermem_mofed_ready") == 0
    assert value(series, "nodeagent_wakeups_total", source="start") == 1

    (booting_node.root / READY).write_text("")

    def gate_open() -> bool:
        return value(scrape(base)[1], "nodeagent_guard_ok", guard="peermem") == 1

    until(gate_open, "the peermem gate's series to say open")
    _, series = scrape(base)
    assert value(series, "nodeagent_guard_state", guard="peermem", state="open") == 1
    assert value(series, "nodeagent_guard_state", guard="peermem", state="closed") == 0
    assert value(series, holding, condition="mofed_ready_flag") == 0
    assert value(series, "nodeagent_peermem_mofed_ready") == 1
    assert (value(series, "nodeagent_wakeups_total", source="inotify") or 0) >= 1
    # Observe mode: the load is decided, counted, not performed.
    assert (
        value(
            series,
            "nodeagent_module_actions_total",
            guard="peermem",
            module="nvidia_peermem",
            action="load",
            result="not_performed",
        )
        == 1
    )
    assert (value(series, "nodeagent_process_resident_memory_bytes") or 0) > 1 << 20

    assert get(base + "/healthz")[0] == 200
    assert get(base + "/nope")[0] == 404
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=WAIT) == 0
    stderr = proc.stderr.read() if proc.stderr else ""
    # No journal under this host root: said once, and the records still reach stderr.
    assert stderr.count("journal socket") == 1, stderr
    assert '"kind": "decision"' in stderr


# -- the exporter on hand-made passes ----------------------------------------


class TrafficLight:
    """A made-up guard with its own verdict words and metric families."""

    name = "light"
    verdict_words = ("green", "amber", "red")
    metric_families = (
        MetricFamily("nodeagent_light_lamps", "gauge", "lamps lit", ("colour",)),
        MetricFamily("nodeagent_light_switches_total", "counter", "switches", ("pf",)),
        MetricFamily("nodeagent_light_switch_seconds", "histogram", "switch time", ("pf",)),
    )

    def metric_samples(self, verdict: Verdict, actions: Sequence[ActionOutcome]) -> list[Sample]:
        out = [Sample("nodeagent_light_lamps", {"colour": verdict.verdict}, 1)]
        for a in actions:
            out.append(Sample("nodeagent_light_switches_total", {"pf": "0000:3b:00.0"}, 1))
            out.append(
                Sample("nodeagent_light_switch_seconds", {"pf": "0000:3b:00.0"}, a.seconds or 0)
            )
        return out


def verdict(guard: str, word: str, ok: bool) -> Verdict:
    return Verdict(guard=guard, verdict=word, ok=ok, reasons=())


def test_a_guard_brings_its_own_words_and_families() -> None:
    exp = MetricsExporter({"light": TrafficLight()}, mode="enforce", liveness_seconds=60)
    s = exporter_series(exp)
    for word in ("green", "amber", "red"):
        assert value(s, "nodeagent_guard_state", guard="light", state=word) == 0
    assert not exp.ready()[0], "not ready before a pass"

    load = LoadModuleFile(guard="light", module="m", path="m.ko", params=(), reason="r")
    unload = UnloadModule(guard="light", module="m", reason="r")
    timing = {"finished_at": 100.25, "seconds": 0.125}
    outcomes = [
        ActionOutcome(load, ok=False, error="EINVAL", **timing),
        ActionOutcome(unload, ok=True, **timing),
    ]
    exp.on_pass(
        pass_result({"light": verdict("light", "amber", False)}, outcomes, ["inotify x", "z"]),
        None,
    )
    s = exporter_series(exp)
    assert value(s, "nodeagent_guard_state", guard="light", state="amber") == 1
    assert value(s, "nodeagent_guard_state", guard="light", state="green") == 0
    assert value(s, "nodeagent_light_lamps", colour="amber") == 1
    assert value(s, "nodeagent_light_switches_total", pf="0000:3b:00.0") == 2
    assert value(s, "nodeagent_light_switch_seconds_sum", pf="0000:3b:00.0") == 0.25
    labels = {"guard": "light", "module": "m"}
    assert value(s, "nodeagent_module_actions_total", action="load", result="failed", **labels)
    assert value(s, "nodeagent_module_actions_total", action="unload", result="ok", **labels)
    assert value(s, "nodeagent_event_to_action_seconds_sum", guard="light", action="load") == 0.25
    assert value(s, "nodeagent_wakeups_total", source="inotify") == 1
    assert value(s, "nodeagent_wakeups_total", source="other") == 1
    assert exp.ready()[0]

    # Gauges a guard declares are replaced each pass: the old colour's series goes.
    exp.on_pass(pass_result({"light": verdict("light", "green", True)}, [], ["resync"]), None)
    s = exporter_series(exp)
    assert value(s, "nodeagent_light_lamps", colour="amber") is None
    assert value(s, "nodeagent_light_lamps", colour="green") == 1
    assert value(s, "nodeagent_guard_ok", guard="light") == 1

    # A word the guard did not declare still gets a state, and is 0 once left.
    exp.on_pass(pass_result({"light": verdict("light", "flashing", False)}, [], []), None)
    exp.on_pass(pass_result({"light": verdict("light", "red", False)}, [], []), None)
    s = exporter_series(exp)
    assert value(s, "nodeagent_guard_state", guard="light", state="flashing") == 0
    assert value(s, "nodeagent_guard_state", guard="light", state="red") == 1
    assert value(s, "nodeagent_guard_state", guard="light", state="green") == 0


# A part fed by records (not a guard): a bell that rings and a queue that grows and shrinks.
RINGS = MetricFamily("nodeagent_bell_rings_total", "counter", "Rings, by bell", ("bell",))
QUEUE = MetricFamily("nodeagent_bell_queue", "gauge", "Callers waiting now")


def bell_samples(rec: Mapping[str, Any]) -> list[Sample]:
    kind = rec.get("kind")
    if kind == "bell-rung":
        return [Sample(RINGS.name, {"bell": str(rec["bell"])})]
    if kind in ("caller-came", "caller-left"):
        return [Sample(QUEUE.name, value=1.0 if kind == "caller-came" else -1.0)]
    return []


BELL = RecordTelemetry("bell", (RINGS, QUEUE), bell_samples)


def test_a_part_brings_its_own_families_fed_by_its_records() -> None:
    exp = MetricsExporter({}, mode="enforce", liveness_seconds=60, parts=(BELL,))
    body, _ = exp.scrape(None)
    assert b"# TYPE nodeagent_bell_rings_total counter" in body, "declared at start"
    assert value(exporter_series(exp), "nodeagent_bell_queue") == 0
    for rec in (
        {"kind": "bell-rung", "bell": "front"},
        {"kind": "bell-rung", "bell": "front"},
        {"kind": "bell-rung", "bell": "back"},
        {"kind": "caller-came"},
        {"kind": "caller-came"},
        {"kind": "caller-left"},
        {"kind": "something-else"},
    ):
        exp.on_record(rec)
    s = exporter_series(exp)
    assert value(s, "nodeagent_bell_rings_total", bell="front") == 2
    assert value(s, "nodeagent_bell_rings_total", bell="back") == 1
    assert value(s, "nodeagent_bell_queue") == 1, "a gauge sample of a record is a change"
    assert value(s, "nodeagent_records_total", kind="bell-rung") == 3
    assert MetricsExporter({}, mode="enforce", liveness_seconds=60).parts == (), "none by default"


def test_a_part_family_already_taken_is_refused() -> None:
    twin = RecordTelemetry("twin", (QUEUE,), lambda rec: [])
    with pytest.raises(NodeagentError, match="nodeagent_bell_queue: duplicate"):
        MetricsExporter({}, mode="enforce", liveness_seconds=60, parts=(BELL, twin))
    # A guard's family and a part's share one name space.
    lamp = RecordTelemetry(
        "lamp", (MetricFamily("nodeagent_light_lamps", "gauge", "x"),), bell_samples
    )
    with pytest.raises(NodeagentError, match="nodeagent_light_lamps: duplicate"):
        MetricsExporter(
            {"light": TrafficLight()}, mode="enforce", liveness_seconds=60, parts=(lamp,)
        )
    unprefixed = RecordTelemetry(
        "bare", (MetricFamily("bell_rings", "counter", "x"),), bell_samples
    )
    with pytest.raises(NodeagentError, match="not nodeagent_-prefixed"):
        MetricsExporter({}, mode="enforce", liveness_seconds=60, parts=(unprefixed,))


def test_a_part_sampling_an_undeclared_family_fails_loudly() -> None:
    stray = RecordTelemetry("stray", (QUEUE,), lambda rec: [Sample(RINGS.name, {"bell": "x"})])
    exp = MetricsExporter({}, mode="enforce", liveness_seconds=60, parts=(stray,))
    with pytest.raises(ValueError, match="part stray sampled undeclared family"):
        exp.on_record({"kind": "bell-rung"})


def test_the_hold_series_are_declared_beside_the_hold_without_a_metrics_library() -> None:
    import ast

    root = Path(__file__).resolve().parent.parent / "nodeagent"

    def imported(path: Path) -> set[str]:
        names: set[str] = set()
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.Import):
                names |= {a.name for a in n.names}
            elif isinstance(n, ast.ImportFrom) and n.module:
                names.add(n.module)
        return names

    hold = imported(root / "guards" / "peermem" / "telemetry.py")
    assert not {n for n in hold if n.startswith(("prometheus_client", "nodeagent.metrics"))}
    server = imported(root / "metrics_server.py")
    assert "nodeagent.metrics" not in server, "the endpoint reads the exporter through Scrapeable"
    exporter = (root / "metrics.py").read_text().lower()
    assert "peermem" not in exporter and "hold" not in exporter, "the exporter names no part"


def test_liveness_fails_when_passes_stop() -> None:
    now = [1000.0]
    exp = MetricsExporter({}, mode="observe", liveness_seconds=60, monotonic=lambda: now[0])
    assert exp.live()[0], "alive during start-up"
    now[0] += 61
    assert not exp.live()[0]
    exp.on_pass(pass_result({}, [], ["resync"]), None)
    assert exp.live()[0]
    exp.on_pass(None, RuntimeError("boom"))
    assert value(exporter_series(exp), "nodeagent_passes_total", result="error") == 1


def test_wake_sources_are_bounded() -> None:
    assert wake_source("uevent add net eth0") == "uevent"
    assert wake_source("inotify created /x") == "inotify"
    assert wake_source("something free-form") == "other"


@pytest.mark.parametrize(
    "address", ["9808", "localhost", "127.0.0.1:0", "127.0.0.1:70000", ":9808", "h:p"]
)
def test_bad_metrics_address_is_refused_in_one_line(
    address: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    rc = main(["run", "--host-root", str(tmp_path), "--once", "--metrics-address", address])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and "metrics address" in err, err


def test_metrics_address_from_env_and_file(tmp_path: Path) -> None:
    env = {"NODEAGENT_METRICS_ADDRESS": "[::1]:9900"}
    assert load_config(host_root=str(tmp_path), environ=env).metrics_address == "[::1]:9900"
    f = tmp_path / "c.toml"
    f.write_text('metrics_address = "off"\njournal = false\n')
    cfg = load_config(str(f), host_root=str(tmp_path), environ={})
    assert (cfg.metrics_address, cfg.journal) == ("off", False)
    f.write_text("journal = 1\n")
    with pytest.raises(NodeagentError, match="config journal: expected true or false"):
        load_config(str(f), host_root=str(tmp_path), environ={})


def test_addresses_as_the_daemonset_gives_them() -> None:
    from nodeagent.config import parse_address

    # $(POD_IP):9808 with hostNetwork: an IPv4 or a bare IPv6 node address.
    assert parse_address("10.0.0.7:9808") == ("10.0.0.7", 9808)
    assert parse_address("fd00::7:9808") == ("fd00::7", 9808)
    assert parse_address("[fd00::7]:9808") == ("fd00::7", 9808)


def test_a_taken_port_is_one_line() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        exp = MetricsExporter({}, mode="observe", liveness_seconds=60)
        with pytest.raises(NodeagentError, match=f"metrics address 127.0.0.1:{port}: "):
            MetricsServer(exp, f"127.0.0.1:{port}")


def test_default_is_loopback() -> None:
    assert Config().metrics_address.startswith("127.0.0.1:")


def test_every_config_key_is_documented() -> None:
    """Keys from the config code itself (its unknown-key error lists them), env from load_config."""
    import re

    from nodeagent.config import config_from_mapping

    docs = (Path(__file__).resolve().parent.parent / "docs" / "configuration.md").read_text()

    def known(section: str | None) -> list[str]:
        probe: dict[str, Any] = {"__probe__": 1}
        with pytest.raises(NodeagentError) as err:
            config_from_mapping({section: probe} if section else probe)
        return str(err.value).split("(known: ", 1)[1].rstrip(")").split(", ")

    from nodeagent.guards.registry import GUARDS

    sections = {k: known(k) for k in ("paths", *(e.name for e in GUARDS))}
    top = known(None)
    assert set(sections) <= set(top)
    for key in top:
        want = f"## `[{key}]`" if key in sections else f"| `{key}` |"
        assert want in docs, f"{key} is not documented in docs/configuration.md"
    for section, keys in sections.items():
        part = docs.split(f"## `[{section}]`", 1)[1].split("\n## ", 1)[0]
        for key in keys:
            assert f"| `{key}` |" in part, f"{section}.{key} is not documented"
    config_src = (Path(__file__).resolve().parent.parent / "nodeagent" / "config.py").read_text()
    for var in set(re.findall(r"NODEAGENT_[A-Z_]+", config_src)):
        assert f"`{var}`" in docs, f"{var} is not documented"


def test_the_actuator_stamps_each_outcome_with_its_timing(tmp_path: Path) -> None:
    from nodeagent.host.act import Actuator
    from nodeagent.host.fs import HostRoot

    ticks = iter([10.0, 10.5, 20.0, 20.25])

    class Ops:
        def remove(self, name: str) -> None:
            if name == "busy":
                from nodeagent.host.kmod import ModuleOpError

                raise ModuleOpError("unload", name, errno.EBUSY)

    clock = lambda: next(ticks)  # noqa: E731
    act = Actuator(HostRoot(tmp_path), Ops(), lambda m: [], attempts=1, clock=clock)  # type: ignore[arg-type]
    ok = act.perform(UnloadModule(guard="g", module="m", reason="r"))
    failed = act.perform(UnloadModule(guard="g", module="busy", reason="r"))
    assert (ok.ok, ok.finished_at, ok.seconds) == (True, 10.5, 0.5)
    assert (failed.ok, failed.finished_at, failed.seconds) == (False, 20.25, 0.25)


# -- the endpoint, bounded ------------------------------------------------------------------


def test_slow_clients_hold_neither_threads_nor_the_endpoint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Slowloris: clients that send a byte now and then. At the connection cap the oldest
    one still sending its request is closed to make room; each is closed at its
    request's deadline whatever it sends; the endpoint answers a probe afterwards.
    (Before: one thread each, kept for ever.)

    Two phases, so that which rule closed a client is known by order, not by how quick
    the machine is: first a deadline no wait reaches (only the cap can close a client),
    then a short one with no more clients than the cap (only the deadline can)."""
    import socket
    import threading
    import urllib.request

    from nodeagent import metrics_server as m

    cap = 4
    monkeypatch.setattr(m, "MAX_CONNECTIONS", cap)
    monkeypatch.setattr(m, "REQUEST_DEADLINE_S", 3600.0)
    exporter = MetricsExporter(
        build_reconciler(Config()).guards, mode="observe", liveness_seconds=60
    )
    with socket.socket() as probe:  # a free port (the address parser refuses port 0)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = m.MetricsServer(exporter, f"127.0.0.1:{port}")
    baseline = threading.active_count()
    clients: list[socket.socket] = []
    closed: set[socket.socket] = set()

    def slow_client() -> None:
        c = socket.create_connection(("127.0.0.1", server.port), timeout=WAIT)
        clients.append(c)
        c.sendall(b"GET /metrics HTTP/1.1\r\n")
        c.settimeout(0.01)

    def poke() -> int:
        """A byte to each client still open (a per-read timeout never fires); how many
        the server has closed."""
        for c in clients:
            if c in closed:
                continue
            try:
                c.sendall(b"X")
                if c.recv(1) == b"":
                    closed.add(c)
            except TimeoutError:
                pass
            except OSError:  # reset: closed by the server
                closed.add(c)
        return len(closed)

    try:
        # The cap: 40 slow clients for 4 places; each newcomer closes the oldest reader.
        for _ in range(40):
            slow_client()
        until(lambda: poke() >= len(clients) - cap, "the cap closing all but 4 slow clients")
        assert server._httpd.evicted > 0, "the cap made room by closing slow clients"
        until(lambda: threading.active_count() <= baseline + cap, "a thread per slow client")

        # The deadline: the held ones go (their handlers end), then 4 new slow clients
        # with a 1 s deadline, below the cap, are closed by it whatever they send.
        for c in clients:
            c.close()
        clients.clear()
        closed.clear()
        until(lambda: threading.active_count() <= baseline, "the handlers of gone clients ended")
        monkeypatch.setattr(m, "REQUEST_DEADLINE_S", 1.0)
        evicted = server._httpd.evicted
        for _ in range(cap):
            slow_client()
        until(lambda: poke() == cap, "each slow client closed at its request's deadline")
        assert server._httpd.evicted == evicted, "below the cap, only the deadline closes"
        until(lambda: threading.active_count() <= baseline, "no thread kept for a slow client")

        url = f"http://127.0.0.1:{server.port}/healthz"
        with urllib.request.urlopen(url, timeout=WAIT) as r:
            assert r.status in (200, 503)
    finally:
        for c in clients:
            c.close()
        server.close()
