"""Wake sources against the real thing: inotify on temp dirs, kernel uevents on a veth pair."""

from __future__ import annotations

import os
import threading
import time
import uuid
from pathlib import Path

import pytest

from nodeagent.host import events
from nodeagent.host.events import FileWatch, Poke, UeventSource, Waker, nearest_existing, pending
from tests.waiting import WAIT


def wait_for(waker: Waker, pred, timeout: float = WAIT) -> list[str]:
    """Every wake-up reason (but resync) until ``pred`` holds of them, or ``timeout``."""
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
    target = tmp_path / "run/mellanox/drivers"
    watch = FileWatch(tmp_path, [target])
    waker = Waker([watch])
    try:
        assert watch.watched == {tmp_path}
        target.mkdir(parents=True)
        seen = wait_for(waker, lambda s: any("run" in x for x in s))
        assert seen, "creating the directory on the way must wake"
        assert watch.refresh() == [target]
        assert watch.watched == {target}
        # What changed before the new watch existed is not lost: the loop passes once more.
        assert waker.wait(0) == [f"inotify watching {target}"]
        (target / ".driver-ready").write_text("")
        seen = wait_for(waker, lambda s: any(".driver-ready" in x for x in s))
        assert any(".driver-ready" in x for x in seen)
        # unrelated files elsewhere do not wake: the kernel queues events in order on the
        # one descriptor, so had the write woken, it would come before the sentinel's.
        (tmp_path / "unrelated").write_text("")
        (target / "sentinel").write_text("")
        seen = wait_for(waker, lambda s: any("sentinel" in x for x in s))
        assert any("sentinel" in x for x in seen), seen
        assert not any("unrelated" in x for x in seen), seen
    finally:
        watch.close()


def test_a_storm_is_one_short_wake_up(tmp_path: Path) -> None:
    """20k creations and removals in a watched directory: one drain takes them all,
    a bounded list of descriptions and a count, and nothing is left behind."""
    target = tmp_path / "validations"
    target.mkdir()
    watch = FileWatch(tmp_path, [target])
    waker = Waker([watch])
    try:
        for i in range(10_000):
            p = target / f"f{i}"
            p.touch()
            p.unlink()
        reasons = waker.wait(WAIT)  # (queued already: returns at once)
        assert len(reasons) <= events.REASONS_MAX + 1
        assert reasons[0] == f"inotify created {target / 'f0'}"
        more = [r for r in reasons if r.endswith("more events")]
        assert more and int(more[0].split()[1]) > 1000, reasons[-2:]
        assert not watch.has_pending()
        # Every event was queued by the syscalls above, before the drain: none can come late.
        assert waker.wait(0) == []
    finally:
        watch.close()


def test_irrelevant_changes_beside_a_watched_parent_are_not_pending(tmp_path: Path) -> None:
    """Watched from its parent, a missing target's siblings do not count as an event
    (a pass would otherwise withdraw its gates for a file it never reads)."""
    target = tmp_path / "run/mellanox/drivers"
    (tmp_path / "run").mkdir()
    watch = FileWatch(tmp_path, [target])
    try:
        assert watch.watched == {tmp_path / "run"}
        # (inotify queues an event within the system call: had it counted, it is there now)
        (tmp_path / "run/unrelated.pid").write_text("1")
        assert not pending([watch])
        assert watch.drain() == []
        (tmp_path / "run/mellanox").mkdir()
        assert pending([watch])
        assert watch.holds  # read once, kept for the drain
        assert Waker([watch]).wait(WAIT) == [f"inotify created {tmp_path / 'run/mellanox'}"]
    finally:
        watch.close()


def test_a_watched_directory_removed_wakes_and_is_watched_from_its_parent(tmp_path: Path) -> None:
    target = tmp_path / "run/nvidia/validations"
    target.mkdir(parents=True)
    watch = FileWatch(tmp_path, [target])
    try:
        target.rmdir()
        reasons = Waker([watch]).wait(WAIT)
        assert f"inotify gone {target}" in reasons
        watch.refresh()
        assert watch.watched == {tmp_path / "run/nvidia"}
    finally:
        watch.close()


def test_a_queue_overflow_from_the_kernel_is_a_wake_up(tmp_path: Path) -> None:
    """The record the kernel queues when it drops events (wd -1, IN_Q_OVERFLOW); a
    real overflow is provoked in tests/realkernel/test_inotify_overflow_real.py."""
    watch = FileWatch(tmp_path, [tmp_path])
    try:
        watch._take(events.INOTIFY_EVENT.pack(-1, events.IN_Q_OVERFLOW, 0, 0))
        assert watch.drain() == ["inotify queue overflow: events were lost"]
    finally:
        watch.close()


