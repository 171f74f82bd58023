"""Configuration: a TOML file, command-line flags and NODEAGENT_* environment.

Every value is validated here, once; a bad one is a NodeagentError naming the
key and the value. Paths are relative to the host root and may not escape it.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import PurePosixPath
from typing import Any

from nodeagent.core.names import validate_module_name, validate_module_param
from nodeagent.core.peermem import PeermemPolicy
from nodeagent.errors import NodeagentError

MODES = ("observe", "enforce")


@dataclass(frozen=True)
class HostPaths:
    """Where things are, relative to the host root (``/`` on a node, ``/host`` in the pod)."""

    osrelease: str = "proc/sys/kernel/osrelease"
    sys_module: str = "sys/module"
    mofed_ready: str = "run/mellanox/drivers/.driver-ready"
    mofed_lock: str = "run/mellanox/drivers/.lock"
    mofed_blacklist: str = "etc/modprobe.d/blacklist-ofed-modules.conf"
    validations: str = "run/nvidia/validations"
    mofed_driver_root: str = "run/mellanox/drivers"
    gpu_driver_root: str = "run/nvidia/driver"
    state_dir: str = "run/nodeagent"
    timeline_dir: str = "var/lib/nodeagent"
    journal_socket: str = "run/systemd/journal/socket"


@dataclass(frozen=True)
class Config:
    host_root: str = "/"
    mode: str = "observe"
    resync_seconds: float = 30.0
    timeline_max_bytes: int = 4 * 1024 * 1024
    timeline_keep: int = 3
    kmsg: str = "/dev/kmsg"  # the kernel's log device (not under the host root)
    uevents: bool = True
    # HOST:PORT for /metrics, /healthz, /readyz; loopback unless configured; "off": none.
    metrics_address: str = "127.0.0.1:9808"
    journal: bool = True  # records to the host journal (the stderr JSON lines always)
    paths: HostPaths = field(default_factory=HostPaths)
    peermem: PeermemPolicy = field(default_factory=PeermemPolicy)

    @property
    def liveness_seconds(self) -> float:
        """/healthz fails after this long without a completed pass (3 resyncs, at least 60 s)."""
        return max(60.0, 3 * self.resync_seconds)


def _check_relpath(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise NodeagentError(f"config paths.{key}: expected a non-empty path, got {value!r}")
    p = PurePosixPath(value)
    if p.is_absolute() or ".." in p.parts or "\0" in value:
        raise NodeagentError(
            f"config paths.{key}: {value!r} must be relative to the host root, without '..'"
        )
    return value


def _number(key: str, value: Any, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise NodeagentError(f"config {key}: expected a number, got {value!r}")
    if not lo <= value <= hi:
        raise NodeagentError(f"config {key}: {value!r} is outside {lo}..{hi}")
    return float(value)


def _reject_unknown(section: str, data: Mapping[str, Any], known: set[str]) -> None:
    unknown = sorted(set(data) - known)
    if unknown:
        where = f"[{section}] " if section else ""
        raise NodeagentError(
            f"config {where}has unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})"
        )


def _module_list(key: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise NodeagentError(f"config {key}: expected a non-empty list of module names")
    try:
        return tuple(validate_module_name(v) for v in value)
    except NodeagentError as exc:
        raise NodeagentError(f"config {key}: {exc}") from None


def config_from_mapping(data: Mapping[str, Any], base: Config | None = None) -> Config:
    cfg = base or Config()
    _reject_unknown("", data, {f.name for f in fields(Config)})
    changes: dict[str, Any] = {}
    if "host_root" in data:
        changes["host_root"] = _host_root(data["host_root"])
    if "mode" in data:
        changes["mode"] = _mode(data["mode"])
    if "resync_seconds" in data:
        changes["resync_seconds"] = _number("resync_seconds", data["resync_seconds"], 0.05, 86400)
    if "timeline_max_bytes" in data:
        changes["timeline_max_bytes"] = int(
            _number("timeline_max_bytes", data["timeline_max_bytes"], 4096, 1 << 34)
        )
    if "timeline_keep" in data:
        changes["timeline_keep"] = int(_number("timeline_keep", data["timeline_keep"], 1, 100))
    if "kmsg" in data:
        if not isinstance(data["kmsg"], str) or not data["kmsg"].startswith("/"):
            raise NodeagentError(f"config kmsg: expected an absolute path, got {data['kmsg']!r}")
        changes["kmsg"] = data["kmsg"]
    for key in ("uevents", "journal"):
        if key in data:
            changes[key] = _bool(key, data[key])
    if "metrics_address" in data:
        changes["metrics_address"] = _metrics_address(data["metrics_address"])
    if "paths" in data:
        p = data["paths"]
        if not isinstance(p, Mapping):
            raise NodeagentError("config [paths] must be a table")
        known = {f.name for f in fields(HostPaths)}
        _reject_unknown("paths", p, known)
        changes["paths"] = replace(cfg.paths, **{k: _check_relpath(k, v) for k, v in p.items()})
    if "peermem" in data:
        changes.update(_peermem(data["peermem"], cfg))
    return replace(cfg, **changes)


def _peermem(p: Any, cfg: Config) -> dict[str, Any]:
    if not isinstance(p, Mapping):
        raise NodeagentError("config [peermem] must be a table")
    _reject_unknown(
        "peermem",
        p,
        {"mofed", "load_params", "retry_base_seconds", "retry_max_seconds", "rdma_stack"},
    )
    pol = cfg.peermem
    out: dict[str, Any] = {}
    if "mofed" in p:
        if p["mofed"] not in ("container", "host"):
            raise NodeagentError(
                f"config peermem.mofed: expected 'container' or 'host', got {p['mofed']!r}"
            )
        pol = replace(pol, mofed=p["mofed"])
    if "load_params" in p:
        params = p["load_params"]
        if not isinstance(params, list):
            raise NodeagentError("config peermem.load_params: expected a list of key=value strings")
        try:
            pol = replace(pol, load_params=tuple(validate_module_param(x) for x in params))
        except NodeagentError as exc:
            raise NodeagentError(f"config peermem.load_params: {exc}") from None
    if "retry_base_seconds" in p:
        pol = replace(
            pol,
            retry_base_s=_number("peermem.retry_base_seconds", p["retry_base_seconds"], 0.01, 3600),
        )
    if "retry_max_seconds" in p:
        pol = replace(
            pol,
            retry_max_s=_number("peermem.retry_max_seconds", p["retry_max_seconds"], 0.01, 86400),
        )
    if "rdma_stack" in p:
        pol = replace(pol, rdma_stack=_module_list("peermem.rdma_stack", p["rdma_stack"]))
    out["peermem"] = pol
    return out


def _bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise NodeagentError(f"config {key}: expected true or false, got {value!r}")
    return value


def _metrics_address(value: Any) -> str:
    if value == "off":
        return "off"
    if not isinstance(value, str):
        raise NodeagentError(f"metrics address: expected HOST:PORT or 'off', got {value!r}")
    parse_address(value)
    return value


def parse_address(value: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT`` -> (host, port); a one-line error otherwise."""
    host, sep, port = value.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise NodeagentError(f"metrics address {value!r}: expected HOST:PORT, e.g. 127.0.0.1:9808")
    return host, int(port)


