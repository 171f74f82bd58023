"""Kernel module operations that keep the real errno.

``LibKmod`` is a small ctypes binding to ``libkmod.so.2``; ``ModprobeTools``
runs ``insmod``/``rmmod``/``modprobe`` (argv lists, never a shell) and maps
their messages back to an errno. Both check every module name and parameter
with ``nodeagent.core.names`` before anything reaches the kernel or an argv.

A verified file is loaded by descriptor (``insert_fd``): ``finit_module(2)``
on the very descriptor the agent read and checked, never a second lookup by
path. Compressed modules go to the kernel with ``MODULE_INIT_COMPRESSED_FILE``
(Linux >= 6.4); older kernels get the image decompressed from that same
descriptor through ``init_module(2)``, as libkmod does.

Neither runs modprobe.d ``install``/``remove`` commands (libkmod would run them
through ``system()``; the agent's own gate may be such a hook), and by default
neither reads any modprobe.d configuration: what is loaded is exactly what was
asked, with the dependencies from ``modules.dep``.
"""

from __future__ import annotations

import ctypes
import errno as errno_mod
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import PurePosixPath
from typing import Any, Protocol, runtime_checkable

from nodeagent.core.names import validate_module_name, validate_module_param
from nodeagent.errors import NodeagentError
from nodeagent.host.deadline import step_time_left

__all__ = [
    "LibKmod",
    "ModprobeTools",
    "ModuleOpError",
    "ModuleOps",
    "default_module_ops",
    "errno_from_message",
    "insert_module_fd",
]

# libkmod.h
_KMOD_PROBE_IGNORE_COMMAND = 0x00004
_KMOD_PROBE_DRY_RUN = 0x00010
_KMOD_REMOVE_NOWAIT = os.O_NONBLOCK  # libkmod forces it anyway


# (finit_module, init_module) syscall numbers per machine (asm/unistd.h).
_SYSCALLS = {
    "x86_64": (313, 175),
    "aarch64": (273, 105),
    "ppc64le": (353, 128),
    "s390x": (344, 128),
}
_MODULE_INIT_COMPRESSED_FILE = 4
_COMPRESSED_MAGIC = (b"\xfd7zXZ\x00", b"\x28\xb5\x2f\xfd", b"\x1f\x8b")


class ModuleOpError(Exception):
    """A module operation the kernel (or the tool) refused; ``.errno`` is the real one."""

    def __init__(self, op: str, module: str, err: int, detail: str | None = None) -> None:
        self.op = op
        self.module = module
        self.errno = err
        self.detail = " ".join(detail.split()) if detail else None
        name = errno_mod.errorcode.get(err, str(err))
        text = f"{op} {module}: {os.strerror(err)} ({name})"
        if self.detail:
            text += f": {self.detail}"
        super().__init__(text)


@runtime_checkable
class ModuleOps(Protocol):
    def insert_file(self, path: str, params: Sequence[str]) -> None:
        """Load exactly this file (no dependency probing), like insmod."""
        ...

    def insert_fd(self, fd: int, name: str, params: Sequence[str]) -> None:
        """Load the module open at ``fd`` (the very file that was verified), like insmod."""
        ...

    def remove(self, name: str) -> None:
        """Unload, non-blocking, like rmmod: EBUSY when held, ENOENT when not loaded."""
        ...

    def probe(self, name: str, moddir: str, params: Sequence[str] = ()) -> None:
        """Load with dependencies from ``moddir``'s modules.dep; already loaded is fine."""
        ...


@runtime_checkable
class PlansProbes(Protocol):
    """Module ops that can tell what a ``probe`` would insert without inserting it."""

    def probe_plan(
        self, name: str, moddir: str, params: Sequence[str] = ()
    ) -> tuple[tuple[str, str], ...]:
        """(module, options) in insert order; modules already live left out; ENOENT when
        ``name`` is not in ``moddir``'s indexes."""
        ...


def _name_from_path(path: str) -> str:
    base = os.path.basename(path)
    for suffix in (".xz", ".zst", ".gz"):
        base = base.removesuffix(suffix)
    if not base.endswith(".ko"):
        raise NodeagentError(
            f"not a kernel module file name (expected *.ko[.xz|.zst|.gz]): {path!r}"
        )
    return base[:-3]


