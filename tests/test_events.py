"""Wake sources against the real thing: inotify on temp dirs, kernel uevents on a veth pair."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import pytest

from nodeagent.host.events import FileWatch, Poke, UeventSource, Waker, nearest_existing


def wait_for(waker: Waker, pred, timeout: float = 5.0) -> list[str]:
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen.extend(r for r in waker.wait(0.2) if r != "resync")
        if pred(seen):
            return seen
    return seen


def test_nearest_existing_parent(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    assert nearest_existing(tmp_path / "run/mellanox/drivers", tmp_path) == tmp_path / "run"
    assert nearest_existing(tmp_path / "nope", tmp_path) == tmp_path


def test_missing_directory_is_watched_from_its_parent_and_moved_down(tmp_path: Path) -> None:
    poke = Poke()
    target = tmp_path / "run/mellanox/drivers"
    watch = FileWatch(tmp_path, [target], poke)
    waker = Waker([poke])
    try:
        assert watch.watched == {tmp_path}
        target.mkdir(parents=True)
        seen = wait_for(waker, lambda s: any("run" in x for x in s))
        assert seen, "creating the directory on the way must wake"
        watch.refresh()
        assert watch.watched == {target}
        (target / ".driver-ready").write_text("")
        seen = wait_for(waker, lambda s: any(".driver-ready" in x for x in s))
        assert any(".driver-ready" in x for x in seen)
        time.sleep(0.3)  # let the write's trailing events (modified, closed) arrive
        waker.wait(0)
        # unrelated files elsewhere do not wake
        (tmp_path / "unrelated").write_text("")
        assert [r for r in waker.wait(0.3) if r != "resync"] == []
    finally:
        watch.close()
        poke.close()


def test_poke_wakes_and_reports(tmp_path: Path) -> None:
    poke = Poke()
    try:
        poke.poke("stop")
        assert Waker([poke]).wait(1.0) == ["stop"]
        assert Waker([poke]).wait(0.01) == ["resync"]
    finally:
        poke.close()


def _can_make_links() -> str | None:
    if os.geteuid() != 0:
        return "needs root (CAP_NET_ADMIN) to create a veth pair"
    return None


@pytest.mark.skipif(_can_make_links() is not None, reason=str(_can_make_links()))
def test_kernel_uevents_for_net_devices_reach_the_source() -> None:
    from pyroute2 import IPRoute

    try:
        src = UeventSource()
    except Exception as exc:  # pragma: no cover - depends on the machine
        pytest.skip(f"kernel uevent socket unavailable here: {exc}")
    waker = Waker([src])
    name = "na" + uuid.uuid4().hex[:8]
    with IPRoute() as ipr:
        ipr.link("add", ifname=name, kind="veth", peer=name + "p")
        try:
            seen = wait_for(waker, lambda s: any(f"add net {name}" in x for x in s))
            assert any(f"uevent add net {name}" == x for x in seen), seen
        finally:
            ipr.link("del", ifname=name)
    seen = wait_for(waker, lambda s: any(f"remove net {name}" in x for x in s))
    assert any(f"uevent remove net {name}" == x for x in seen), seen
