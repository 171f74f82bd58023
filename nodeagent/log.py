"""Logs: one JSON object a line on stderr (the pod log; the journal exporter reads records)."""

from __future__ import annotations

import json
import logging
import sys
import time


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": round(record.created, 6),
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(record.created)),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        extra = getattr(record, "record", None)
        if isinstance(extra, dict):
            doc["record"] = {k: v for k, v in extra.items() if k != "evidence"}
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info).splitlines()[-1]
        return json.dumps(doc, default=str, sort_keys=False)


def setup_logging(level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger("nodeagent")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
