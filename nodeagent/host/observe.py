"""Read the whole node into one immutable NodeSnapshot.

Level-triggered: every pass re-reads everything the guards look at, so a
missed event costs nothing but one pass. Malformed values never raise: they
become ``problems`` on the fact they concern, which the guards turn into
closed reasons. Parsed .ko files are cached by their identity (device,
inode, mtime, ctime, size), so a pass after the first costs a few hundred
small sysfs reads. The descriptor each cached .ko was read from stays open:
a load inserts that very file (``verified_fd``), never a second lookup by path.
"""

from __future__ import annotations

import contextlib
import os
import re
from types import MappingProxyType

from nodeagent.config import Config
from nodeagent.core.names import is_module_name, normalize_module_name
from nodeagent.core.peermem import PEERMEM
from nodeagent.core.snapshot import DiskModule, LoadedModule, NodeSnapshot
from nodeagent.host.fs import HostRoot
from nodeagent.host.moddep import find_module
from nodeagent.host.modfile import (
    ModuleFile,
    ModuleFileError,
    parse_build_id_note,
    read_module_fd,
)

INITSTATES = ("live", "coming", "going")
_KO_CACHE_MAX = 64  # each entry holds an open descriptor
_KoKey = tuple[str, int, int, int, int, int]
_SRCVERSION = re.compile(r"[0-9A-Fa-f]{1,64}")


