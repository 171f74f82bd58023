"""The VF guard's series: its phases as states, VFs by restore state, restores per PF."""

from __future__ import annotations

from nodeagent.core.actions import ActionOutcome, RestoreVf
from nodeagent.metrics import MetricsExporter
from tests.guards.sriov.sriov_world import PF_PCI, POLICY, Run, World
from tests.metrics_scrape import exporter_series, pass_result, value


def test_phases_vf_counts_and_restore_outcomes_per_pf() -> None:
    run = Run(World(3).configured(), POLICY)
    run.step(0.0)
    run.world.unload()
    run.step(1.0)
    run.world.reload()
    run.world.netdev_appears(1)
    run.step(2.0)
    assert run.phase() == "restoring"
    assert run.snap is not None
    v = run.guard.verdict(run.snap, run.memory)
    restore = next(a for a in run.actions if isinstance(a, RestoreVf))
    outcomes = [
        ActionOutcome(restore, ok=True, finished_at=2.0, seconds=0.02),
        ActionOutcome(restore, ok=False, error="EIO", finished_at=2.0, seconds=0.04),
    ]
    exp = MetricsExporter({"sriov": run.guard}, mode="enforce", liveness_seconds=60)
    exp.on_pass(pass_result({"sriov": v}, outcomes, ["uevent add net x"]), None)
    s = exporter_series(exp)
    pf = {"pci_bus_id": PF_PCI, "device": "enp1s0f0"}
    assert value(s, "nodeagent_guard_state", guard="sriov", state="restoring") == 1
    assert value(s, "nodeagent_guard_state", guard="sriov", state="degraded") == 0
    assert value(s, "nodeagent_guard_ok", guard="sriov") == 1
    assert value(s, "nodeagent_sriov_vfs", state="saved", **pf) == 3
    assert value(s, "nodeagent_sriov_vfs", state="restored", **pf) == 1
    assert value(s, "nodeagent_sriov_vfs", state="waiting", **pf) == 2
    assert value(s, "nodeagent_sriov_vf_restores_total", outcome="ok", **pf) == 1
    assert value(s, "nodeagent_sriov_vf_restores_total", outcome="failed", **pf) == 1
    assert value(s, "nodeagent_sriov_vf_restore_seconds_count", **pf) == 2
