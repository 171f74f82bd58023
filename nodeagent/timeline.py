"""The append-only decision timeline: one JSON object a line, bounded, rotated.

Each record is written with a single O_APPEND write, so concurrent readers see
whole lines and a crash leaves at most the last line missing, never a torn
file. When the file passes its size bound it is rotated to ``.1``, ``.2``, ...
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from typing import Any

from nodeagent.host.fs import HostRoot


class Timeline:
    def __init__(self, host: HostRoot, directory: str, max_bytes: int, keep: int) -> None:
        self.host = host
        self.rel = f"{directory}/timeline.jsonl"
        self.directory = directory
        self.max_bytes = max_bytes
        self.keep = keep
        self._dir_ready = False

    def append(self, record: Mapping[str, Any]) -> None:
        if not self._dir_ready:
            self.host.ensure_dir(self.directory)
            self._dir_ready = True
        line = (json.dumps(record, sort_keys=True, default=str) + "\n").encode()
        path = self.host.path(self.rel)
        fd = os.open(
            path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644
        )
        try:
            os.write(fd, line)
            os.fdatasync(fd)
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        if size > self.max_bytes:
            self._rotate()

    def _rotate(self) -> None:
        base = self.host.path(self.rel)
        for i in range(self.keep - 1, 0, -1):
            src = base.with_name(f"{base.name}.{i}")
            if src.exists():
                os.replace(src, base.with_name(f"{base.name}.{i + 1}"))
        os.replace(base, base.with_name(f"{base.name}.1"))

    def records(self) -> Iterator[dict[str, Any]]:
        """Oldest first, across rotated files; a torn or foreign line is skipped."""
        base = self.host.path(self.rel)
        files = [base.with_name(f"{base.name}.{i}") for i in range(self.keep, 0, -1)] + [base]
        for f in files:
            try:
                fh = open(f, encoding="utf-8", errors="replace")  # noqa: SIM115
            except FileNotFoundError:
                continue
            with fh:
                for line in fh:
                    try:
                        rec = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(rec, dict):
                        yield rec


# Lists in status.json and in records are cut to this many items, with a note of
# how many were left out: the node decides their length (e.g. 10,000 validation
# markers), and status.json is rewritten and fsynced on every pass.
MAX_LIST_ITEMS = 64


def bounded(doc: Any, max_items: int = MAX_LIST_ITEMS) -> Any:
    """``doc`` with every list longer than ``max_items`` cut, saying how many were left out."""
    if isinstance(doc, Mapping):
        return {k: bounded(v, max_items) for k, v in doc.items()}
    if isinstance(doc, list | tuple):
        items = [bounded(v, max_items) for v in doc[:max_items]]
        if len(doc) > max_items:
            items.append(f"... {len(doc) - max_items} more left out")
        return items
    return doc
