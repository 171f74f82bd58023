"""The peermem guard's host side, one wing: the fanotify hold of anyone's ``nvidia-peermem``
load (the decision is ``core/peermem.py``; which opens are held, ``core/hold.py``).

- ``side.py``: ``PeermemHold``, what the loop runs (guards/side.py's contract), and
  ``side_start.py`` its starting half (a start off the loop, adoption, marks, retries);
- ``status.py``: its part of status.json and its records of what the responder did;
- ``restarts.py``: a dead responder replaced off the loop thread, and how often;
- ``start.py``: where the hold meets a kernel (``HoldHost``), the protocols the side
  drives, ``start_hold``, ``spawner`` and ``adopt``;
- ``responder.py``: the ``Responder`` that answers every permission event;
- ``process.py``, ``process_main.py``: the responder in a process of its own (the
  agent's handle, and the process);
- ``adopt.py``: a responder a dead agent left, waiting for the next one;
- ``lease.py``: the gate as the responder reads it; ``budget.py``: its descriptors;
- ``openers.py``: who opened; ``reports.py``: what it tells;
- ``roots.py``, ``procfs.py``: the driver containers' roots, found and marked;
- ``telemetry.py``: its series, from its records (pure).

A wing imports only ``guards/side.py``, ``host/`` and ``core/``; only the registry,
the simulator, benches and tests import it (tests/test_shape.py).

Container roots
---------------

The driver container loads ``nvidia-peermem`` from its own root (an overlay, new
at every start), so the hold must mark that overlay's filesystem before the
container's first ``modprobe``. The mark is placed through ``/proc/<pid>/root``
(needs the host's PID namespace): the overlay is mounted only in the
container's mount namespace, and the kernel resolves the magic link to it.

How new processes are noticed: the kernel's exec events
(``host/procevents.py``: the process events connector), on a thread of its own.
A runtime's ``runc init`` becomes the entrypoint at ``exec``, later than its pid
appears, so an exec event is exactly the moment to look: the scanner reads the
command line of exec'd processes only. A lone exec is looked at as its event
arrives, and so is a start's burst of a few; under a stream of them, at most once
every ``batch_s`` (the poll's own interval, 0.1 s: ``hold_scan_seconds``), all
the events queued meanwhile in one wake: a wake costs
this thread far more than a read (~300 µs a look against ~20 µs a process on
the bench VM), so the scanner's cost has a ceiling whatever execs on the node. The subscription
needs ``CAP_NET_ADMIN`` (the base DaemonSet grants it), the host's network
namespace (``hostNetwork``: the connector lives in the initial one only) and the
host's user and pid namespaces (``hostPID``, which marking through
``/proc/<pid>/root`` needs anyway). A full look at ``/proc`` every
``full_scan_s`` (2 s) stays as the safety net: the kernel drops an event it
cannot allocate without a word; a loss the socket reports (``ENOBUFS``) is a
full scan at once that reads every command line again (any process may have
exec'd meanwhile). Where the connector refuses (no ack within a second: outside
the host's user or pid namespace; a bind or send refused) the scanner polls
``/proc`` every ``interval_s`` (0.1 s) as before, and says so in status
(``hold.container_scan.mode``) and once as a problem. The full scan lists
``/proc`` and reads the command line of new processes only, and reads a
process again on each scan while it is young (``recheck_s``): with exec events
that is the backstop, polling it is how the entrypoint's exec is seen. A match
whose root is not yet an overlay of its own (a wrapper before its ``chroot``) is
looked at again every ``interval_s`` while young too, and named only if it
still is not when its window ends. ``bench/container_mark.py`` has the figures
of both modes (start → mark, and CPU at idle with a busy process table).

Which processes: ``core/hold.py`` decides from the command line first. A
match is marked only when its process can load a module at all: ``CAP_SYS_MODULE``
in its bounding set (``CapBnd`` in ``/proc/<pid>/status``: no process gains a
capability its bounding set lacks, and every unprivileged pod lacks this one)
and the host's user namespace (capabilities are relative to one: ``unshare -U
-r`` shows a full set inside). Anyone can name a process ``nvidia-driver init``;
only such a process is worth holding, so no other can put its opens, or its
root, through the responder. And only when its root is an overlay of its own
(not the host's root, which would put every open on the node through the
responder, nor the agent's own); one that is not is named once and left alone.

The root is resolved once (``open_root``: an ``O_PATH`` descriptor of
``/proc/<pid>/root``); that descriptor is checked and marked, so a process
flipping its root between the check and the mark cannot get another filesystem
marked. The kernel's list of marks is read back after marking; a root the
kernel does not list is unmarked and named. A mark the kernel refuses
(``ENOSPC``: ``max_user_marks`` spent) is named once and tried again every
full scan period while the process runs. Status shows the device marked.

A marked root is kept while the kernel keeps its mark (``fdinfo``): the kernel
drops a filesystem mark when its superblock goes (the runtime unmounts the
container's root), and no descriptor is held on it, so the unmount is never
refused because of the agent. A root whose container is gone but whose overlay
is still mounted (e.g. a stale bind at ``/run/nvidia/driver``) stays marked:
a load through it is the same race. When a mark goes, ``hold-root-gone`` says
whether its container still runs: its pid's root resolves and the pid is still
the process marked (its start time, ``/proc/<pid>/stat`` field 22, as at the
mark: a pid reused by another process is not the container).
"""

# The wing's pure files: no I/O, held to core/'s import ban (tests/test_shape.py).
PURE_FILES = ("telemetry.py", "reports.py")
