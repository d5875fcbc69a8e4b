"""klppo's structure, read from its imports with `ast`: packages import only their own layer or the layers
below (docs/architecture.md, "Layers"), and no module imports itself through others. Module-level and
function-level imports both count; imports under ``if TYPE_CHECKING:`` do not (they never run)."""

from __future__ import annotations

import ast
from pathlib import Path

import klppo

ROOT = Path(klppo.__file__).parent

LAYERS: list[set[str]] = [
    {"cli", "commands", "trainer.main_ppo"},  # entry points
    {"trainer"},  # the loop
    {"assembly"},  # config → settings → roles, engine, loaders
    {
        "ops"
    },  # monitor, rules, profiler, lock, stopping, non-finite handling, checkpoints of the trainer state
    {"tune"},  # memory model and sweeps (it receives settings)
    {"agent"},  # multi-turn conversations over a rollout engine, tools and interactions
    {"roles", "rollout"},
    {"parallel", "rewards", "tools", "tracking", "report", "data"},
    {"batching", "config"},
    {"models"},
    {"algorithms", "batch"},
    {""},  # klppo/__init__.py
]
"""Top to bottom. A module's unit is its most specific entry here: ``klppo.trainer.main_ppo`` (verl's
entry-point name) is an entry point, the rest of ``klppo.trainer`` the loop."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skip


def import_graph() -> dict[str, set[str]]:
    """Module → the klppo modules (or packages) it imports, at any depth of its code."""
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        skip = _type_checking_nodes(tree)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if a.name.split(".")[0] == "klppo"}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                if module.split(".")[0] != "klppo":
                    continue
                for alias in node.names:
                    full = f"{module}.{alias.name}"
                    targets.add(full if full in modules else module)
        graph[name] = {t for t in targets if t != name}
    return graph


def layer_of(module: str) -> int:
    """Index in LAYERS of the most specific unit that holds ``module`` (``klppo.x.y``)."""
    rest = module.removeprefix("klppo").removeprefix(".")
    best, best_len = None, -1
    for index, units in enumerate(LAYERS):
        for unit in units:
            if (rest == unit or rest.startswith(unit + ".") or unit == "") and len(unit) > best_len:
                best, best_len = index, len(unit)
    assert best is not None, module
    return best


def test_every_package_has_a_layer() -> None:
    packages = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    packages |= {p.stem for p in ROOT.glob("*.py") if p.stem != "__init__"}
    named = {unit.split(".")[0] for units in LAYERS for unit in units if unit}
    assert packages <= named, f"give these a layer in LAYERS and docs/architecture.md: {packages - named}"


def test_imports_point_down_only() -> None:
    wrong = [
        f"{a} ({layer_of(a)}) imports {b} ({layer_of(b)})"
        for a, targets in import_graph().items()
        for b in targets
        if layer_of(b) < layer_of(a)
    ]
    assert not wrong, "imports against the layer order:\n" + "\n".join(sorted(wrong))


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (as a path that ends where it starts), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph:
                continue
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_find_cycle_finds_a_circle_and_only_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_circle() -> None:
    graph = import_graph()
    # a package's __init__ that re-exports its modules is not a circle through them
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " → ".join(cycle)
