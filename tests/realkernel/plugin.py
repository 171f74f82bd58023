"""pytest side of the real-kernel harness (imported by tests/realkernel/conftest.py).

On the host, every collected test marked ``realkernel`` is replaced by a
:class:`GuestItem` with the same node id.  The first one to run prepares the
kernel (``setup.ensure``), builds the declared out-of-tree modules
(``modbuild``), boots QEMU once and runs ``python -m pytest <all those node
ids>`` in the guest with ``NODEAGENT_IN_GUEST=1``; the guest writes one JSON
result per node id to the shared dir, and each GuestItem then reports its own
guest outcome (pass, fail with the guest's failure text, skip, xfail).  No
fixture of a realkernel test runs on the host.  In the guest the tests just run.

If the harness cannot run here (not root, no apt, download refused, or
``NODEAGENT_REALKERNEL=0``) the items are skipped with the reason.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.realkernel import modbuild, vm
from tests.realkernel import setup as rksetup
from tests.realkernel.modbuild import KModule

IN_GUEST = os.environ.get("NODEAGENT_IN_GUEST") == "1"
ENV_RESULTS = "NODEAGENT_REALKERNEL_RESULTS"  # guest: where to write the result JSON
ENV_MODULES = "NODEAGENT_REALKERNEL_MODULES"  # guest: manifest of host-built modules
ENV_KERNEL = "NODEAGENT_REALKERNEL_KERNEL"  # guest: JSON description of the kernel (paths)
# The whole guest session (boot, pytest, 36 tests): ~140 s on 2 quiet cores under TCG, and
# over 200 s for two of them on a busy machine. A hang detector, not a budget.
DEFAULT_TIMEOUT = 1200.0
MARK = "realkernel"


def _guest_path(p: str) -> str:
    return f"{rksetup.GUEST_SHARED}/{p}"


# ---------------------------------------------------------------- host side


class GuestFailure(Exception):
    """A test failed in the guest (or the guest run itself failed); str = report text."""


@dataclass
class _Session:
    items: list[GuestItem] = field(default_factory=list)
    started: bool = False
    skip_reason: str | None = None
    error: str | None = None
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    collect_errors: list[tuple[str, str]] = field(default_factory=list)
    kernel: rksetup.Kernel | None = None
    accel: str = ""
    t_setup: float = 0.0
    t_build: float = 0.0
    n_built: int = 0
    n_reused: int = 0
    n_failed: int = 0
    compiler: str = ""
    t_boot: float = 0.0
    guest_rc: int | None = None
    guest_log: Path | None = None
    guest_output: str = ""


_KEY = pytest.StashKey[_Session]()


class GuestItem(pytest.Item):
    """Host stand-in for a realkernel test: reports the test's outcome in the guest."""

    def __init__(self, *, original: pytest.Item, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.original = original
        # Markers that the host would act on (skipif evaluated on the host, xfail
        # turning a guest failure into xfail twice, fixtures) stay with the guest.
        for m in original.iter_markers():
            if m.name not in ("skip", "skipif", "xfail", "usefixtures", "parametrize"):
                self.own_markers.append(m)
                self.keywords[m.name] = m

    def reportinfo(self) -> tuple[Any, int | None, str]:
        return self.original.reportinfo()

    def setup(self) -> None:
        st = self.config.stash[_KEY]
        if not st.started:
            _run_guest_session(self.config, st)
        if st.skip_reason is not None:  # one location: -rs folds them into one line
            pytest.skip(f"real kernel unavailable: {st.skip_reason}")

    def runtest(self) -> None:
        st = self.config.stash[_KEY]
        head = f"[in the guest: kernel {st.kernel.kver if st.kernel else '?'}, {st.accel}]"
        r = st.results.get(self.nodeid)
        if r is None and st.error is not None:
            raise GuestFailure(f"{head} {st.error}")
        if r is None:
            text = [
                f"{head} no result for this test from the guest (guest pytest rc={st.guest_rc})"
            ]
            text += [f"collection error in {nid}:\n{err}" for nid, err in st.collect_errors]
            text.append("--- guest pytest output (tail) ---\n" + vm._tail(st.guest_output, 40))
            raise GuestFailure("\n".join(text))
        outcome = r["outcome"]
        if outcome in ("passed", "xpassed"):
            return
        if outcome == "skipped":
            raise pytest.skip.Exception(r["reason"], _use_item_location=True)
        if outcome == "xfailed":
            pytest.xfail(r["reason"])
        parts = [f"{head} {r.get('when', 'call')} failed:\n{r['text']}"]
        parts += [f"--- {title} (guest) ---\n{body}" for title, body in r.get("sections", [])]
        raise GuestFailure("\n".join(parts))

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> Any:
        if isinstance(excinfo.value, GuestFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style=style)


def _declared_modules(items: list[GuestItem]) -> list[KModule]:
    """KModule globals of the test modules (also inside a module-level list/tuple/dict)."""
    specs: list[KModule] = []
    seen: set[int] = set()
    for it in items:
        mod = getattr(it.original, "module", None)
        if mod is None or id(mod) in seen:
            continue
        seen.add(id(mod))
        for v in vars(mod).values():
            inner = v.values() if isinstance(v, dict) else v if isinstance(v, list | tuple) else [v]
            specs += [x for x in inner if isinstance(x, KModule)]
    return specs


def _run_guest_session(config: pytest.Config, st: _Session) -> None:
    st.started = True
    if os.environ.get("NODEAGENT_REALKERNEL", "1") == "0":
        st.skip_reason = "disabled by NODEAGENT_REALKERNEL=0"
        return
    t0 = time.monotonic()
    try:
        kernel = rksetup.ensure()
    except rksetup.SetupError as e:
        st.skip_reason = str(e)
        return
    finally:
        st.t_setup = time.monotonic() - t0
    st.kernel = kernel

    t0 = time.monotonic()
    specs = _declared_modules(st.items)
    manifest = modbuild.build_all(specs, kernel) if specs else {}
    st.n_built = len(manifest)
    st.n_reused = sum(e.get("reused") == "1" for e in manifest.values())
    st.n_failed = sum("error" in e for e in manifest.values())
    if specs:
        try:
            st.compiler = modbuild.compiler_version(kernel.compiler)
        except (rksetup.SetupError, OSError, subprocess.SubprocessError) as e:
            st.compiler = f"unknown ({e})"
    st.t_build = time.monotonic() - t0

    shared = vm.new_run_dir("pytest-")
    (shared / "modules.json").write_text(json.dumps(manifest, indent=1))
    (shared / "kernel.json").write_text(json.dumps(kernel.to_json(), indent=1))
    nodeids = [it.nodeid for it in st.items]
    # hypothesis' pytest plugin imports all of hypothesis at start-up: ~10 s under TCG.
    argv = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:hypothesispytest",
        "-q",
        f"--rootdir={config.rootpath}",
    ]
    if config.inipath is not None:
        argv += ["-c", str(config.inipath)]
    argv += nodeids
    env = {
        "NODEAGENT_IN_GUEST": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        ENV_RESULTS: _guest_path("results.json"),
        ENV_MODULES: _guest_path("modules.json"),
        ENV_KERNEL: _guest_path("kernel.json"),
    }
    if "PYTHONPATH" in os.environ:
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    timeout = float(os.environ.get("NODEAGENT_REALKERNEL_TIMEOUT", DEFAULT_TIMEOUT))
    st.accel = vm.choose_accel()
    t0 = time.monotonic()
    try:
        res = vm.boot(
            argv,
            timeout=timeout,
            kernel=kernel,
            env=env,
            cwd=config.rootpath,
            shared=shared,
            accel=st.accel,
        )
    except vm.GuestError as e:
        # a panic or a hang: keep what finished before it, the rest fail with the logs
        st.error = str(e)
        st.guest_log = shared  # kept for a look
        _read_results(st, shared)
        return
    except rksetup.SetupError as e:
        st.skip_reason = str(e)
        return
    finally:
        st.t_boot = time.monotonic() - t0
    st.guest_rc = res.rc
    st.guest_output = res.output
    log = rksetup.cache_dir() / "last-guest-pytest.log"
    log.write_text(f"$ {' '.join(argv)}\n{res.output}\n--- console ---\n{res.console}")
    st.guest_log = log
    _read_results(st, shared)
    shutil.rmtree(shared, ignore_errors=True)


