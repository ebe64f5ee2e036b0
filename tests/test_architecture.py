"""The floors hold (docs/architecture.md): every import of every module, read from the source (AST).

    common  <-  broker  <-  {rollout, learner}  <-  app

An import may point down or sideways within its own package, never up; rollout and learner never import
each other; and no module reaches itself again through its imports (no circle), counting the imports
inside functions and under ``TYPE_CHECKING`` too: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"common": 0, "broker": 1, "rollout": 2, "learner": 2, "app": 3}  # folder -> floor
PEERS = {"rollout", "learner"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return "fleetrl." + ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for top in PACKAGES for p in sorted((ROOT / top).rglob("*.py"))}


def imported(path: Path, name: str, modules: dict[str, Path]) -> list[tuple[int, str]]:
    """(line, module) of every fleetrl module ``path`` imports, wherever the import sits."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        found = set()
        for target in targets:
            if not target.startswith("fleetrl."):
                continue
            while target and target not in modules:  # `from pkg import name`: the module that holds it
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
        out += [(node.lineno, t) for t in sorted(found)]
    return out


def floor(module: str) -> tuple[str, int]:
    top = module.split(".")[1]
    return top, PACKAGES[top]


@pytest.fixture(scope="module")
def graph() -> dict[str, list[tuple[int, str]]]:
    modules = all_modules()
    return {name: imported(path, name, modules) for name, path in modules.items()}


def test_the_walk_sees_every_package_and_resolves_imports(graph):
    tops = {m.split(".")[1] for m in graph}
    assert tops == set(PACKAGES)
    assert len(graph) > 150 and sum(len(v) for v in graph.values()) > 500  # the walk really read the code


def against_the_floors(graph: dict[str, list[tuple[int, str]]]) -> list[str]:
    wrong = []
    for module, targets in graph.items():
        top, level = floor(module)
        for line, target in targets:
            ttop, tlevel = floor(target)
            if tlevel > level or (top != ttop and {top, ttop} == PEERS):
                wrong.append(f"{module}:{line} imports {target} ({top} -> {ttop})")
    return wrong


def circles(graph: dict[str, list[tuple[int, str]]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for _, w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_points_up_a_floor_or_between_peers(graph):
    wrong = against_the_floors(graph)
    assert wrong == [], "imports against the floors (docs/architecture.md):\n" + "\n".join(wrong)


def test_no_import_circle(graph):
    found = circles(graph)
    assert found == [], "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_common_names_no_component_by_string():
    """``common`` knows no component: not even a ``fleetrl.rollout.x:fn`` string to import later."""
    named = []
    for path in sorted((ROOT / "common").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value.strip()
                if (
                    text.startswith(("fleetrl.broker", "fleetrl.rollout", "fleetrl.learner", "fleetrl.app"))
                    and " " not in text
                ):
                    named.append(f"{path.relative_to(ROOT)}:{node.lineno}: {text}")
    assert named == []


def test_the_walk_catches_what_it_should(tmp_path):
    """The checks can fail: an upward import, a peer import and a circle in a made-up tree are all found."""
    fake = {
        "fleetrl.common.a": "from fleetrl.broker import b\n",
        "fleetrl.broker.b": "import fleetrl.common.a\n",
        "fleetrl.rollout.c": "def f():\n    from fleetrl.learner.d import x\n",
        "fleetrl.learner.d": "x = 1\n",
    }
    paths = {}
    for name, src in fake.items():
        p = tmp_path / (name.replace(".", "_") + ".py")
        p.write_text(src)
        paths[name] = p
    fake_graph = {name: imported(p, name, paths) for name, p in paths.items()}
    assert against_the_floors(fake_graph) == [
        "fleetrl.common.a:1 imports fleetrl.broker.b (common -> broker)",  # up a floor
        "fleetrl.rollout.c:2 imports fleetrl.learner.d (rollout -> learner)",  # between peers, inside a function
    ]
    assert circles(fake_graph) == [["fleetrl.broker.b", "fleetrl.common.a"]]
