"""A JSON schema of agent.toml, made from the guards' field tables (core/fields.py) and the
top-level keys config.py reads: the Helm chart's values.schema.json carries it for
``agent.extraConfig``, so a misspelt key or a bad value fails ``helm install`` naming it
instead of CrashLooping every pod. The agent's own check (config.py) stays the authority:
the schema refuses a subset of what it refuses (types, ranges, choices, unknown keys).

    python -m nodeagent.config_schema            print the schema
    python -m nodeagent.config_schema --chart    write it into the chart's values.schema.json
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from nodeagent.config import MODES, LabelsConfig, NpdConfig
from nodeagent.core import applicability, peermem, sriov, storage
from nodeagent.core import fields as policy_fields
from nodeagent.core.paths import HostPaths
from nodeagent.guards.registry import GUARDS

Schema = dict[str, Any]
CHART_SCHEMA = Path(__file__).resolve().parent.parent / "deploy/helm/nodeagent/values.schema.json"

STRINGS: Schema = {"type": "array", "items": {"type": "string"}}
_FIXED: dict[Callable[..., Any], Schema] = {
    policy_fields.flag: {"type": "boolean"},
    policy_fields.modules: {
        "type": "array",
        "minItems": 1,
        "items": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,55}$"},
    },
    policy_fields.params: STRINGS,
    policy_fields.paths: STRINGS,
    applicability.parse_enabled: {"enum": list(applicability.ENABLED_CHOICES)},
}
# Each guard's [<guard>] table (guards/registry.py names the guards).
POLICY_TABLES: dict[str, Sequence[policy_fields.Setting]] = {
    "peermem": peermem.POLICY_FIELDS,
    "storage": storage.POLICY_FIELDS,
    "sriov": sriov.POLICY_FIELDS,
}
# A guard's own parser: what its value must be at least (the agent checks the rest).
_OWN: dict[tuple[str, str], Schema] = {
    ("storage", "hold_file"): {"type": "string", "pattern": "\\.conf$"},
    ("peermem", "hold_containers"): {"type": "array"},
}


def _closure(parse: Callable[..., Any]) -> dict[str, Any]:
    code = getattr(parse, "__code__", None)
    cells = getattr(parse, "__closure__", None) or ()
    return (
        dict(zip(code.co_freevars, (c.cell_contents for c in cells), strict=True)) if code else {}
    )


def setting_schema(section: str, setting: policy_fields.Setting) -> Schema:
    """What ``setting``'s parser accepts, as JSON schema; ValueError for a parser it does not
    know (a new kind of field: say here what it takes)."""
    parse = setting.parse
    if parse in _FIXED:
        return dict(_FIXED[parse])
    if (section, setting.key) in _OWN:
        return dict(_OWN[section, setting.key])
    made_by = getattr(parse, "__qualname__", "").split(".<locals>")[0]
    bound = _closure(parse)
    if made_by in ("number", "whole"):
        kind = "number" if made_by == "number" else "integer"
        return {"type": kind, "minimum": bound["lo"], "maximum": bound["hi"]}
    if made_by == "one_of":
        return {"enum": list(bound["options"])}
    raise ValueError(f"config_schema: no schema for {section}.{setting.key} ({made_by or parse})")


def table(properties: dict[str, Schema]) -> Schema:
    return {"type": "object", "additionalProperties": False, "properties": properties}


def guard_table(section: str, settings: Sequence[policy_fields.Setting]) -> Schema:
    return table({s.key: setting_schema(section, s) for s in settings})


def _top_level() -> dict[str, Schema]:
    """config.py's own keys (config_from_mapping), in its order."""
    seconds: Schema = {"type": "number"}
    return {
        "host_root": {"type": "string", "minLength": 1},
        "mode": {"enum": list(MODES)},
        "resync_seconds": {**seconds, "minimum": 0.05, "maximum": 86400},
        "step_timeout_seconds": {**seconds, "minimum": 0.05, "maximum": 3600},
        "timeline_max_bytes": {"type": "integer", "minimum": 4096, "maximum": 1 << 34},
        "timeline_keep": {"type": "integer", "minimum": 1, "maximum": 100},
        "kmsg": {"type": "string", "pattern": "^/"},
        "uevents": {"type": "boolean"},
        "journal": {"type": "boolean"},
        "metrics_address": {"type": "string", "pattern": "^(off|.+:[0-9]{1,5})$"},
        "paths": table({f.name: {"type": "string"} for f in fields(HostPaths)}),
        "labels": table(
            {
                "nfd": {"type": "boolean"},
                "prefix": {"type": "string", "minLength": 1, "maxLength": 253},
                "features_dir": {"type": "string"},
                "expiry_seconds": {**seconds, "minimum": 60, "maximum": 7 * 86400},
            }
        ),
        "npd": table({"enabled": {"type": "boolean"}}),
    }


def agent_toml_schema() -> Schema:
    """agent.toml, every key the agent reads, each as config.py and the field tables take it."""
    properties = _top_level()
    for guard in GUARDS:
        properties[guard.name] = guard_table(guard.name, POLICY_TABLES[guard.name])
    return {
        "description": "more agent.toml keys (docs/configuration.md), in its own spelling: "
        "made from the agent's field tables by python -m nodeagent.config_schema --chart",
        **table(properties),
    }


# The tables config.py reads through dataclasses: the schema's keys for them must be theirs.
TABLE_DATACLASSES = {"paths": HostPaths, "labels": LabelsConfig, "npd": NpdConfig}


def chart_schema_with(values_schema: Schema) -> Schema:
    """The chart's values schema with agent.extraConfig made from the field tables."""
    agent = values_schema["properties"]["agent"]["properties"]
    agent["extraConfig"] = agent_toml_schema()
    return values_schema


def main(argv: Sequence[str]) -> int:
    if list(argv) == ["--chart"]:
        values = json.loads(CHART_SCHEMA.read_text())
        CHART_SCHEMA.write_text(json.dumps(chart_schema_with(values), indent=2) + "\n")
        return 0
    if argv:
        print(__doc__, file=sys.stderr)
        return 2
    print(json.dumps(agent_toml_schema(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
