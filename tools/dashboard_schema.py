"""Grafana's dashboard JSON Schema, built offline from npm ``@grafana/schema``, and validation.

``@grafana/schema`` ships only TypeScript types; ``ts-json-schema-generator`` turns its
``Dashboard`` interface into a draft-07 JSON Schema (tooling.md §6). Two variants are built:

* ``loose``: extra properties allowed (what Grafana itself accepts);
* ``strict``: ``additionalProperties: false`` everywhere, which catches misspelled keys. The
  dashboards here write only keys the schema defines, so they pass both.

Everything is cached under ``build/dashboard-schema/`` (git-ignored), keyed by the pinned
versions below; the first build takes ~6 s (npm install ~3.5 s, generation ~2 s per variant).
The Python validator (``jsonschema``) is installed into the same directory with pip when the
environment lacks it. ``python tools/dashboard_schema.py`` validates ``dashboards/*.json``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build" / "dashboard-schema"
GRAFANA_SCHEMA = "@grafana/schema@13.2.3"
GENERATOR = "ts-json-schema-generator@2.9.0"
JSONSCHEMA = "jsonschema==4.26.0"
TYPES = "node_modules/@grafana/schema/dist/types/raw/dashboard/x/types.gen.d.ts"
STAMP = f"{GRAFANA_SCHEMA} {GENERATOR}"


class SchemaUnavailable(RuntimeError):
    """The schema or the validator could not be built (no npm, no registry access)."""


def _run(cmd: list[str], cwd: Path, timeout: int = 300) -> None:
    try:
        result = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SchemaUnavailable(f"{' '.join(cmd)}: {exc}") from exc
    if result.returncode != 0:
        raise SchemaUnavailable(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stderr[-2000:]}")


def schema_path(strict: bool = False) -> Path:
    """Build (once) and return the schema file of the requested variant."""
    path = BUILD / ("dashboard.strict.schema.json" if strict else "dashboard.loose.schema.json")
    stamp = BUILD / "versions"
    if path.exists() and stamp.exists() and stamp.read_text() == STAMP:
        return path
    npm, npx = shutil.which("npm"), shutil.which("npx")
    if npm is None or npx is None:
        raise SchemaUnavailable("npm/npx not found: install Node.js (npm) to build Grafana's dashboard schema")
    BUILD.mkdir(parents=True, exist_ok=True)
    if not (BUILD / TYPES).exists() or not stamp.exists() or stamp.read_text() != STAMP:
        for old in BUILD.glob("dashboard.*.schema.json"):
            old.unlink()
        if not (BUILD / "package.json").exists():
            (BUILD / "package.json").write_text('{"name": "dashboard-schema", "private": true}\n')
        _run([npm, "install", "--no-audit", "--no-fund", "--no-save", GRAFANA_SCHEMA, GENERATOR], BUILD)
    for variant in (False, True):
        out = BUILD / ("dashboard.strict.schema.json" if variant else "dashboard.loose.schema.json")
        cmd = [npx, "--no-install", "ts-json-schema-generator", "--path", TYPES, "--type", "Dashboard", "--no-type-check", "-o", out.name]
        if not variant:
            cmd.append("--additional-properties")
        _run(cmd, BUILD)
    stamp.write_text(STAMP)
    return path


def _jsonschema() -> Any:
    try:
        import jsonschema
    except ImportError:
        # Keyed by interpreter version: jsonschema pulls in a compiled dependency (rpds-py).
        lib = BUILD / f"pylib-py{sys.version_info.major}.{sys.version_info.minor}"
        if not (lib / "jsonschema").exists():
            BUILD.mkdir(parents=True, exist_ok=True)
            _run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--target", str(lib), JSONSCHEMA], ROOT)
        sys.path.insert(0, str(lib))
        import jsonschema
    return jsonschema


def validate(doc: dict[str, Any], strict: bool = False) -> list[str]:
    """Schema errors of one dashboard document, as ``path: message`` strings."""
    jsonschema = _jsonschema()
    schema = json.loads(schema_path(strict).read_text())
    validator = jsonschema.Draft7Validator(schema)
    out = []
    for error in validator.iter_errors(doc):
        # A panel is "Panel or RowPanel" (anyOf): report the deepest error inside the branches
        # (the branch that matched furthest) rather than "not valid under any of the given
        # schemas" for the whole panel.
        while error.context:
            error = max(error.context, key=lambda e: len(e.absolute_path))
        out.append(f"/{'/'.join(map(str, error.absolute_path))}: {error.message[:300]}")
    return sorted(set(out))


def main(argv: list[str]) -> int:
    files = [Path(a) for a in argv] or sorted((ROOT / "dashboards").glob("*.json"))
    bad = 0
    for f in files:
        doc = json.loads(f.read_text())
        for strict in (False, True):
            for err in validate(doc, strict):
                bad += 1
                print(f"{f.name} ({'strict' if strict else 'loose'}): {err}")
    print(f"{len(files)} dashboard(s), {bad} schema error(s)", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
