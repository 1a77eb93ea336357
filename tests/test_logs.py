"""Log lines stay one record each and cannot be forged by names from the scratch tree."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from exporter.logs import _JsonFormatter, _LogfmtFormatter, logfmt_value

# What a kernel directory name (or anything else under the scratch root) may smuggle in.
HOSTILE = ['a" evil=1 msg="x', "back\\slash\\", "cr\rlf\nnul\x00", "esc\x1b[31mred", "rlo\u202egnp.exe", "del\x7f c1\x85",
           "sep\u2028\u2029", "tab\there"]
LINE = re.compile(r'^ts=\S+ level=\w+ logger=\S+ msg="((?:[^"\\]|\\.)*)"$')


def unescape(value: str) -> str:
    return re.sub(r'\\(u[0-9a-f]{4}|.)', lambda m: chr(int(m.group(1)[1:], 16)) if len(m.group(1)) == 5
                  else {"n": "\n", "r": "\r", "t": "\t"}.get(m.group(1), m.group(1)), value)


@pytest.mark.parametrize("text", HOSTILE)
def test_logfmt_lines_hold_one_message_and_round_trip(text: str) -> None:
    record = logging.LogRecord("exporter.scratch.reader", logging.WARNING, __file__, 1, "kernel %s: bad", (text,), None)
    line = _LogfmtFormatter().format(record)
    m = LINE.match(line)
    assert m, line
    assert all(c.isprintable() and c not in "\u202e\u2028\u2029" for c in line)
    assert unescape(m.group(1)) == f"kernel {text}: bad"


def test_json_lines_escape_everything_too() -> None:
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "%s", ("".join(HOSTILE),), None)
    line = _JsonFormatter().format(record)
    assert "\n" not in line and "\u202e" not in line and json.loads(line)["msg"] == "".join(HOSTILE)


def test_logfmt_value_quotes_plain_text_unchanged() -> None:
    assert logfmt_value("scratch root /var/lib/x") == '"scratch root /var/lib/x"'


def test_a_hostile_kernel_name_cannot_add_keys_to_the_log(tmp_path: Path) -> None:
    """End to end: the exporter's own log of a broken kernel whose directory name carries quotes,
    a backslash, an escape sequence and a right-to-left override."""
    name = 'k\\" evil=1 \x1b[2J\u202e'
    config = tmp_path / name / "config"
    config.mkdir(parents=True)
    (config / "resource.txt").write_text('SCRATCH_SIZE=0m\nMOUNTS=\nSLOTS={"cuda.shares":"1"}\nCUDA.SHARES_SHARES=GPU-a:-1\n')
    out = subprocess.run([sys.executable, "-m", "exporter", "scan", "--scratch.root", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    warnings = [line for line in out.stderr.splitlines() if "level=warning" in line]
    assert warnings, out.stderr
    for line in warnings:
        assert LINE.match(line), line
        assert "\x1b" not in line and "\u202e" not in line
