#!/usr/bin/env python3
"""Regenerate the values table in deploy/helm/nodeagent/README.md from values.yaml (each key's
default and the comment lines above it) and values.schema.json (its type).

  scripts/chart-readme.py          rewrite the table between the markers
  scripts/chart-readme.py --check  exit 1 naming the README when the table is stale
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

CHART = Path(__file__).resolve().parent.parent / "deploy" / "helm" / "nodeagent"
BEGIN = "<!-- values-table: begin (scripts/chart-readme.py writes this) -->"
END = "<!-- values-table: end -->"
KEY_LINE = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z0-9_.-]+):(?P<rest>.*)$")


def schema_type(schema: dict[str, Any], path: list[str]) -> str:
    node: dict[str, Any] = schema
    for key in path:
        node = node.get("properties", {}).get(key, {})
    kind = node.get("type", "")
    if "enum" in node:
        return " \\| ".join(json.dumps(v) for v in node["enum"])
    return kind if isinstance(kind, str) else " \\| ".join(kind)


def rows(values_text: str, schema: dict[str, Any]) -> list[str]:
    values = yaml.safe_load(values_text)
    stack: list[tuple[int, str]] = []
    comments: list[str] = []
    out = []
    for line in values_text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            comments.append(stripped.lstrip("#").strip())
            continue
        match = KEY_LINE.match(line)
        if not match:
            comments = []
            continue
        indent = len(match["indent"])
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, match["key"]))
        path = [key for _, key in stack]
        value: Any = values
        for key in path:
            value = value[key] if isinstance(value, dict) else None
        if not isinstance(value, dict) or not value:
            rest = match["rest"].split(" #", 1)
            inline = rest[1].strip() if len(rest) > 1 else ""
            text = " ".join(c for c in [*comments, inline] if c).replace("|", "\\|")
            default = json.dumps(value).replace("|", "\\|")
            out.append(
                f"| `{'.'.join(path)}` | {schema_type(schema, path)} | `{default}` | {text} |"
            )
        comments = []
    return out


def table() -> str:
    schema = json.loads((CHART / "values.schema.json").read_text())
    lines = ["| Key | Type | Default | Description |", "|---|---|---|---|"]
    return "\n".join(lines + rows((CHART / "values.yaml").read_text(), schema))


def regenerated(readme: str) -> str:
    head, _, rest = readme.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return f"{head}{BEGIN}\n{table()}\n{END}{tail}"


def main(argv: list[str]) -> int:
    readme_path = CHART / "README.md"
    readme = readme_path.read_text()
    if BEGIN not in readme or END not in readme:
        print(f"{readme_path}: the values-table markers are missing", file=sys.stderr)
        return 1
    new = regenerated(readme)
    if argv[1:] == ["--check"]:
        if new != readme:
            print(
                f"{readme_path}: the values table is stale; run scripts/chart-readme.py",
                file=sys.stderr,
            )
            return 1
        return 0
    readme_path.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
