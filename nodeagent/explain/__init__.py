"""``nodeagent explain``: name the race from the logs an admin already has.

Three parts, each in one place:

- ``SIGNATURES``: which log lines are evidence of what, each citing the source
  of its words (the kernel's module loader, kmod, ``openibd``, the operators'
  containers) or the seed it came from. A form may name fields (``module``,
  ``symbol``, ``err``) that the rules read.
- ``classify``: the rules that turn one node's evidence into incidents. The
  peermem family is decided per failed load: a "disagrees" line and an
  ``Invalid argument`` from the same load (the same file within
  ``SAME_LOAD_LINES`` lines, or stamps within ``SAME_LOAD_S``) are an ABI
  mismatch; an ``Invalid argument`` while MOFED's log shows a restart under way
  is the load race; one with neither is its own kind, which names both causes.
- ``INCIDENTS``: each kind's title, remedy in operator words, and which
  deployment modes of ``deploy/README.md`` would have prevented it.

Lines are matched after ``split`` takes off what tools put in front of them
(``kubectl logs --timestamps``, ``dmesg``, ``dmesg -T``, ``journalctl``, CR,
ANSI colour) and keeps the time it says; a line with none inherits the last
time its file said within ``INHERIT_LINES`` lines. Times are compared only on
one clock: wall clock (seconds into the year: a journal line has no year, and
each tool's zone is taken as the same) or seconds since boot (``dmesg``).

Evidence is kept per node: a bundle (``walk.py``) says which node a file
is about, loose files are one node, and no rule correlates two nodes' lines.

Every pattern runs in time linear in the line (``forms.py`` says how).

Where each part lives (the pure files are held to ``core/``'s import ban by
tests/test_shape.py; only ``walk.py`` and ``files.py`` read files):

- ``signatures.py``: the evidence table (data: each form's pattern, words, source);
- ``incidents.py``: the kinds (data: title, remedy, the modes that prevent each);
- ``forms.py``: what a form is and how one line is searched (RE2 first);
- ``stamps.py``: a line's prefixes and the time it says;
- ``rules.py``: one node's evidence into incidents (``classify``);
- ``matcher.py``: the ``Explainer`` a run feeds, line by line; knows no kind;
- ``nodes.py``: which node a file of a support bundle is about;
- ``walk.py``, ``files.py``: bundles and log files read, bounded.
"""
