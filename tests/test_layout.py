"""How klppo's source reads: functions fit on a screen (STYLE's ~60 lines is the habit, 80 the limit), and a
file's header shows what it depends on (imports at the top; a function-level import carries its reason)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import klppo

ROOT = Path(klppo.__file__).parent
MAX_FUNCTION_LINES = 80
MAX_LOCAL_KLPPO_IMPORTS = 10


def _sources() -> list[tuple[Path, ast.Module, list[str]]]:
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        text = path.read_text()
        out.append((path.relative_to(ROOT.parent), ast.parse(text, filename=str(path)), text.splitlines()))
    return out


def long_functions(tree: ast.Module, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int, int]]:
    """(name, first line, number of lines) of every function or method longer than ``limit`` lines."""
    return [
        (node.name, node.lineno, node.end_lineno - node.lineno + 1)
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > limit
    ]


def local_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Imports inside a function body (at any depth)."""
    found = []
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found += [n for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))]
    return list({id(n): n for n in found}.values())


def _is_klppo(node: ast.Import | ast.ImportFrom) -> bool:
    names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
    return any(n == "klppo" or n.startswith("klppo.") for n in names)


def test_no_function_is_longer_than_80_lines() -> None:
    found = [
        f"{path}:{line} {name} ({n} lines)"
        for path, tree, _ in _sources()
        for name, line, n in long_functions(tree)
    ]
    assert not found, "split these functions:\n" + "\n".join(found)


def test_function_level_imports_state_their_reason_and_klppo_ones_are_few() -> None:
    unexplained, klppo_local = [], []
    for path, tree, lines in _sources():
        for node in local_imports(tree):
            line = lines[node.lineno - 1]
            found = re.search(r"#\s*noqa:[^#]*PLC0415\s+(\S.*)$", line)
            reason = found.group(1).strip() if found else ""
            if not reason:
                unexplained.append(f"{path}:{node.lineno}: {line.strip()}")
            if _is_klppo(node):
                klppo_local.append(f"{path}:{node.lineno}")
    assert not unexplained, "move to the top, or add `# noqa: PLC0415  <reason>`:\n" + "\n".join(unexplained)
    assert len(klppo_local) <= MAX_LOCAL_KLPPO_IMPORTS, klppo_local


def test_the_checks_see_what_they_look_for() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    tree = ast.parse(f"def long():\n{body}\n\ndef short():\n    import os\n    from klppo import batch\n")
    assert [name for name, _, _ in long_functions(tree)] == ["long"]
    imports = local_imports(tree)
    assert len(imports) == 2 and [_is_klppo(n) for n in imports] == [False, True]


def test_the_training_step_reads_on_one_screen() -> None:
    """``PPOTrainer.train_step`` (generate → score → gather → advantages → updates) stays within 40 lines."""
    tree = ast.parse((ROOT / "trainer" / "ppo_trainer.py").read_text())
    (step,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "train_step"]
    assert step.end_lineno - step.lineno + 1 <= 40
