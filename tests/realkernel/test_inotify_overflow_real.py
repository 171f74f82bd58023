"""A real inotify queue overflow wakes the agent's loop (the kernel drops events: look again).

In the guest only: the queue limit (``fs.inotify.max_queued_events``, read
when an inotify instance is created) is lowered to 1 for the watch made
here, then a burst of file creations overflows it.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from nodeagent.host.events import FileWatch, Waker

pytestmark = pytest.mark.realkernel
LIMIT = Path("/proc/sys/fs/inotify/max_queued_events")


def test_a_real_queue_overflow_wakes_the_loop(tmp_path: Path) -> None:
    saved = LIMIT.read_text()
    LIMIT.write_text("1\n")
    try:
        watch = FileWatch(tmp_path, [tmp_path])
    finally:
        LIMIT.write_text(saved)
    waker = Waker([watch])
    try:
        seen: list[str] = []
        deadline = time.monotonic() + 60  # a hang detector: it overflows at once
        i = 0
        while time.monotonic() < deadline and not any("overflow" in s for s in seen):
            for _ in range(200):
                (tmp_path / f"f{i}").touch()
                i += 1
            seen += waker.wait(0.05)
        assert any("inotify queue overflow" in s for s in seen), seen[-5:]
    finally:
        watch.close()