def test_poke_wakes_and_reports(tmp_path: Path) -> None:
    poke = Poke()
    try:
        poke.poke("stop")
        assert Waker([poke]).wait(WAIT) == ["stop"]
        assert Waker([poke]).wait(0) == []  # taken: nothing is left to wake
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


def test_explained_events_wake_but_leave_a_decision_fresh(tmp_path: Path) -> None:
    """``explained`` events (a marker's own, a writer's temp file beside it) are held as
    wake-ups but ``has_pending`` does not count them; any other relevant event counts,
    and so does a directory created on the way to a target."""
    markers = tmp_path / "run/mellanox/drivers"
    listing = tmp_path / "run/nvidia/validations"
    markers.mkdir(parents=True)
    listing.mkdir(parents=True)
    missing = markers / "sub"  # a target that does not exist yet, inside the markers' dir

    def explained(p: Path) -> bool:
        return p.parent == markers and p != missing

    watch = FileWatch(tmp_path, [markers, listing, missing], explained)
    try:
        watch.drain()
        fd = os.open(markers / ".driver-ready", os.O_WRONLY | os.O_CREAT, 0o644)
        os.utime(fd)
        os.close(fd)  # touch: created, attrib, closed
        (markers / ".tmp.new").write_text("x")
        os.replace(markers / ".tmp.new", markers / "other")
        deadline = time.monotonic() + WAIT
        while not watch.holds and time.monotonic() < deadline:
            watch.has_pending()
        assert watch.holds, "the events were not read"
        assert not watch.has_pending(), "explained events made the decision stale"
        assert pending([watch]) is False
        reasons = watch.drain()
        assert any(".driver-ready" in r for r in reasons), reasons  # still a wake-up
        (listing / ".driver-ctr-ready").write_text("")
        deadline = time.monotonic() + WAIT
        while not watch.has_pending() and time.monotonic() < deadline:
            pass
        assert watch.has_pending(), "a listed directory's change did not count"
        watch.drain()
        missing.mkdir()  # on the way to a watched target: its contents are not seen yet
        deadline = time.monotonic() + WAIT
        while not watch.has_pending() and time.monotonic() < deadline:
            pass
        assert watch.has_pending(), "a target directory created did not count"
        assert watch.drain() != []
    finally:
        watch.close()


def test_the_agent_explains_only_events_in_directories_of_markers(tmp_path: Path) -> None:
    from nodeagent.agent import Agent
    from nodeagent.config import Config
    from tests.healthy import healthy_node

    node = healthy_node(tmp_path)
    agent = Agent(
        Config(host_root=str(tmp_path), mode="enforce", uevents=False),
        module_ops=node.kernel,
        kernel_log=lambda m: [],
    )
    try:
        explained = agent._explained_events()
        needs = agent.observer.needs
        ready = agent.host.path("run/mellanox/drivers/.driver-ready")
        assert "run/mellanox/drivers/.driver-ready" in needs.files
        assert explained(ready)  # its identity is compared again before the gate
        assert explained(ready.with_name("..driver-ready.new"))  # a writer's temp file
        for listed in needs.listings:
            assert not explained(agent.host.path(listed) / "anything"), listed
        for d in needs.watch:
            assert not explained(agent.host.path(d) / "anything"), d
        # MOFED's modules live under its flag's directory: their tree is not a temp file.
        assert not explained(ready.parent / "lib")
        # A directory watched because it is a target, created inside a markers' directory.
        for target in (*needs.listings, *needs.watch):
            p = agent.host.path(target)
            assert not explained(p), target
    finally:
        agent.close()
        node.kernel.uevent_source.close()