class Observer:
    def __init__(self, host: HostRoot, cfg: Config) -> None:
        self.host = host
        self.cfg = cfg
        # identity key -> (parse result, the descriptor it was read from)
        self._ko_cache: dict[_KoKey, tuple[ModuleFile | str, int]] = {}
        self._verified: dict[str, tuple[int, _KoKey]] = {}  # rel path -> the last pass's file

    # -- loaded modules -----------------------------------------------------

    def read_loaded_modules(self) -> tuple[dict[str, LoadedModule], list[str]]:
        base = self.cfg.paths.sys_module
        modules: dict[str, LoadedModule] = {}
        try:
            entries = os.listdir(self.host.path(base))
        except FileNotFoundError:
            return modules, [f"{base} does not exist: this kernel has no loadable modules"]
        except OSError as exc:
            return modules, [f"{base} is unreadable: {exc.strerror}"]
        for name in sorted(entries):
            mod = self.read_loaded_module(name)
            if mod is not None:
                modules[mod.name] = mod
        return modules, []

    def read_loaded_module(self, name: str) -> LoadedModule | None:
        """None for builtin modules (no initstate) and for names the kernel cannot have made."""
        if not is_module_name(name):
            return None
        d = f"{self.cfg.paths.sys_module}/{name}"
        problems: list[str] = []
        raw_state = self._attr(d, "initstate", problems)
        if raw_state is None and not problems:
            return None  # builtin: no initstate
        initstate: str | None = None
        if raw_state is not None:
            if raw_state in INITSTATES:
                initstate = raw_state
            else:
                problems.append(f"initstate is {raw_state[:40]!r} (expected live, coming or going)")
        refcnt: int | None = None
        raw_ref = self._attr(d, "refcnt", problems)
        if raw_ref is not None:
            if raw_ref.isascii() and raw_ref.isdigit():  # "²".isdigit() is True
                refcnt = int(raw_ref)
            else:
                problems.append(f"refcnt is {raw_ref[:40]!r} (not a number)")
        srcversion: str | None = None
        raw_src = self._attr(d, "srcversion", problems)
        if raw_src is not None:
            if _SRCVERSION.fullmatch(raw_src):
                srcversion = raw_src.upper()
            else:
                problems.append(f"srcversion is {raw_src[:40]!r} (not hexadecimal)")
        build_id: str | None = None
        note_rel = f"{d}/notes/.note.gnu.build-id"
        try:
            raw_note = self.host.read_bytes(note_rel, 4096)
        except FileNotFoundError:
            raw_note = None
        except OSError as exc:
            problems.append(f"build-id note unreadable: {exc.strerror}")
            raw_note = None
        if raw_note is not None:
            try:
                build_id = parse_build_id_note(raw_note, f"/{note_rel}")
            except ModuleFileError as exc:
                problems.append(str(exc))
        holders = tuple(
            normalize_module_name(h) for h in self.host.listdir(f"{d}/holders") if is_module_name(h)
        )
        return LoadedModule(
            name=normalize_module_name(name),
            initstate=initstate,
            refcnt=refcnt,
            srcversion=srcversion,
            build_id=build_id,
            holders=holders,
            problems=tuple(problems),
        )

    def _attr(self, d: str, attr: str, problems: list[str]) -> str | None:
        try:
            return self.host.read_text(f"{d}/{attr}", 4096).strip()
        except FileNotFoundError:
            return None
        except OSError as exc:
            problems.append(f"{attr} unreadable: {exc.strerror}")
            return None

    # -- modules on disk ------------------------------------------------------

    def module_dirs(self, name: str, kernel: str) -> list[str]:
        """Where modprobe would look for ``name``: the owning driver container's root first."""
        paths = self.cfg.paths
        host = f"lib/modules/{kernel}"
        if name.startswith("nvidia"):
            return [f"{paths.gpu_driver_root}/lib/modules/{kernel}", host]
        if self.cfg.peermem.mofed == "host":
            return [host]
        return [f"{paths.mofed_driver_root}/lib/modules/{kernel}", host]

    def read_disk_module(self, name: str, kernel: str) -> DiskModule:
        dirs = self.module_dirs(name, kernel)
        for rel_dir in dirs:
            found = find_module(self.host.path(rel_dir), name, self._open_in_root)
            if found is None:
                continue
            rel = self.host.rel_of(found)
            parsed = self._parse_ko(rel)
            if isinstance(parsed, str):
                return DiskModule(name=name, path=rel, problem=parsed)
            return disk_module(parsed, rel, name)
        return DiskModule(
            name=name, path=None, problem=f"not in modules.dep under {' or '.join(dirs)}"
        )

    def _open_in_root(self, path: str) -> int:
        return self.host.open(self.host.rel_of(path), follow=True)

    def _parse_ko(self, rel: str) -> ModuleFile | str:
        """Parse the .ko at ``rel`` (resolved inside the root); a string says what is wrong."""
        try:
            fd, st = self.host.open_regular(rel, follow=True)
        except OSError as exc:
            self._verified.pop(rel, None)
            return f"cannot read {rel}: {exc.strerror or exc}"
        key: _KoKey = (rel, st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size)
        cached = self._ko_cache.get(key)
        if cached is not None:
            os.close(fd)
            result, fd = cached
        else:
            try:
                result = read_module_fd(fd, rel)
            except ModuleFileError as exc:
                result = str(exc)
            if len(self._ko_cache) >= _KO_CACHE_MAX:
                self._drop_cache()
            self._ko_cache[key] = (result, fd)
        if isinstance(result, str):
            self._verified.pop(rel, None)
        else:
            self._verified[rel] = (fd, key)
        return result

    def _drop_cache(self) -> None:
        for _result, fd in self._ko_cache.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._ko_cache.clear()
        self._verified.clear()

    def verified_fd(self, rel: str) -> int | None:
        """The open descriptor of the .ko this observer last read and parsed at ``rel``.

        None when it was not read cleanly, or the file behind the descriptor
        changed since (size, mtime or ctime): it must be verified again first.
        """
        entry = self._verified.get(rel)
        if entry is None:
            return None
        fd, key = entry
        try:
            st = os.fstat(fd)
        except OSError:
            return None
        if (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size) != key[1:]:
            return None
        return fd

    def close(self) -> None:
        self._drop_cache()

    # -- the whole node -------------------------------------------------------

    def read_kernel(self) -> tuple[str, list[str]]:
        rel = self.cfg.paths.osrelease
        try:
            kernel = self.host.read_text(rel, 256).strip()
        except OSError as exc:
            return "unknown", [f"kernel release unreadable at {rel}: {exc.strerror}"]
        if not kernel or "/" in kernel or ".." in kernel or not kernel.isprintable():
            return "unknown", [f"kernel release at {rel} is malformed: {kernel[:60]!r}"]
        return kernel, []

    def observe(self, now: float) -> NodeSnapshot:
        paths = self.cfg.paths
        kernel, problems = self.read_kernel()
        modules, mod_problems = self.read_loaded_modules()
        problems.extend(mod_problems)
        disk: dict[str, DiskModule] = {}
        wanted = [*self.cfg.peermem.rdma_stack, PEERMEM]
        for name in wanted:
            disk[name] = self.read_disk_module(name, kernel)
        for dep in disk[PEERMEM].depends:  # normalized by the .ko reader
            if dep not in disk:
                disk[dep] = self.read_disk_module(dep, kernel)
        return NodeSnapshot(
            now=now,
            kernel=kernel,
            modules=MappingProxyType(modules),
            mofed_ready=self.host.file_fact(paths.mofed_ready),
            # Presence of the blacklist means "MOFED is restarting": an odd entry counts.
            mofed_blacklist=self.host.file_fact(paths.mofed_blacklist, odd_is_present=True),
            mofed_lock=self.host.file_fact(paths.mofed_lock),
            validations=tuple(self.host.listdir(paths.validations)),
            disk=MappingProxyType(disk),
            problems=tuple(problems),
        )


def disk_module(parsed: ModuleFile, rel: str | None = None, name: str | None = None) -> DiskModule:
    """A parsed .ko as the guards see it; ``rel`` is its path under the host root (default: /)."""
    return DiskModule(
        name=name or parsed.name,
        path=rel if rel is not None else parsed.path.lstrip("/"),
        srcversion=parsed.srcversion.upper() if parsed.srcversion else None,
        build_id=parsed.build_id,
        depends=parsed.depends,
        required_crcs=MappingProxyType(dict(parsed.required_crcs)),
        exported_crcs=MappingProxyType(dict(parsed.exported_crcs)),
    )