def _check_path(path: str) -> tuple[str, str]:
    """Validated (absolute path, normalized module name) for a module file."""
    if not isinstance(path, str) or not path or "\0" in path or "\n" in path:
        raise NodeagentError(f"invalid module file path {path!r}")
    return os.path.abspath(path), validate_module_name(_name_from_path(path))


def _check_params(params: Sequence[str]) -> list[str]:
    if isinstance(params, str):
        raise NodeagentError(f"module parameters must be a sequence of strings, not {params!r}")
    return [validate_module_param(p) for p in params]


def _syscall_fn() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.syscall
    fn.restype = ctypes.c_long
    return fn


def insert_module_fd(fd: int, name: str, params: Sequence[str]) -> None:
    """finit_module(2) on ``fd``; ModuleOpError with the kernel's errno on refusal.

    A compressed module is offered to the kernel as such first; a kernel that
    cannot decompress (EINVAL/EOPNOTSUPP for the flag) gets the image this
    process decompresses from the same descriptor, through init_module(2).
    """
    from nodeagent.host.modfile import ModuleFileError, module_image_fd

    name = validate_module_name(name)
    options = " ".join(_check_params(params)).encode()
    numbers = _SYSCALLS.get(os.uname().machine)
    if numbers is None:
        raise ModuleOpError(
            "load", name, errno_mod.ENOSYS, f"no syscall table for {os.uname().machine}"
        )
    finit_nr, init_nr = numbers
    syscall = _syscall_fn()
    head = os.pread(fd, 6, 0)
    compressed = head.startswith(_COMPRESSED_MAGIC)
    rc = syscall(
        ctypes.c_long(finit_nr),
        ctypes.c_int(fd),
        ctypes.c_char_p(options),
        ctypes.c_int(_MODULE_INIT_COMPRESSED_FILE if compressed else 0),
    )
    err = ctypes.get_errno() if rc < 0 else 0
    if compressed and err in (errno_mod.EINVAL, errno_mod.EOPNOTSUPP):
        try:
            image = module_image_fd(fd, f"{name}.ko")
        except ModuleFileError as exc:
            raise ModuleOpError("load", name, errno_mod.ENOEXEC, str(exc)) from None
        writable = image if isinstance(image, bytearray) else bytearray(image)
        buf = (ctypes.c_char * len(writable)).from_buffer(writable)  # no copy of the image
        rc = syscall(
            ctypes.c_long(init_nr), buf, ctypes.c_ulong(len(buf)), ctypes.c_char_p(options)
        )
        err = ctypes.get_errno() if rc < 0 else 0
    if err:
        raise ModuleOpError("load", name, err, f"from descriptor {fd}")


def _check_moddir(moddir: str) -> str:
    if not isinstance(moddir, str) or not moddir or "\0" in moddir:
        raise NodeagentError(f"invalid module directory {moddir!r}")
    return os.path.abspath(moddir)


# ---------------------------------------------------------------- libkmod


class _Lib:
    """The libkmod functions used, with their C signatures."""

    def __init__(self, libname: str) -> None:
        lib = ctypes.CDLL(libname, use_errno=True)
        vp, cp, ci, cu = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint
        pvp = ctypes.POINTER(ctypes.c_void_p)

        def fn(name: str, res: Any, *args: Any) -> Any:
            f = getattr(lib, name)
            f.restype = res
            f.argtypes = list(args)
            return f

        self.print_action_t = ctypes.CFUNCTYPE(None, vp, ctypes.c_bool, cp)
        self.kmod_new = fn("kmod_new", vp, cp, ctypes.POINTER(cp))
        self.kmod_unref = fn("kmod_unref", vp, vp)
        self.kmod_set_log_priority = fn("kmod_set_log_priority", None, vp, ci)
        self.new_from_path = fn("kmod_module_new_from_path", ci, vp, cp, pvp)
        self.new_from_name = fn("kmod_module_new_from_name", ci, vp, cp, pvp)
        self.new_from_lookup = fn("kmod_module_new_from_lookup", ci, vp, cp, pvp)
        self.list_next = fn("kmod_list_next", vp, vp, vp)
        self.module_get_module = fn("kmod_module_get_module", vp, vp)
        self.module_unref_list = fn("kmod_module_unref_list", ci, vp)
        self.module_unref = fn("kmod_module_unref", vp, vp)
        self.module_get_name = fn("kmod_module_get_name", cp, vp)
        self.insert_module = fn("kmod_module_insert_module", ci, vp, cu, cp)
        self.remove_module = fn("kmod_module_remove_module", ci, vp, cu)
        self.probe_insert_module = fn(
            "kmod_module_probe_insert_module", ci, vp, cu, cp, vp, vp, self.print_action_t
        )


