"""Configuration: a TOML file, command-line flags and NODEAGENT_* environment.

Every value is validated here, once; a bad one is a NodeagentError naming the
key and the value. Paths are relative to the host root and may not escape it.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from nodeagent.core import policy as cfgval
from nodeagent.core.labels import DEFAULT_PREFIX, check_prefix
from nodeagent.core.names import is_decimal
from nodeagent.core.paths import HostPaths
from nodeagent.errors import NodeagentError
from nodeagent.guards.registry import GUARDS, entry

__all__ = ["MODES", "Config", "HostPaths", "config_from_mapping", "load_config"]

CONFIG_MAX_BYTES = 1 << 20  # a config is a few hundred bytes; read no more than this

MODES = ("observe", "enforce")


@dataclass(frozen=True)
class LabelsConfig:
    """``[labels]``: node labels through node-feature-discovery's local source."""

    nfd: bool = False  # write the features.d file (deploy/ turns it on)
    prefix: str = DEFAULT_PREFIX  # the labels' namespace
    features_dir: str = "etc/kubernetes/node-feature-discovery/features.d"
    # An agent killed without its clean stop: NFD drops its labels this long after the
    # last write (the file is rewritten when half of it has passed).
    expiry_seconds: float = 600.0


@dataclass(frozen=True)
class NpdConfig:
    """``[npd]``: the files node-problem-detector's plugin reads (deploy/npd/)."""

    enabled: bool = False  # write <state dir>/npd/ (deploy/ turns it on)


@dataclass(frozen=True)
class Config:
    host_root: str = "/"
    mode: str = "observe"
    resync_seconds: float = 30.0
    # A plan step (a module load, a VF write) still running after this is abandoned and
    # reported; the guard's worker moves on. Generous: mlx5/nvidia loads take seconds.
    step_timeout_seconds: float = 120.0
    timeline_max_bytes: int = 4 * 1024 * 1024
    timeline_keep: int = 3
    kmsg: str = "/dev/kmsg"  # the kernel's log device (not under the host root)
    uevents: bool = True
    # HOST:PORT for /metrics, /healthz, /readyz; loopback unless configured; "off": none.
    metrics_address: str = "127.0.0.1:9808"
    journal: bool = True  # records to the host journal (the stderr JSON lines always)
    paths: HostPaths = field(default_factory=HostPaths)
    labels: LabelsConfig = field(default_factory=LabelsConfig)
    npd: NpdConfig = field(default_factory=NpdConfig)
    # Each guard's policy by guard name, parsed by the guard's own entry in guards/registry.py;
    # a guard missing here runs with its default policy.
    policies: Mapping[str, Any] = field(default_factory=dict)

    def policy(self, guard: str) -> Any:
        if guard in self.policies:
            return self.policies[guard]
        return entry(guard).default_policy

    @property
    def liveness_seconds(self) -> float:
        """/healthz fails after this long without a completed pass (3 resyncs, at least 60 s)."""
        return max(60.0, 3 * self.resync_seconds)


