"""The agent's face: what callers of ``nodeagent.agent`` use, built from keywords.

The loop itself is ``nodeagent/loop/`` (``agent.py`` the run loop,
``passes.py`` the order of a pass and the next wake-up, ``wiring.py`` what it
is built from). This builds one from the keywords tests, benches and tools
have always passed; new code builds through ``loop.wiring.build_agent`` with
one ``HostPorts`` and one ``LoopHooks``.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from nodeagent.config import Config
from nodeagent.core.reconcile import Reconciler
from nodeagent.guards.registry import build_reconciler as build_guard_reconciler
from nodeagent.host.ports import HostPorts
from nodeagent.loop import agent as loop_agent
from nodeagent.loop.passes import PassResult
from nodeagent.loop.records import action_record, superseded_record
from nodeagent.loop.wiring import LoopHooks, SteadyClock, build_agent

__all__ = [
    "Agent",
    "HostPorts",
    "LoopHooks",
    "PassResult",
    "SteadyClock",
    "action_record",
    "build_reconciler",
    "superseded_record",
]


def build_reconciler(cfg: Config) -> Reconciler:
    """Every guard of guards/registry.py with its configured policy."""
    return build_guard_reconciler(cfg.policies, cfg.paths)


def Agent(cfg: Config, **keywords: Any) -> loop_agent.Agent:  # the name callers have used
    """The loop's agent; each keyword is a field of ``HostPorts`` (how the node is reached)
    or of ``LoopHooks`` (how an embedder steps and watches the loop)."""
    ports = {f.name for f in fields(HostPorts)}
    return build_agent(
        cfg,
        HostPorts(**{k: v for k, v in keywords.items() if k in ports}),
        LoopHooks(**{k: v for k, v in keywords.items() if k not in ports}),
    )