class LibKmod:
    """``ModuleOps`` through libkmod, keeping the kernel's errno.

    ``config_paths``: modprobe.d-style files/directories libkmod reads for
    ``probe`` (``options`` lines); ``()`` (the default) reads none,
    ``None`` lets libkmod use its built-in defaults (``/etc/modprobe.d`` ...
    of *this* mount namespace, which in a pod is not the host's). ``softdep``
    lines have no effect: libkmod drops softdeps along with install commands.
    A fresh libkmod context per call: libkmod contexts are not thread-safe.
    """

    def __init__(
        self, libname: str = "libkmod.so.2", config_paths: Sequence[str] | None = ()
    ) -> None:
        self._lib = _Lib(libname)  # OSError/AttributeError when libkmod is absent or too old
        self._config: list[bytes] | None = (
            None if config_paths is None else [os.fsencode(p) for p in config_paths]
        )

    def _ctx(self, op: str, module: str, moddir: str | None) -> int:
        cfg = None
        if self._config is not None:
            arr = (ctypes.c_char_p * (len(self._config) + 1))(*self._config, None)
            cfg = ctypes.cast(arr, ctypes.POINTER(ctypes.c_char_p))
        ctx = self._lib.kmod_new(os.fsencode(moddir) if moddir else None, cfg)
        if not ctx:
            raise ModuleOpError(
                op, module, ctypes.get_errno() or errno_mod.ENOMEM, "kmod_new failed"
            )
        self._lib.kmod_set_log_priority(ctx, 0)  # errors come back as errno, not stderr lines
        return int(ctx)

    def _module(self, op: str, module: str, ctx: int, *, path: str | None = None) -> int:
        mod = ctypes.c_void_p()
        if path is not None:
            rc = self._lib.new_from_path(ctx, os.fsencode(path), ctypes.byref(mod))
        else:
            rc = self._lib.new_from_name(ctx, module.encode(), ctypes.byref(mod))
        if rc < 0 or not mod.value:
            err = -rc if rc < 0 else errno_mod.ENOMEM
            raise ModuleOpError(op, module, err, path)
        return mod.value

    def _lookup(self, op: str, name: str, ctx: int, moddir: str) -> list[int]:
        """The modules ``name`` stands for (a module name or an alias); ENOENT when none."""
        head = ctypes.c_void_p()
        rc = self._lib.new_from_lookup(ctx, name.encode(), ctypes.byref(head))
        mods: list[int] = []
        try:
            entry = head.value
            while entry and rc == 0:
                mod = self._lib.module_get_module(entry)
                if mod:
                    mods.append(int(mod))
                entry = self._lib.list_next(head, entry)
        finally:
            if head.value:
                self._lib.module_unref_list(head)
        if rc < 0 or not mods:
            for mod in mods:
                self._lib.module_unref(mod)
            err = -rc if rc < 0 else errno_mod.ENOENT
            raise ModuleOpError(op, name, err, f"not found in {moddir}")
        return mods

    def insert_file(self, path: str, params: Sequence[str]) -> None:
        abspath, name = _check_path(path)
        options = " ".join(_check_params(params))
        ctx = self._ctx("load", name, None)
        try:
            mod = self._module("load", name, ctx, path=abspath)
            try:
                rc = self._lib.insert_module(mod, 0, options.encode())
            finally:
                self._lib.module_unref(mod)
        finally:
            self._lib.kmod_unref(ctx)
        if rc:
            raise ModuleOpError("load", name, -rc if rc < 0 else errno_mod.EIO, abspath)

    def insert_fd(self, fd: int, name: str, params: Sequence[str]) -> None:
        insert_module_fd(fd, name, params)  # the syscall itself: libkmod only takes paths

    def remove(self, name: str) -> None:
        name = validate_module_name(name)
        ctx = self._ctx("unload", name, None)
        try:
            mod = self._module("unload", name, ctx)
            try:
                rc = self._lib.remove_module(mod, _KMOD_REMOVE_NOWAIT)
            finally:
                self._lib.module_unref(mod)
        finally:
            self._lib.kmod_unref(ctx)
        if rc == -errno_mod.EWOULDBLOCK:
            # delete_module(O_NONBLOCK) says EWOULDBLOCK (EAGAIN) for a module with
            # holders or references (seen on a real 6.1 kernel); rmmod calls it "in use".
            raise ModuleOpError("unload", name, errno_mod.EBUSY, "in use (EWOULDBLOCK)")
        if rc:
            raise ModuleOpError("unload", name, -rc if rc < 0 else errno_mod.EIO)

    def _probe(
        self, name: str, moddir: str, params: Sequence[str], flags: int
    ) -> list[tuple[str, str]]:
        name = validate_module_name(name)
        options = " ".join(_check_params(params))
        moddir = _check_moddir(moddir)
        actions: list[tuple[str, str]] = []

        def on_action(mod: int | None, install: bool, opts: bytes | None) -> None:
            raw = self._lib.module_get_name(mod) if mod else None
            if isinstance(raw, bytes) and not install:
                text = (opts or b"").decode(errors="replace").strip()
                actions.append((raw.decode(errors="replace"), text))

        callback = self._lib.print_action_t(on_action)
        ctx = self._ctx("probe", name, moddir)
        rc = 0
        flags |= _KMOD_PROBE_IGNORE_COMMAND
        opts = options.encode()
        try:
            # Names and aliases (xprtrdma -> rpcrdma), as modprobe resolves them.
            mods = self._lookup("probe", name, ctx, moddir)
            try:
                for mod in mods:
                    rc = self._lib.probe_insert_module(mod, flags, opts, None, None, callback)
                    if rc and rc != -errno_mod.EEXIST:
                        break
            finally:
                for mod in mods:
                    self._lib.module_unref(mod)
        finally:
            self._lib.kmod_unref(ctx)
        if rc > 0:  # a KMOD_PROBE_APPLY_BLACKLIST* code; no blacklist flag is passed
            raise ModuleOpError("probe", name, errno_mod.EPERM, f"blacklisted ({rc})")
        if rc < 0 and rc != -errno_mod.EEXIST:
            # print_action runs just before each insert: the last one is the module that failed
            where = f"inserting {actions[-1][0]} from {moddir}" if actions else f"from {moddir}"
            raise ModuleOpError("probe", name, -rc, where)
        return actions

    def probe(self, name: str, moddir: str, params: Sequence[str] = ()) -> None:
        self._probe(name, moddir, params, 0)

    def probe_plan(
        self, name: str, moddir: str, params: Sequence[str] = ()
    ) -> tuple[tuple[str, str], ...]:
        """(module, options) ``probe`` would insert, in order: a libkmod dry run.

        Modules already live are left out. ModuleOpError(ENOENT) when ``name``
        is not in ``moddir``'s indexes.
        """
        return tuple(self._probe(name, moddir, params, _KMOD_PROBE_DRY_RUN))


