"""Log output: logfmt (the default, as Prometheus' own exporters write it) or JSON, one record per line.

Messages carry text from the scratch tree (kernel directory names, paths), so the logfmt writer
escapes everything that could forge a key, split a line or reorder what a terminal shows:
backslash and double quote, every C0/C1 control character and DEL, and the Unicode bidi controls.
"""

from __future__ import annotations

import json
import logging
import re
import sys

__all__ = ["logfmt_value", "setup_logging"]

# C0 controls, DEL, C1 controls, and the bidi embedding/override/isolate marks (U+061C, U+200E,
# U+200F, U+202A-U+202E, U+2066-U+2069) plus the line and paragraph separators.
_UNSAFE = re.compile("[\\\\\"\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_SHORT = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def logfmt_value(text: str) -> str:
    """``text`` as a double-quoted logfmt value: safe on one line, unambiguous to a parser."""
    return '"' + _UNSAFE.sub(lambda m: _SHORT.get(m.group(0)) or f"\\u{ord(m.group(0)):04x}", text) + '"'


def setup_logging(level: str, fmt: str) -> None:
    """Send every log record to stderr as ``logfmt`` or ``json`` at ``level``."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter() if fmt == "json" else _LogfmtFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # watchdog logs every overflow at WARNING; the watcher reports it itself.
    logging.getLogger("watchdog").setLevel(logging.ERROR)


class _LogfmtFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = (f'ts={self.formatTime(record, "%Y-%m-%dT%H:%M:%S")} level={record.levelname.lower()} '
                f"logger={record.name} msg={logfmt_value(record.getMessage())}")
        if record.exc_info:
            line += " exc=" + logfmt_value(self.formatException(record.exc_info))
        return line


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        # json.dumps escapes control characters; ensure_ascii also escapes the bidi marks.
        doc = {"ts": record.created, "level": record.levelname.lower(), "logger": record.name, "msg": record.getMessage()}
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc)
