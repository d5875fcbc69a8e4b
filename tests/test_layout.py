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
MAX_PARAMETERS = 12


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


def num_parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """The parameters a caller can pass: positional, keyword-only, ``*args`` and ``**kwargs`` (one each); a
    method's ``self`` / ``cls`` is not counted."""
    a = fn.args
    names = [*a.posonlyargs, *a.args]
    bound = 1 if names and names[0].arg in ("self", "cls") else 0
    return len(names) - bound + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)


def _is_triton_kernel(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """``@triton.jit`` (with or without arguments): a kernel's parameters are its launch's pointers,
    strides and constexprs, not options to group."""
    return any("triton.jit" in ast.unparse(d) for d in fn.decorator_list)


def wide_functions(tree: ast.Module, limit: int = MAX_PARAMETERS) -> list[tuple[str, int, int]]:
    """(name, first line, number of parameters) of every function or method, Triton kernels aside, that
    takes more than ``limit`` parameters."""
    return [
        (node.name, node.lineno, num_parameters(node))
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and num_parameters(node) > limit
        and not _is_triton_kernel(node)
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


def test_no_function_takes_more_than_12_parameters() -> None:
    """Options travel as one settings object (a frozen dataclass with a docstring per field), not as a long
    list of keyword arguments; Triton kernels aside."""
    found = [
        f"{path}:{line} {name} ({n} parameters)"
        for path, tree, _ in _sources()
        for name, line, n in wide_functions(tree)
    ]
    assert not found, "group these options in a settings dataclass:\n" + "\n".join(found)


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
    params = ", ".join(f"p{i}" for i in range(MAX_PARAMETERS))
    tree = ast.parse(
        f"def fits(self, {params}): ...\n"
        f"def wide({params}, *, extra): ...\n"
        f"def splat(*args, **kwargs): ...\n"
        f"@triton.jit\ndef kernel({params}, extra): ...\n"
        f"@triton.jit(do_not_specialize=['x'])\ndef kernel2({params}, extra): ...\n"
    )
    assert wide_functions(tree) == [("wide", 2, MAX_PARAMETERS + 1)]


def test_the_training_step_reads_on_one_screen() -> None:
    """``PPOTrainer.train_step`` (generate → score → gather → advantages → updates) stays within 40 lines."""
    tree = ast.parse((ROOT / "trainer" / "ppo_trainer.py").read_text())
    (step,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "train_step"]
    assert step.end_lineno - step.lineno + 1 <= 40