# ---------------------------------------------------------- command line

# (substring of the tool's stderr, errno), first match wins.
_MESSAGE_ERRNO: tuple[tuple[str, int], ...] = (
    ("file exists", errno_mod.EEXIST),
    ("already in kernel", errno_mod.EEXIST),
    ("in use", errno_mod.EBUSY),
    ("unknown symbol", errno_mod.ENOENT),
    ("not currently loaded", errno_mod.ENOENT),
    ("is builtin", errno_mod.ENOENT),  # what delete_module(2) says for a built-in module
    ("not found", errno_mod.ENOENT),
    ("invalid argument", errno_mod.EINVAL),
    ("invalid parameters", errno_mod.EINVAL),
    ("invalid module format", errno_mod.ENOEXEC),
)


def errno_from_message(message: str) -> int:
    """Best-effort errno for an insmod/rmmod/modprobe error message (EIO if unknown)."""
    low = message.lower()
    for needle, err in _MESSAGE_ERRNO:
        if needle in low:
            return err
    for err in sorted(errno_mod.errorcode):
        text = os.strerror(err)
        if not text.startswith("Unknown error") and text.lower() in low:
            return err
    return errno_mod.EIO


def _split_moddir(moddir: str) -> tuple[str, str]:
    """``<root>/lib/modules/<kver>`` -> (root, kver) for ``modprobe -d root -S kver``."""
    p = PurePosixPath(moddir)
    if len(p.parts) < 4 or p.parts[-3:-1] != ("lib", "modules"):
        raise NodeagentError(
            f"module directory {moddir!r} is not of the form <root>/lib/modules/<kernel release>"
        )
    return str(p.parents[2]), p.name