def _read_results(st: _Session, shared: Path) -> None:
    try:
        data = json.loads((shared / "results.json").read_text())
        st.results = data["results"]
        st.collect_errors = [(str(n), str(e)) for n, e in data.get("collect_errors", [])]
    except (OSError, ValueError, KeyError):
        st.results = {}


def pytest_configure(config: pytest.Config) -> None:
    if IN_GUEST:
        path = os.environ.get(ENV_RESULTS)
        if path and not config.pluginmanager.has_plugin("realkernel-guest-recorder"):
            config.pluginmanager.register(_GuestRecorder(path), "realkernel-guest-recorder")
    else:
        config.stash[_KEY] = _Session()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    if IN_GUEST:
        return
    st = config.stash[_KEY]
    for i, item in enumerate(items):
        if item.get_closest_marker(MARK) is None or isinstance(item, GuestItem):
            continue
        parent = item.parent
        assert parent is not None
        proxy = GuestItem.from_parent(parent, name=item.name, nodeid=item.nodeid, original=item)
        items[i] = proxy
        st.items.append(proxy)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if IN_GUEST or _KEY not in config.stash:
        return
    st = config.stash[_KEY]
    if not st.started:
        return
    tr = terminalreporter
    tr.write_sep("-", "real kernel")
    if st.skip_reason is not None:
        tr.write_line(
            f"realkernel: {len(st.items)} test(s) skipped: {st.skip_reason} "
            f"(setup {st.t_setup:.1f}s)"
        )
        return
    k = st.kernel
    tr.write_line(
        f"realkernel: kernel {k.kver if k else '?'} ({'PVH vmlinux' if k and k.pvh else 'bzImage'}"
        f"), accel {st.accel}: setup {st.t_setup:.1f}s, module builds {st.t_build:.1f}s "
        f"({st.n_built} module(s)), boot+guest pytest {st.t_boot:.1f}s, "
        f"{len(st.items)} test(s)"
    )
    if st.n_built:
        compiled = st.n_built - st.n_reused - st.n_failed
        tr.write_line(
            f"realkernel: module builds: {st.n_reused} of {st.n_built} reused from the cache, "
            f"{compiled} compiled, {st.n_failed} failed; compiler: {st.compiler}"
        )
    if st.guest_log is not None:
        tr.write_line(f"realkernel: guest log: {st.guest_log}")


