"""The features.d file node-feature-discovery turns into node labels (see core/labels.py).

Written atomically through ``write_atomic`` (``.nodeagent.tmp.<pid>``, a
dot-file NFD ignores, then renamed into place), only when a label changes or
half of the expiry has passed, and only into a directory that exists: a
missing or unwritable features.d is a problem named on the pass, never created
and never a reason to hold a gate. A write that fails removes the file it
could not replace (older labels are not left to stand until they expire, and a
symlink or FIFO planted in its place is gone for the next pass's write).
Removed at a clean stop: a stale ``ok`` label is worse than none (NFD drops
the labels at its next discovery, at once with its features.d watch since
v0.19, else within its 60 s sleep interval).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Mapping

from nodeagent.core.labels import FILE_NAME, features_file
from nodeagent.errors import NodeagentError
from nodeagent.host.fs import HostRoot, reason

log = logging.getLogger("nodeagent.labels")


class FeatureFile:
    def __init__(
        self,
        host: HostRoot,
        features_dir: str,
        expiry_seconds: float,
        wall: Callable[[], float],
    ) -> None:
        self.host = host
        self.dir = features_dir
        self.rel = f"{features_dir}/{FILE_NAME}"
        self.expiry = expiry_seconds
        self.wall = wall
        self._labels: dict[str, str] | None = None
        self._expires = 0.0
        self._ident: object = None
        self._problem: str | None = None

    def publish(self, labels: Mapping[str, str]) -> str | None:
        """Write the labels if they changed (or the expiry is half gone); a problem or None."""
        now = self.wall()
        if (
            self._labels == labels
            and self._expires - now > self.expiry / 2
            and self.host.file_fact(self.rel).ident == self._ident
        ):
            return self._say(None)
        try:
            self._check_dir()
            expires = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now + self.expiry))
            self.host.write_atomic(self.rel, features_file(labels, expires).encode())
        except (OSError, NodeagentError) as exc:
            self._labels = None
            self._withdraw()
            return self._say(f"node labels not written ({self.rel}: {reason(exc)})")
        self._labels, self._expires = dict(labels), now + self.expiry
        self._ident = self.host.file_fact(self.rel).ident
        return self._say(None)

    def remove(self) -> None:
        """At a clean stop: the labels go with the agent."""
        self._labels = None
        try:
            self.host.remove(self.rel)
        except (OSError, NodeagentError) as exc:
            log.warning("node labels left in %s: %s", self.rel, reason(exc))

    def _withdraw(self) -> None:
        """After a failed write: no file of ours rather than an old one (its labels may
        be stale until it expires), and whatever stood in its place (a symlink NFD would
        follow, a FIFO) gone for the next write; never followed, a directory stays."""
        with contextlib.suppress(OSError, NodeagentError):
            self.host.remove(self.rel)

    def _check_dir(self) -> None:
        """The directory exists (NFD's hostPath); the agent never creates it."""
        try:
            os.close(self.host.open_dir(self.dir, create=False))
        except FileNotFoundError:
            raise NodeagentError(
                f"{self.dir} does not exist: is node-feature-discovery deployed, and its "
                "features.d mounted into the agent?"
            ) from None

    def _say(self, problem: str | None) -> str | None:
        if problem != self._problem:
            if problem is not None:
                log.error("%s", problem)
            elif self._problem is not None:
                log.info("node labels written again to %s", self.rel)
            self._problem = problem
        return problem