def config_from_mapping(data: Mapping[str, Any], base: Config | None = None) -> Config:
    cfg = base or Config()
    guard_names = {e.name for e in GUARDS}
    cfgval.reject_unknown("", data, ({f.name for f in fields(Config)} - {"policies"}) | guard_names)
    changes: dict[str, Any] = {}
    if "host_root" in data:
        changes["host_root"] = _host_root(data["host_root"])
    if "mode" in data:
        changes["mode"] = _mode(data["mode"])
    if "resync_seconds" in data:
        changes["resync_seconds"] = cfgval.number(
            "resync_seconds", data["resync_seconds"], 0.05, 86400
        )
    if "step_timeout_seconds" in data:
        changes["step_timeout_seconds"] = cfgval.number(
            "step_timeout_seconds", data["step_timeout_seconds"], 0.05, 3600
        )
    if "timeline_max_bytes" in data:
        changes["timeline_max_bytes"] = cfgval.whole(
            "timeline_max_bytes", data["timeline_max_bytes"], 4096, 1 << 34
        )
    if "timeline_keep" in data:
        changes["timeline_keep"] = cfgval.whole("timeline_keep", data["timeline_keep"], 1, 100)
    if "kmsg" in data:
        if not isinstance(data["kmsg"], str) or not data["kmsg"].startswith("/"):
            raise NodeagentError(f"config kmsg: expected an absolute path, got {data['kmsg']!r}")
        changes["kmsg"] = data["kmsg"]
    for key in ("uevents", "journal"):
        if key in data:
            changes[key] = cfgval.boolean(key, data[key])
    if "metrics_address" in data:
        changes["metrics_address"] = _metrics_address(data["metrics_address"])
    if "paths" in data:
        p = cfgval.table("paths", data["paths"])
        cfgval.reject_unknown("paths", p, {f.name for f in fields(HostPaths)})
        checked = {k: cfgval.check_relpath(f"paths.{k}", v) for k, v in p.items()}
        for key in ("state_dir", "timeline_dir"):
            if key in checked:
                cfgval.check_own_dir(f"paths.{key}", checked[key])
        changes["paths"] = replace(cfg.paths, **checked)
    if "labels" in data:
        changes["labels"] = _labels(cfgval.table("labels", data["labels"]), cfg.labels)
    if "npd" in data:
        t = cfgval.table("npd", data["npd"])
        cfgval.reject_unknown("npd", t, {f.name for f in fields(NpdConfig)})
        if "enabled" in t:
            changes["npd"] = NpdConfig(enabled=cfgval.boolean("npd.enabled", t["enabled"]))
    policies = dict(cfg.policies)
    for e in GUARDS:
        if e.name in data:
            policies[e.name] = e.parse_policy(
                cfgval.table(e.name, data[e.name]), cfg.policy(e.name)
            )
    changes["policies"] = policies
    return replace(cfg, **changes)


def _labels(t: Mapping[str, Any], base: LabelsConfig) -> LabelsConfig:
    cfgval.reject_unknown("labels", t, {f.name for f in fields(LabelsConfig)})
    changes: dict[str, Any] = {}
    if "nfd" in t:
        changes["nfd"] = cfgval.boolean("labels.nfd", t["nfd"])
    if "prefix" in t:
        changes["prefix"] = check_prefix("labels.prefix", t["prefix"])
    if "features_dir" in t:
        changes["features_dir"] = cfgval.check_own_dir(
            "labels.features_dir", cfgval.check_relpath("labels.features_dir", t["features_dir"])
        )
    if "expiry_seconds" in t:
        changes["expiry_seconds"] = cfgval.number(
            "labels.expiry_seconds", t["expiry_seconds"], 60, 7 * 86400
        )
    return replace(base, **changes)


def parse_address(value: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT`` -> (host, port); a one-line error otherwise."""
    host, sep, port = value.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not is_decimal(port) or not 0 < int(port) < 65536:
        raise NodeagentError(f"metrics address {value!r}: expected HOST:PORT, e.g. 127.0.0.1:9808")
    return host, int(port)


def _metrics_address(value: Any) -> str:
    if value == "off":
        return "off"
    if not isinstance(value, str):
        raise NodeagentError(f"metrics address: expected HOST:PORT or 'off', got {value!r}")
    parse_address(value)
    return value


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
                raw = fh.read(CONFIG_MAX_BYTES + 1)
            if len(raw) > CONFIG_MAX_BYTES:
                raise NodeagentError(f"config file {path}: larger than {CONFIG_MAX_BYTES} bytes")
            data = tomllib.loads(raw.decode("utf-8"))
        except FileNotFoundError:
            raise NodeagentError(f"config file {path}: not found") from None
        except OSError as exc:
            raise NodeagentError(f"config file {path}: {exc.strerror or exc}") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise NodeagentError(f"config file {path} does not parse as TOML: {exc}") from None
        except RecursionError:  # tomllib recurses per nesting level
            raise NodeagentError(f"config file {path}: nested too deep to parse") from None
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
