"""The package layout is the architecture: import rules read from the source, and a README that
names every module.

Data flows one way: the scratch tree and telemetry are read independently, analysis combines them,
metrics render the results and the web layer serves them; ``app``, ``demo`` and ``cli`` wire it
together. Every import counts, function-level and ``TYPE_CHECKING`` ones included.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import ROOT

PACKAGE = ROOT / "exporter"

# Rank of each layer: a module may import its own layer (same group) or a lower rank, never
# sideways or up. scratch and telemetry share a rank but are separate groups, so neither sees the other.
LAYERS = {
    "exporter": 0,  # the package root: only __version__
    "exporter.units": 0,
    "exporter.files": 0,
    "exporter.logs": 0,
    "exporter.foreground": 0,
    "exporter.scratch": 1,
    "exporter.telemetry": 1,
    "exporter.settings": 1,
    "exporter.analysis": 2,
    "exporter.metrics": 3,
    "exporter.web": 4,
    "exporter.config": 5,  # the configuration room: every user input, resolved once
    "exporter.app": 6,
    "exporter.demo": 6,
    "exporter.cli": 7,
    "exporter.__main__": 8,
}
# Third-party libraries that only certain modules may import.
ONLY = {
    "pynvml": {"exporter.telemetry.nvml.binding", "exporter.telemetry.nvml.simulated"},
}
ONLY_LAYERS = {
    "prometheus_client": {"exporter.metrics", "exporter.web"},
    # The configuration is read by the wiring only: data sources and analysis take plain values.
    "exporter.settings": {"exporter.config", "exporter.app", "exporter.cli", "exporter.demo"},
}
# What the serving layers may read of analysis: the read model alone, never a computation.
READ_MODEL = "exporter.analysis.model"
READERS = ("exporter.metrics", "exporter.web")


@dataclass(frozen=True)
class Edge:
    module: str
    file: str  # relative to the package's parent, as a reader would open it
    line: int
    target: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: imports {self.target}"


def module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(package: Path) -> list[Edge]:
    """Every import statement of every module under ``package``, resolved to absolute names."""
    edges = []
    for path in sorted(package.rglob("*.py")):
        module = module_name(path, package)
        file = str(path.relative_to(package.parent))
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges += [Edge(module, file, node.lineno, alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = module.split(".")[: len(module.split(".")) - node.level + (1 if is_pkg else 0)]
                    base = ".".join([*anchor, *([base] if base else [])])
                # "from exporter.telemetry import nvml" imports the submodule exporter.telemetry.nvml.
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    edges.append(Edge(module, file, node.lineno, sub if _is_module(sub, package) else base))
    return edges


def _is_module(name: str, package: Path) -> bool:
    rel = Path(*name.split(".")[1:]) if name.startswith(package.name + ".") else None
    return rel is not None and ((package / rel).with_suffix(".py").exists() or (package / rel / "__init__.py").exists())


def layer(module: str) -> str:
    """The longest LAYERS key that is ``module`` or a package containing it."""
    best = ""
    for key in LAYERS:
        if (module == key or module.startswith(key + ".")) and len(key) > len(best):
            best = key
    if not best:
        raise KeyError(f"{module} belongs to no layer: add it to LAYERS")
    return best


def violations(package: Path) -> list[str]:
    """Every broken rule, each naming the file, the line and the import."""
    name = package.name
    edges = imports(package)
    found = []
    for e in edges:
        top = e.target.split(".")[0]
        if top == name:
            src, dst = layer(e.module), layer(e.target)
            if src != dst and LAYERS[dst] >= LAYERS[src]:
                found.append(f"{e}: {src} may not import {dst} (data flows one way)")
        for lib, allowed in ONLY.items():
            if top == lib and e.module not in allowed:
                found.append(f"{e}: only {', '.join(sorted(allowed))} may import {lib}")
        for lib, layers in ONLY_LAYERS.items():
            if (top == lib or e.target == lib or e.target.startswith(lib + ".")) and layer(e.module) not in layers:
                found.append(f"{e}: only {' and '.join(sorted(layers))} may import {lib}")
        if (layer(e.module) in READERS and e.target.startswith(f"{name}.analysis")
                and e.target != READ_MODEL and e.target != f"{name}.analysis"):
            found.append(f"{e}: {layer(e.module)} reads only {READ_MODEL} of analysis")
    found += [f"import cycle: {' -> '.join(c)}" for c in cycles(edges, name)]
    return found


def cycles(edges: list[Edge], name: str) -> list[list[str]]:
    graph: dict[str, set[str]] = {}
    for e in edges:
        if e.target.split(".")[0] == name and e.target != e.module:
            graph.setdefault(e.module, set()).add(e.target)
    found, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                found.append([*stack[stack.index(nxt):], nxt])
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_the_import_rules_hold() -> None:
    assert violations(PACKAGE) == []


def test_at_most_twelve_modules_sit_at_the_top() -> None:
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 12, top


def test_a_broken_rule_names_the_file_and_the_import(tmp_path: Path) -> None:
    pkg = tmp_path / "exporter"
    for sub in ("scratch", "telemetry", "metrics"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "scratch" / "parser.py").write_text("def f():\n    from exporter.telemetry import probe\n")
    (pkg / "telemetry" / "probe.py").write_text("import pynvml\nfrom exporter.scratch.parser import f\n")
    (pkg / "metrics" / "a.py").write_text("import prometheus_client\nfrom . import b\n")
    (pkg / "metrics" / "b.py").write_text("from exporter.metrics import a\n")
    (pkg / "scratch" / "render.py").write_text("from prometheus_client import Metric\n")
    (pkg / "analysis").mkdir()
    (pkg / "analysis" / "__init__.py").write_text("")
    (pkg / "analysis" / "node.py").write_text("")
    (pkg / "metrics" / "c.py").write_text("from exporter.analysis.node import node_state\n")
    found = violations(pkg)
    assert "exporter/metrics/c.py:1: imports exporter.analysis.node: exporter.metrics reads only exporter.analysis.model of analysis" in found
    assert "exporter/scratch/parser.py:2: imports exporter.telemetry.probe: exporter.scratch may not import exporter.telemetry (data flows one way)" in found
    assert ("exporter/telemetry/probe.py:1: imports pynvml: only exporter.telemetry.nvml.binding, "
            "exporter.telemetry.nvml.simulated may import pynvml") in found
    assert "exporter/telemetry/probe.py:2: imports exporter.scratch.parser: exporter.telemetry may not import exporter.scratch (data flows one way)" in found
    assert "exporter/scratch/render.py:1: imports prometheus_client: only exporter.metrics and exporter.web may import prometheus_client" in found
    assert "import cycle: exporter.metrics.a -> exporter.metrics.b -> exporter.metrics.a" in found
    assert "import cycle: exporter.scratch.parser -> exporter.telemetry.probe -> exporter.scratch.parser" in found


def test_every_module_is_named_in_the_readme() -> None:
    readme = (ROOT / "README.md").read_text()
    modules = sorted(str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py") if p.name != "__init__.py")
    packages = sorted(f"{p.parent.relative_to(ROOT)}/" for p in PACKAGE.rglob("__init__.py") if p.parent != PACKAGE)
    missing = [m for m in modules + packages if f"`{m}`" not in readme]
    assert not missing, f"README's architecture section does not name: {missing}"


@pytest.mark.parametrize("path", sorted(p for p in (ROOT / "docs").glob("*.md")) + [ROOT / "README.md", ROOT / "BENCHMARKS.md"],
                         ids=lambda p: p.name)
def test_paths_named_in_the_docs_exist(path: Path) -> None:
    named = set(re.findall(r"`((?:exporter|tests|bench|tools|deploy|dashboards|alerts|docs)/[\w./-]+)`", path.read_text()))
    missing = sorted(n for n in named if not (ROOT / n.rstrip("/")).exists() and "*" not in n)
    assert not missing, f"{path.name} names paths that do not exist: {missing}"


def test_no_test_module_imports_another() -> None:
    """Shared test code lives in the support modules (helpers, attribution_node, pki, processes,
    docker_fake, e2e/harness, backendai_reference), never in a test module another one imports:
    each test file runs on its own."""
    tests = ROOT / "tests"
    names = {p.stem for p in tests.rglob("test_*.py")}
    found = []
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.relative_to(ROOT)}:{node.lineno}: imports {t}" for t in targets
                      if t.split(".")[-1] in names or t.split(".")[0] in names]
    assert not found
