"""The package's layers import downwards only (issue #24): ops/ (kernels) and ipc/ (wire types)
need nothing above them, core/ (the engine) never reaches for the processes, the API or the
sentinels that host it, and ``bastion serve`` needs nothing from the command that dispatches
to it. Every import counts, module-level or inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# layer -> packages of bastion it may import
ALLOWED = {
    "ops": {"ops", "envs"},
    "ipc": {"ipc"},
    "core": {"core", "ops", "ipc", "envs"},
}


def _imports(path: Path) -> set[str]:
    """Every ``bastion.X.Y`` module the file names in an import statement."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return {n for n in names if n.startswith("bastion.")}


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_a_layer_imports_only_the_layers_below_it(layer: str) -> None:
    wrong = {f"{p.relative_to(ROOT)}: {name}"
             for p in (ROOT / layer).rglob("*.py") for name in _imports(p)
             if name.split(".")[1] not in ALLOWED[layer]}
    assert sorted(wrong) == []


def test_serve_does_not_import_the_cli() -> None:
    assert not {n for n in _imports(ROOT / "procs" / "serve.py")
                if n.startswith("bastion.procs.cli")}