# ---------------------------------------------------------------- guest side


class _GuestRecorder:
    """Collects one outcome per node id in the guest and writes it as JSON."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.results: dict[str, dict[str, Any]] = {}
        self.collect_errors: list[tuple[str, str]] = []

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.collect_errors.append((report.nodeid, report.longreprtext))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        r = self.results.setdefault(
            report.nodeid, {"outcome": "passed", "reason": "", "text": "", "sections": []}
        )
        if report.when == "call":
            r["duration"] = report.duration
        wasxfail = getattr(report, "wasxfail", None)
        if wasxfail is not None and not report.failed:
            if r["outcome"] == "passed":
                r["outcome"] = "xfailed" if report.skipped else "xpassed"
                r["reason"] = wasxfail
        elif report.failed:
            if r["outcome"] != "failed":
                r.update(
                    outcome="failed",
                    when=report.when,
                    text=report.longreprtext,
                    sections=list(report.sections),
                )
            else:
                r["text"] += f"\n--- and in {report.when} ---\n{report.longreprtext}"
        elif report.skipped and r["outcome"] == "passed":
            lr = report.longrepr
            reason = lr[2] if isinstance(lr, tuple) else str(lr)
            r.update(outcome="skipped", reason=reason.removeprefix("Skipped: "))
        if report.when == "teardown":  # after each test: a later kernel panic keeps these
            self._write()

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        self._write(int(exitstatus))

    def _write(self, exitstatus: int | None = None) -> None:
        tmp = f"{self.path}.tmp"
        data = {"results": self.results, "collect_errors": self.collect_errors}
        with open(tmp, "w") as f:
            json.dump({**data, "exitstatus": exitstatus}, f, indent=1)
        os.replace(tmp, self.path)


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def realkernel_kernel() -> rksetup.Kernel:
    """The prepared kernel (kver, headers, moddir, ...); on the host skips if unavailable."""
    if IN_GUEST:
        path = os.environ.get(ENV_KERNEL)
        if not path:
            pytest.skip(f"{ENV_KERNEL} not set")
        return rksetup.Kernel.from_json(json.loads(Path(path).read_text()))
    try:
        return rksetup.ensure()
    except rksetup.SetupError as e:
        pytest.skip(f"real kernel unavailable: {e}")


@pytest.fixture(scope="session")
def built_modules() -> Iterator[Callable[[KModule], Path]]:
    """``built_modules(spec) -> Path`` of the spec's ``.ko`` (see modbuild.py).

    In the guest: the module the host built before the boot (declare the
    KModule as a module-level global of the test file).  On the host (a test
    not marked realkernel, e.g. one that only reads a .ko): builds on demand.
    """
    if IN_GUEST:
        manifest = modbuild.load_manifest(os.environ.get(ENV_MODULES))
        kver = os.uname().release

        def get_guest(spec: KModule) -> Path:
            try:
                return modbuild.lookup(manifest, spec, kver)
            except modbuild.BuildError as e:
                pytest.fail(str(e), pytrace=False)

        yield get_guest
        return
    try:
        kernel = rksetup.ensure()
    except rksetup.SetupError as e:
        pytest.skip(f"real kernel unavailable: {e}")

    def get_host(spec: KModule) -> Path:
        try:
            return modbuild.build(spec, kernel).ko
        except (modbuild.BuildError, rksetup.SetupError) as e:
            pytest.fail(str(e), pytrace=False)

    yield get_host