def test_settle_waits_for_the_writer_of_a_file_just_created_and_no_longer(
    tmp_path: Path,
) -> None:
    """``touch`` wakes the loop on its create; ``settle`` lets the pass observe once the
    writer closed the file (its times set), with what came meanwhile as wake reasons and
    nothing left pending; a writer that keeps the file open is waited for at most the
    bound; a file renamed into place is not waited for."""
    target = tmp_path / "drivers"
    target.mkdir()
    watch = FileWatch(tmp_path, [target])
    try:
        fd = os.open(target / ".driver-ready", os.O_WRONLY | os.O_CREAT, 0o644)
        go = threading.Event()

        def finish() -> None:
            go.wait(WAIT)
            os.utime(fd)
            os.close(fd)

        writer = threading.Thread(target=finish)
        writer.start()
        deadline = time.monotonic() + WAIT
        while not watch._writing and time.monotonic() < deadline:
            watch.has_pending()  # the loop's wake-up: the creation read
        assert watch._writing, "the creation was not seen"
        go.set()
        t0 = time.monotonic()
        reasons = watch.settle(WAIT)
        assert time.monotonic() - t0 < WAIT, "settle waited past the writer's close"
        writer.join(WAIT)
        assert any("closed" in r for r in reasons), reasons
        assert not watch.has_pending(), "the writer's own events made the pass stale"

        # A writer that never closes: the bound, not a hang (a hang detector, in seconds).
        held = os.open(target / "kept-open", os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            deadline = time.monotonic() + WAIT
            while not watch._writing and time.monotonic() < deadline:
                watch.has_pending()
            t0 = time.monotonic()
            watch.settle(0.05)
            assert time.monotonic() - t0 < WAIT
        finally:
            os.close(held)
        watch.drain()

        # Renamed into place (written elsewhere first): nothing to wait for.
        (tmp_path / "elsewhere").write_text("")
        os.replace(tmp_path / "elsewhere", target / "moved-in")
        deadline = time.monotonic() + WAIT
        while not watch.holds and time.monotonic() < deadline:
            watch.has_pending()
        assert not watch._writing
    finally:
        watch.close()


# -- a file whose openings wake the loop (MOFED's lock: issue 50) -----------------------


def test_an_opened_file_wakes_and_is_remembered_across_its_recreation(tmp_path: Path) -> None:
    d = tmp_path / "run/mellanox/drivers"
    d.mkdir(parents=True)
    lock = d / ".lock"
    lock.touch()
    ticks = iter(range(1, 1000))
    watch = FileWatch(tmp_path, [d], opens={lock: "lock"}, clock=lambda: float(next(ticks)))
    waker = Waker([watch])
    try:
        assert watch.opened_at("lock") is None
        os.stat(lock)  # a stat is no opening
        os.close(os.open(lock, os.O_RDONLY))
        seen = wait_for(waker, lambda s: f"inotify opened {lock}" in s)
        assert f"inotify opened {lock}" in seen
        first = watch.opened_at("lock")
        assert first is not None
        # Made again (MOFED's first start on a fresh /run): the creation is an opening,
        # and the new inode's openings are seen once refresh() moved the watch.
        lock.unlink()
        fd = os.open(lock, os.O_CREAT | os.O_RDONLY, 0o600)
        os.close(fd)
        seen = wait_for(waker, lambda s: f"inotify created {lock}" in s)
        assert f"inotify created {lock}" in seen
        second = watch.opened_at("lock")
        assert second is not None and second > first
        watch.refresh()
        os.close(os.open(lock, os.O_RDONLY))
        assert f"inotify opened {lock}" in wait_for(waker, lambda s: f"inotify opened {lock}" in s)
        third = watch.opened_at("lock")
        assert third is not None and third > second
    finally:
        watch.close()


def test_a_link_where_the_opened_file_should_be_is_not_watched(tmp_path: Path) -> None:
    """The watch is on the file's own inode, never through a symlink planted at its path
    (an opening of whatever it points at is not MOFED's)."""
    d = tmp_path / "drivers"
    d.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("")
    lock = d / ".lock"
    lock.symlink_to(elsewhere)
    watch = FileWatch(tmp_path, [d], opens={lock: "lock"})
    waker = Waker([watch])
    try:
        os.close(os.open(elsewhere, os.O_RDONLY))
        (d / "sentinel").write_text("")  # queued after the opening, had it been seen
        seen = wait_for(waker, lambda s: any("sentinel" in x for x in s))
        assert not any(x.startswith("inotify opened") for x in seen), seen
        assert watch.opened_at("lock") is None
    finally:
        watch.close()


def test_a_poke_while_the_loop_drains_leaves_no_wake_without_its_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A poke from another thread (the responder's reader, a worker, a timer) between the
    drain's read of the pipe and its take of the reasons had its reason taken and its byte
    left: the next pass found a wake pending (its decision not fresh: its open gates
    withdrawn) and draining that byte gave no reason, so no pass followed until the next
    event or the resync (issue 65; found by the simulator, whose wake pipe is a Poke). The
    poke comes here at exactly that point, every time."""
    from nodeagent.host.events import Poke, readable
    from tests.waiting import poke_mid_drain

    poke = Poke()
    taken = poke_mid_drain(poke, lambda: poke.poke("held open ended"), monkeypatch)
    # Readable exactly while a reason is pending, and a drain of it gives that reason.
    assert bool(readable([poke])) == bool(poke._pending), (taken, poke._pending)
    assert [*taken, *poke.drain()] == ["held open ended"]
    assert not readable([poke])
    poke.close()