class ModprobeTools:
    """``ModuleOps`` through kmod's command-line tools (fallback when libkmod is absent).

    ``config_paths`` as for LibKmod: ``()`` reads no modprobe.d config
    (``-C /dev/null``), ``None`` the tool's defaults.

    Runs with ``LC_ALL=C`` so messages can be mapped to an errno; a missing
    tool raises ModuleOpError(ENOSYS), a timeout ModuleOpError(ETIMEDOUT).
    """

    def __init__(
        self,
        *,
        insmod: str = "insmod",
        rmmod: str = "rmmod",
        modprobe: str = "modprobe",
        timeout: float = 300.0,
        path: str = "/usr/sbin:/usr/bin:/sbin:/bin",
        config_paths: Sequence[str] | None = (),
    ) -> None:
        self.insmod = insmod
        self.rmmod = rmmod
        self.modprobe = modprobe
        self.timeout = timeout
        self.path = path
        self.config_paths = None if config_paths is None else list(config_paths)

    def _run(self, op: str, module: str, argv: list[str]) -> None:
        exe = shutil.which(argv[0], path=self.path)
        if exe is None:
            raise ModuleOpError(op, module, errno_mod.ENOSYS, f"{argv[0]}: command not found")
        env = {"PATH": self.path, "LC_ALL": "C"}
        try:
            proc = subprocess.run(
                [exe, *argv[1:]],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                errors="replace",
                env=env,
                # The step's deadline when a worker set one: the tool is killed with the step.
                timeout=step_time_left(self.timeout),
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise ModuleOpError(op, module, errno_mod.ETIMEDOUT, f"{argv[0]} timed out") from exc
        except OSError as exc:
            raise ModuleOpError(op, module, exc.errno or errno_mod.EIO, str(exc)) from exc
        if proc.returncode == 0:
            return
        message = (proc.stderr or proc.stdout or "").strip()
        err = errno_from_message(message)
        if op == "probe" and err == errno_mod.EEXIST:
            return
        raise ModuleOpError(op, module, err, message.splitlines()[-1] if message else None)

    def insert_file(self, path: str, params: Sequence[str]) -> None:
        abspath, name = _check_path(path)
        args = _check_params(params)
        self._run("load", name, [self.insmod, abspath, *args])

    def insert_fd(self, fd: int, name: str, params: Sequence[str]) -> None:
        insert_module_fd(fd, name, params)  # insmod takes a path; the syscall takes the fd

    def remove(self, name: str) -> None:
        name = validate_module_name(name)
        self._run("unload", name, [self.rmmod, name])

    def probe(self, name: str, moddir: str, params: Sequence[str] = ()) -> None:
        name = validate_module_name(name)
        args = _check_params(params)
        root, kver = _split_moddir(_check_moddir(moddir))
        # -i: no install commands (nor softdeps); -C: the same config as LibKmod
        if self.config_paths is None:
            config: list[str] = []
        else:
            config = [a for p in self.config_paths or ["/dev/null"] for a in ("-C", p)]
        argv = [self.modprobe, "-i", *config, "-d", root, "-S", kver, name, *args]
        self._run("probe", name, argv)


def default_module_ops() -> ModuleOps:
    """LibKmod when libkmod.so.2 loads, else the command-line tools."""
    try:
        return LibKmod()
    except (OSError, AttributeError):
        return ModprobeTools()
