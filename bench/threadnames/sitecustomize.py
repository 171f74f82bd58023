"""Gives each Python thread of a benched process its name in the kernel (``comm``).

``bench/idle_cost.py`` puts this directory first on the agent's ``PYTHONPATH`` so that
its per-thread CPU (``/proc/<pid>/task/<tid>/comm``) says which thread spent it: Python
3.11 leaves every thread named after the process. One ``prctl(PR_SET_NAME)`` per thread
start, in the thread itself; nothing else of the agent changes.
"""

import ctypes
import threading

_PR_SET_NAME = 15
_libc = ctypes.CDLL(None, use_errno=True)
_bootstrap_inner = threading.Thread._bootstrap_inner  # type: ignore[attr-defined]


def _named(self: threading.Thread) -> None:
    _libc.prctl(_PR_SET_NAME, self.name.encode()[:15], 0, 0, 0)
    _bootstrap_inner(self)


threading.Thread._bootstrap_inner = _named  # type: ignore[attr-defined]
