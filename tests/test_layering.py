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


def _named_modules(path: Path, with_members: bool) -> set[str]:
    """The modules the file's absolute import statements name (``with_members``: and each
    ``from M import x`` as ``M.x``, which may be a module)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            if with_members:
                names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def _imports(path: Path) -> set[str]:
    """Every ``bastion.X.Y`` module the file names in an import statement."""
    return {n for n in _named_modules(path, True) if n.startswith("bastion.")}


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_a_layer_imports_only_the_layers_below_it(layer: str) -> None:
    wrong = {f"{p.relative_to(ROOT)}: {name}"
             for p in (ROOT / layer).rglob("*.py") for name in _imports(p)
             if name.split(".")[1] not in ALLOWED[layer]}
    assert sorted(wrong) == []


def test_serve_does_not_import_the_cli() -> None:
    assert not {n for n in _imports(ROOT / "procs" / "serve.py")
                if n.startswith("bastion.procs.cli")}


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    return ".".join(("bastion", *parts))


def _in_a_cycle(graph: dict[str, set[str]]) -> list[str]:
    """The modules from which an import path leads back to themselves."""
    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), list(graph[start])
        while todo:
            name = todo.pop()
            if name == goal:
                return True
            if name not in seen:
                seen.add(name)
                todo.extend(graph.get(name, ()))
        return False

    return sorted(m for m in graph if reaches(m, m))


def test_procs_and_the_sentinel_import_each_other_in_no_cycle() -> None:
    # The sentinel uses procs' process helpers (lifecycle); procs starts the sentinel process
    # by name (procs/child.py), never by importing it.
    files = [*(ROOT / "procs").rglob("*.py"), *(ROOT / "sentinel").rglob("*.py")]
    modules = {_module(p): p for p in files}
    graph = {m: {n for n in _imports(p) if n in modules and n != m} for m, p in modules.items()}
    assert _in_a_cycle(graph) == []
    assert sorted(f"{m}: {n}" for m, names in graph.items() if m.startswith("bastion.procs")
                  for n in names if n.startswith("bastion.sentinel")) == []


def _all_imports(path: Path) -> set[str]:
    """The top-level package of every module the file imports, and its bastion modules."""
    return {n if n.startswith("bastion.") else n.split(".")[0]
            for n in _named_modules(path, False)}


# The engine client's pieces (issue #24) and what each may import: routing and hold/resume are
# pure bookkeeping (no sockets, processes or event loop), so they are tested without either.
CLIENT_PIECES = {
    "router": {"__future__", "collections", "bastion.ipc.messages"},
    "holds": {"__future__", "dataclasses", "itertools", "typing", "msgspec",
              "bastion.ipc.messages"},
    "utility_calls": {"__future__", "asyncio", "collections", "itertools",
                      "bastion.ipc.messages"},
    "streams": {"__future__", "asyncio", "collections", "dataclasses", "time",
                "bastion.core.output_processor", "bastion.ipc.messages",
                "bastion.procs.client.holds"},
    "supervisor": {"__future__", "asyncio", "time", "uuid", "msgspec", "zmq",
                   "bastion.core.config", "bastion.ipc.codec", "bastion.ipc.control",
                   "bastion.procs.lifecycle"},
}


def test_each_engine_client_piece_imports_only_what_its_job_needs() -> None:
    pieces = {p.stem for p in (ROOT / "procs" / "client").glob("*.py")} - {"__init__"}
    assert pieces == set(CLIENT_PIECES)
    wrong = {f"{piece}: {name}" for piece, allowed in CLIENT_PIECES.items()
             for name in _all_imports(ROOT / "procs" / "client" / f"{piece}.py") - allowed}
    assert sorted(wrong) == []
