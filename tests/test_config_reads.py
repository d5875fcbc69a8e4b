"""The typed configuration is trusted past the loader: no code re-casts a schema field to the type it
already has (``int(acfg.ppo_epochs)``) and none reads a schema field through ``getattr(group, "field",
default)`` (the default lives in the schema only). Also: no parameter that receives configuration is
typed ``Any`` in the layers that consume it.

How: every function's parameters annotated with a schema class (``KLPPOConfig``, ``ActorConfig``, …), and
names assigned from attribute chains of those, are followed through the schema's type hints; a cast or a
``getattr`` of a chain that resolves to a schema field is reported with its file and line.
"""

from __future__ import annotations

import ast
import dataclasses
import types
import typing
from pathlib import Path

import klppo
from klppo.config import schema, schema_arr, schema_common, schema_monitor

ROOT = Path(klppo.__file__).parent
CASTS = {"int": int, "float": float, "bool": bool, "str": str}
TYPED_LAYERS = ("trainer", "roles", "tune", "parallel")  # where configuration parameters must be typed


def _is_config_param(name: str) -> bool:
    return name == "cfg" or name.endswith("_cfg")


def _schema_classes() -> dict[str, type]:
    out = {}
    for mod in (schema, schema_arr, schema_common, schema_monitor):
        for name, obj in vars(mod).items():
            if isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__module__ == mod.__name__:
                out[name] = obj
    return out


SCHEMA = _schema_classes()


def _members(tp: object) -> list[object]:
    """The types of a hint, unions flattened, None dropped."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return [m for arg in typing.get_args(tp) for m in _members(arg)]
    return [] if tp is type(None) else [tp]


def _hints(cls: type) -> dict[str, object]:
    return typing.get_type_hints(cls, vars(__import__(cls.__module__, fromlist=["_"])))


def _annotation_types(node: ast.expr | None) -> list[type]:
    if node is None:
        return []
    text = ast.unparse(node).replace("'", "").replace('"', "")
    return [SCHEMA[part.strip()] for part in text.split("|") if part.strip() in SCHEMA]


class _Checker(ast.NodeVisitor):
    def __init__(self, path: Path, typed_layer: bool = True) -> None:
        self.path, self.problems, self.typed_layer = path, [], typed_layer
        self.env: list[dict[str, list[object]]] = [{}]

    def _resolve(self, node: ast.expr) -> list[object] | None:
        """The schema types (or leaf types) an attribute chain of a known config name has."""
        if isinstance(node, ast.Name):
            for scope in reversed(self.env):
                if node.id in scope:
                    return scope[node.id]
            return None
        if isinstance(node, ast.Attribute):
            if node.attr == "cfg":
                return [SCHEMA["KLPPOConfig"]]  # self.cfg, run.cfg: the run's configuration
            parents = self._resolve(node.value)
            if not parents:
                return None
            out: list[object] = []
            for parent in parents:
                if isinstance(parent, type) and dataclasses.is_dataclass(parent):
                    hint = _hints(parent).get(node.attr)
                    if hint is None:
                        return None
                    out += _members(hint)
            return out or None
        return None

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        scope: dict[str, list[object]] = {}
        for arg in node.args.args + node.args.kwonlyargs:
            found = _annotation_types(arg.annotation)
            if found:
                scope[arg.arg] = list(found)
            if self.typed_layer and _is_config_param(arg.arg) and not found:
                shown = "untyped" if arg.annotation is None else f"typed {ast.unparse(arg.annotation)}"
                self.problems.append(f"{self._where(arg)}: configuration parameter {arg.arg!r} {shown}")
        self.env.append(scope)
        for stmt in node.body:
            self.visit(stmt)
        self.env.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Assign(self, node: ast.Assign) -> None:
        self.generic_visit(node)
        pairs: list[tuple[ast.expr, ast.expr]] = []
        for target in node.targets:
            if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                pairs += list(zip(target.elts, node.value.elts))
            else:
                pairs.append((target, node.value))
        for target, value in pairs:
            if isinstance(target, ast.Name):
                resolved = self._resolve(value)
                if resolved and any(dataclasses.is_dataclass(t) for t in resolved):
                    self.env[-1][target.id] = resolved

    def visit_Call(self, node: ast.Call) -> None:
        self.generic_visit(node)
        if not isinstance(node.func, ast.Name) or not node.args:
            return
        name, arg = node.func.id, node.args[0]
        if name in CASTS and len(node.args) == 1 and isinstance(arg, ast.Attribute):
            resolved = self._resolve(arg)
            if resolved and all(t is CASTS[name] for t in resolved):
                self.problems.append(f"{self._where(node)}: {ast.unparse(node)} re-casts a typed field")
        if name == "getattr" and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
            resolved = self._resolve(arg)
            field = node.args[1].value
            if resolved and any(dataclasses.is_dataclass(t) and field in _hints(t) for t in resolved):
                self.problems.append(f"{self._where(node)}: {ast.unparse(node)} reads a schema field by name")

    def _where(self, node: ast.AST) -> str:
        return f"{self.path.relative_to(ROOT.parent)}:{node.lineno}"


def problems_in(path: Path) -> list[str]:
    checker = _Checker(path, typed_layer=path.relative_to(ROOT).parts[0] in TYPED_LAYERS)
    checker.visit(ast.parse(path.read_text(), filename=str(path)))
    return checker.problems


def test_no_recasts_or_getattr_of_schema_fields() -> None:
    problems = [
        p for path in sorted(ROOT.rglob("*.py")) if "config" not in path.parts for p in problems_in(path)
    ]
    assert not problems, "\n".join(problems)


def test_the_checker_finds_what_it_looks_for(tmp_path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from typing import Any\n"
        "def f(cfg: KLPPOConfig, acfg: ActorConfig, other: Any):\n"
        "    arr, algo = cfg.actor_rollout_ref, cfg.algorithm\n"
        "    fsdp = arr.actor.fsdp_config\n"
        "    a = int(acfg.ppo_epochs)\n"
        "    b = float(algo.gamma)\n"
        "    c = getattr(fsdp, 'param_offload', False)\n"
        "    d = int(fsdp.fsdp_size)\n"
        "    e = int(self.cfg.trainer.max_nan_steps)\n"
        "    ok = float(acfg.ppo_epochs) + int(other.x) + int(cfg.trainer.n_gpus_per_node)\n"
        "def g(cfg: Any, fsdp_cfg, config: Any): pass\n"
    )
    checker = _Checker(bad)
    checker.path = ROOT / "bad.py"
    checker.visit(ast.parse(bad.read_text()))
    lines = sorted(int(p.split(":")[1]) for p in checker.problems)
    assert lines == [5, 6, 7, 8, 9, 11, 11], checker.problems
