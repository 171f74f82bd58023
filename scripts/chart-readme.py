#!/usr/bin/env python3
"""Regenerate the values table in deploy/helm/nodeagent/README.md from values.yaml (each key's
default and the comment lines above it) and values.schema.json (its type).

  scripts/chart-readme.py          rewrite the table between the markers
  scripts/chart-readme.py --check  exit 1 naming the README when the table is stale

Every key must say what it is: a key with no comment of its own (above it or inline) is
named, and both modes exit 1. A key's value that spans lines (a list, a map written out) is
one row: the lines inside it are not keys of the chart.
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


def rows(values_text: str, schema: dict[str, Any]) -> tuple[list[str], list[str]]:
    """The table's rows, and the keys that say nothing."""
    values = yaml.safe_load(values_text)
    stack: list[tuple[int, str]] = []
    comments: list[str] = []
    out = []
    undescribed = []
    inside: int | None = None  # the indent of a leaf whose value goes on below it
    for line in values_text.splitlines():
        stripped = line.strip()
        if inside is not None:
            if not stripped or len(line) - len(line.lstrip(" ")) > inside or stripped[0] == "-":
                continue
            inside = None
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
            if not text:
                undescribed.append(".".join(path))
            inside = indent
        comments = []
    return out, undescribed


def table() -> tuple[str, list[str]]:
    schema = json.loads((CHART / "values.schema.json").read_text())
    lines = ["| Key | Type | Default | Description |", "|---|---|---|---|"]
    body, undescribed = rows((CHART / "values.yaml").read_text(), schema)
    return "\n".join(lines + body), undescribed


def regenerated(readme: str) -> tuple[str, list[str]]:
    head, _, rest = readme.partition(BEGIN)
    _, _, tail = rest.partition(END)
    text, undescribed = table()
    return f"{head}{BEGIN}\n{text}\n{END}{tail}", undescribed


def main(argv: list[str]) -> int:
    readme_path = CHART / "README.md"
    readme = readme_path.read_text()
    if BEGIN not in readme or END not in readme:
        print(f"{readme_path}: the values-table markers are missing", file=sys.stderr)
        return 1
    new, undescribed = regenerated(readme)
    for key in undescribed:
        print(f"{CHART / 'values.yaml'}: {key} has no comment saying what it is", file=sys.stderr)
    if argv[1:] == ["--check"]:
        if new != readme:
            print(
                f"{readme_path}: the values table is stale; run scripts/chart-readme.py",
                file=sys.stderr,
            )
            return 1
        return 1 if undescribed else 0
    readme_path.write_text(new)
    return 1 if undescribed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