def _host_root(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise NodeagentError(f"host root: expected a directory path, got {value!r}")
    return value


def _mode(value: Any) -> str:
    if value not in MODES:
        raise NodeagentError(f"mode: expected one of {', '.join(MODES)}, got {value!r}")
    return str(value)


def load_config(
    path: str | None = None,
    *,
    host_root: str | None = None,
    mode: str | None = None,
    metrics_address: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> Config:
    """File < environment < flags. Raises NodeagentError with one line on any bad value."""
    env = os.environ if environ is None else environ
    cfg = Config()
    if path is not None:
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except FileNotFoundError:
            raise NodeagentError(f"config file {path}: not found") from None
        except OSError as exc:
            raise NodeagentError(f"config file {path}: {exc.strerror or exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise NodeagentError(f"config file {path} does not parse as TOML: {exc}") from None
        cfg = config_from_mapping(data, cfg)
    if env.get("NODEAGENT_HOST_ROOT"):
        cfg = replace(cfg, host_root=_host_root(env["NODEAGENT_HOST_ROOT"]))
    if env.get("NODEAGENT_MODE"):
        cfg = replace(cfg, mode=_mode(env["NODEAGENT_MODE"]))
    if env.get("NODEAGENT_METRICS_ADDRESS"):
        cfg = replace(cfg, metrics_address=_metrics_address(env["NODEAGENT_METRICS_ADDRESS"]))
    if host_root is not None:
        cfg = replace(cfg, host_root=_host_root(host_root))
    if mode is not None:
        cfg = replace(cfg, mode=_mode(mode))
    if metrics_address is not None:
        cfg = replace(cfg, metrics_address=_metrics_address(metrics_address))
    if not os.path.isdir(cfg.host_root):
        raise NodeagentError(f"host root {cfg.host_root}: not a directory")
    return cfg
