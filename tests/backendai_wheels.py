"""Released Backend.AI wheels as a test-only input: fetched, unpacked and made importable here.

The differential tests (``tests/analysis/test_agent_differential.py`` for the agent's allocator,
``tests/analysis/test_manager_differential.py`` for the manager's agent selectors) run the released
code side by side with the exporter's. The wheels are downloaded by ``pip download`` into pytest's
cache folder (or the folder an environment variable names), never into the repository. They need
Python 3.13; :func:`to_py311` rewrites their 3.12+ syntax mechanically so Python 3.11 imports the
few modules a test copies out of them.

No network, no test: a failed download fails the test, loudly, unless the test's skip variable is
set to 1 (offline local runs only).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

__all__ = ["TYPING_SHIM", "extract", "fetch_wheel", "to_py311", "wheels_folder"]


def fetch_wheel(cache: Path, requirement: str, pattern: str, skip_env: str) -> Path:
    """The wheel matching ``pattern`` in ``cache``, downloaded first when absent (pure-Python
    wheels for Python 3.13, no dependencies). A failed download fails the calling test, or skips
    it where ``skip_env`` is set to 1."""
    found = sorted(cache.glob(pattern))
    if found:
        return found[0]
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.13",
               "--disable-pip-version-check", "-q", "-d", str(cache), requirement]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
        why = (done.stderr or done.stdout).strip().splitlines()[-1:] if done.returncode else []
    except (OSError, subprocess.TimeoutExpired) as exc:
        why = [str(exc)]
    found = sorted(cache.glob(pattern))
    if not found:
        message = f"cannot download {requirement} from PyPI ({' '.join(why) or 'no wheel'}): the differential test needs it"
        if os.environ.get(skip_env) == "1":
            pytest.skip(f"{message}; skipped because {skip_env}=1")
        pytest.fail(f"{message}; set {skip_env}=1 to skip it offline", pytrace=False)
    return found[0]


def wheels_folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, env: str, name: str) -> Path:
    """Where the wheels are kept: the folder ``$env`` names, else pytest's cache folder ``name``."""
    if os.environ.get(env):
        path = Path(os.environ[env])
        path.mkdir(parents=True, exist_ok=True)
        return path
    cache = getattr(request.config, "cache", None)
    return cache.mkdir(name) if cache is not None else tmp_path_factory.mktemp(name)


_ALIAS = re.compile(r"^(?P<indent>[ \t]*)type\s+(?P<name>\w+)\s*(?:\[[^\]]*\])?\s*=", re.M)
_TYPE_PARAMS = re.compile(r"\b(?:def|class)\s+\w+\[")


def to_py311(text: str) -> str:
    """PEP 695 (``type X = ...``, ``def f[T](...)``, ``class C[T](...)``) rewritten to 3.11 syntax,
    and ``typing`` imports taken from a shim that adds ``override`` (3.12+)."""
    text = _ALIAS.sub(lambda m: f"{m['indent']}{m['name']} =", text)
    out, pos = [], 0
    for m in _TYPE_PARAMS.finditer(text):
        depth, end = 0, m.end() - 1
        while True:
            depth += {"[": 1, "]": -1}.get(text[end], 0)
            end += 1
            if depth == 0:
                break
        out.append(text[pos : m.end() - 1])
        pos = end
    out.append(text[pos:])
    return re.sub(r"^from typing import ", "from _typing311 import ", "".join(out), flags=re.M)


# Saved as ``_typing311.py`` next to the rewritten modules (see :func:`to_py311`).
TYPING_SHIM = '''import typing

globals().update({name: getattr(typing, name) for name in dir(typing) if not name.startswith("__")})
if not hasattr(typing, "override"):
    def override(method):
        return method
'''


def extract(source: str, names: set[str], header: str) -> str:
    """The top-level definitions ``names`` of ``source`` (assignments and classes, with their
    decorators), verbatim, after ``header``; fails when one of them is not in the released source."""
    text = to_py311(source)
    lines = text.splitlines()
    parts, found = [header], set()
    for node in ast.parse(text).body:
        targets = {t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)}
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            targets.add(node.target.id)
        hits = ({node.name} if getattr(node, "name", None) in names else set()) | (targets & names)
        if hits:
            first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
            parts.append("\n".join(lines[first - 1 : node.end_lineno]))
            found |= hits
    assert not names - found, f"not in the released source: {names - found}"
    return "\n\n\n".join(parts) + "\n"
