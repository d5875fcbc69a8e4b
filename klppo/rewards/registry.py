"""Reward scorers by ``data_source``, user reward functions, and placement on response tokens.

- ``SCORERS`` maps a row's ``data_source`` to a built-in rule scorer ``fn(solution_str, ground_truth,
  **kwargs) -> float``: GSM8K (``openai/gsm8k``, ``gsm8k``; also klppo's built-in ``arithmetic`` set, written
  in GSM8K's answer format) and the last-boxed-answer math scorer (``lighteval/MATH``,
  ``DigitalLearningGmbH/MATH-lighteval``, ``math``, …).
- ``load_custom_reward_fn(path, name)`` loads ``custom_reward_function.{path,name}``; it is called
  verl-style: ``fn(data_source, solution_str, ground_truth, extra_info, **reward_kwargs)``.
- ``RewardManager.score`` scores decoded responses; a scorer returning a dict contributes its ``"score"``.
- ``place_scores`` puts each sequence score on its last response token (``token_level_scores``).
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

from klppo.rewards import gsm8k, math

Scorer = Callable[..., Any]

SCORERS: dict[str, Scorer] = {
    "openai/gsm8k": gsm8k.compute_score,
    "gsm8k": gsm8k.compute_score,
    "arithmetic": gsm8k.compute_score,  # klppo.data.arithmetic: GSM8K's `#### <answer>` format
    "lighteval/MATH": math.compute_score,
    "DigitalLearningGmbH/MATH-lighteval": math.compute_score,
    "HuggingFaceH4/MATH-500": math.compute_score,
    "math": math.compute_score,
}


BUILTIN_SCORERS: dict[str, Scorer] = dict(SCORERS)
"""The table as shipped: what :func:`register_scorer` added is what differs from it."""


def register_scorer(data_source: str, fn: Scorer) -> None:
    """Register ``fn(solution_str, ground_truth, **kwargs)`` for rows whose ``data_source`` matches (with
    ``reward_model.launch_reward_fn_async`` the scoring processes get it too: a function defined at a
    module's top level)."""
    SCORERS[data_source] = fn


def get_scorer(data_source: str) -> Scorer:
    """The built-in scorer for ``data_source``; ValueError naming the registered sources otherwise."""
    try:
        return SCORERS[data_source]
    except KeyError:
        known = ", ".join(sorted(SCORERS))
        raise ValueError(
            f"no reward scorer registered for data_source {data_source!r}; registered: {known}. Set "
            "custom_reward_function.path/name to score other data sources."
        ) from None


class RewardFunctionError(ValueError):
    """A reward function that does not import, or raised while scoring: one line naming the function, the
    batch row and the phase (the original exception chained)."""


def _reward_file(path: str) -> str:
    """``custom_reward_function.path`` as an absolute path to an existing file; FileNotFoundError
    otherwise."""
    full = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(full):
        raise FileNotFoundError(f"custom_reward_function.path: file not found: {path!r} (resolved to {full})")
    return full


def check_custom_reward_file(path: str, name: str = "compute_score") -> None:
    """What can be known of ``custom_reward_function`` without running the user's file (its top-level code
    may load a judge or bind a port, and the trainer imports it later): the file exists, its source
    compiles, and it binds ``name`` outside an ``if __name__ == "__main__"`` block. A file that binds names
    the parser cannot see (``from x import *``, ``globals()``, ``setattr``, ``exec``) is not judged."""
    full = _reward_file(path)
    try:
        with open(full, "rb") as fh:  # bytes: the parser honours a BOM and a coding cookie
            tree = ast.parse(fh.read(), filename=full)
    except (SyntaxError, UnicodeDecodeError, ValueError) as exc:
        raise RewardFunctionError(f"custom_reward_function.path: {full} does not compile: {exc}") from None
    bound = _bound_names(tree.body)
    if bound is not None and name not in bound:
        raise RewardFunctionError(
            f"custom_reward_function.name: {full} defines no {name!r} at its top level; defined there: "
            f"{', '.join(sorted(bound)) or 'nothing'}"
        )


_DYNAMIC_BINDERS = frozenset({"globals", "setattr", "exec", "vars", "locals"})


def _is_main_guard(node: ast.AST) -> bool:
    """Exactly ``if __name__ == "__main__":`` (either side): its body does not run on import."""
    test = getattr(node, "test", None)
    if not isinstance(node, ast.If) or not isinstance(test, ast.Compare) or len(test.ops) != 1:
        return False
    if not isinstance(test.ops[0], ast.Eq):
        return False
    sides = (test.left, test.comparators[0])
    return any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides) and any(
        isinstance(s, ast.Constant) and s.value == "__main__" for s in sides
    )


def _binds_invisibly(node: ast.AST) -> bool:
    """``globals()``/``setattr``/``exec`` (also as ``builtins.exec``), ``sys.modules``, ``__dict__``, or a
    module ``__getattr__``: names the parser cannot see."""
    if isinstance(node, ast.Call):
        func = node.func
        called = (
            func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        )
        return called in _DYNAMIC_BINDERS
    if isinstance(node, ast.Attribute) and node.attr in ("modules", "__dict__"):
        return True
    return isinstance(node, ast.FunctionDef) and node.name == "__getattr__"


def _bound_names(body: list[ast.stmt]) -> set[str] | None:
    """Names a module body binds (over-approximated: any name stored anywhere in it), None when it binds
    names the parser cannot see."""
    names: set[str] = set()
    for stmt in body:
        if _is_main_guard(stmt):
            stmt = ast.Module(body=stmt.orelse, type_ignores=[])  # only the else branch runs on import
        for node in ast.walk(stmt):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                if any(alias.name == "*" for alias in node.names):
                    return None
                names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
            if _binds_invisibly(node):
                return None
    return names


def load_custom_reward_fn(path: str, name: str = "compute_score") -> Scorer:
    """Import the Python file at ``path`` and return its callable ``name``.

    The module is registered in ``sys.modules`` under a name derived from the file's absolute path (the same
    in every process), so what it defines — an exception class its function raises — pickles by reference
    between the trainer and a background scoring process (:mod:`klppo.roles.reward_worker`). Each call
    imports the file afresh."""
    full = _reward_file(path)
    module_name = "klppo_custom_reward_" + hashlib.sha256(full.encode()).hexdigest()[:16]
    spec = importlib.util.spec_from_file_location(module_name, full)
    if spec is None or spec.loader is None:
        raise ValueError(f"custom_reward_function.path: cannot import {full} as a Python module")
    module = importlib.util.module_from_spec(spec)
    previous = sys.modules.get(module_name)
    sys.modules[module_name] = module
    try:
        fn = _exec_and_get(spec, module, full, name)
    except Exception:  # the module that worked before stays registered
        if previous is None:
            sys.modules.pop(module_name, None)
        else:
            sys.modules[module_name] = previous
        raise
    return fn


def _exec_and_get(spec, module, full: str, name: str) -> Scorer:
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise RewardFunctionError(f"custom_reward_function.path: importing {full} failed: {exc!r}") from exc
    fn = getattr(module, name, None)
    if fn is None:
        available = sorted(
            k
            for k, v in vars(module).items()
            if callable(v) and not k.startswith("_") and not inspect.isclass(v)
        )
        raise RewardFunctionError(
            f"custom_reward_function.name: {full} defines no {name!r}; callables there: {available or 'none'}"
        )
    if not callable(fn):
        raise RewardFunctionError(f"custom_reward_function.name: {name!r} in {full} is not callable")
    return fn


def _called(where: str, fn: Scorer, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``; what it raises becomes one line naming ``where`` (the function and row)."""
    try:
        return fn(*args, **kwargs)
    except RewardFunctionError:
        raise
    except Exception as exc:
        first = (str(exc).splitlines() or [""])[0][:300]
        raise RewardFunctionError(
            f"{where.rstrip(',')} raised {type(exc).__name__}: {first} (while scoring the step's responses)"
        ) from exc


def _accepted_kwargs(fn: Scorer) -> set[str] | None:
    """Keyword names ``fn`` accepts (None = any, it takes ``**kwargs``)."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _as_float(value: Any, where: str) -> float:
    """A scorer's result as a float; ``where`` names the function and the row for the one-line error."""
    if isinstance(value, dict):
        if "score" not in value:
            raise RewardFunctionError(f"{where} returned a dict without a 'score' key: keys {sorted(value)}")
        value = value["score"]
    try:
        if isinstance(value, (str, bytes)):  # float("1") would pass: a string is a bug, not a score
            raise TypeError
        return float(value)
    except (TypeError, ValueError):
        raise RewardFunctionError(
            f"{where} returned {value!r} ({type(value).__name__}): a score must be a number or a dict "
            "with a numeric 'score'"
        ) from None


REWARD_MANAGERS = ("naive", "batch", "dapo")


class RewardManager:
    """Scores responses: the user's function when given, else the built-in registry by data source.

    ``reward_manager`` (verl's ``reward_model.reward_manager``):

    - ``naive``: one call per response.
    - ``batch``: one call of the user's function for the whole batch, verl's batched signature
      ``compute_score(data_sources, solution_strs, ground_truths, extra_infos, **reward_kwargs)`` returning a
      list (of floats or dicts with ``score``).
    - ``dapo``: as ``naive``, plus DAPO's soft overlong penalty (Yu et al. 2025) from ``reward_kwargs``
      ``overlong_buffer_cfg: {enable, len, penalty_factor}`` and ``max_resp_len``: with
      ``expected = max_resp_len − len``, a response of ``L`` tokens gets
      ``min(−(L − expected) / len · penalty_factor, 0)`` added.

    Other ``reward_kwargs`` go to the custom function, or to each built-in scorer that accepts them (e.g.
    ``method``/``format_score``/``score`` for GSM8K); a key that no built-in scorer accepts is an error.
    """

    def __init__(
        self,
        *,
        custom_fn_path: str | None = None,
        custom_fn_name: str = "compute_score",
        reward_kwargs: dict | None = None,
        reward_manager: str = "naive",
    ) -> None:
        if reward_manager not in REWARD_MANAGERS:
            raise ValueError(f"reward_manager={reward_manager!r}: built are {', '.join(REWARD_MANAGERS)}")
        if reward_manager == "batch" and not custom_fn_path:
            raise ValueError(
                "reward_manager=batch needs custom_reward_function.path (a batched compute_score)"
            )
        self.reward_manager = reward_manager
        self.reward_kwargs = dict(reward_kwargs or {})
        self.overlong = None
        if reward_manager == "dapo":
            cfg = dict(self.reward_kwargs.pop("overlong_buffer_cfg", None) or {})
            max_resp_len = self.reward_kwargs.pop("max_resp_len", None)
            if cfg.get("enable"):
                if max_resp_len is None or not cfg.get("len"):
                    raise ValueError(
                        "reward_manager=dapo with overlong_buffer_cfg.enable needs "
                        "reward_kwargs.max_resp_len and overlong_buffer_cfg.len"
                    )
                self.overlong = (int(max_resp_len), int(cfg["len"]), float(cfg.get("penalty_factor", 1.0)))
        self.custom_fn = load_custom_reward_fn(custom_fn_path, custom_fn_name) if custom_fn_path else None
        self._custom_name = f"custom_reward_function {custom_fn_path}:{custom_fn_name}"
        self.current_row = -1
        """The batch row being scored (the first of a batched call), for a time limit's message."""
        self.on_row: Callable[[int], None] | None = None
        """Called with each row before it is scored (a scoring process reports its progress with it)."""
        if self.custom_fn is None and self.reward_kwargs:
            accepted: set[str] = set()
            for fn in set(SCORERS.values()):
                names = _accepted_kwargs(fn)
                accepted |= (
                    names - {"solution_str", "ground_truth"} if names is not None else set(self.reward_kwargs)
                )
            unknown = sorted(set(self.reward_kwargs) - accepted)
            if unknown:
                raise ValueError(
                    f"reward_kwargs {unknown} are accepted by no built-in scorer; accepted: "
                    f"{sorted(accepted)}"
                )

    @property
    def describe(self) -> str:
        """The function that scores: the user's, or the built-in scorers by data source."""
        return self._custom_name if self.custom_fn is not None else "the built-in scorer"

    def _at(self, row: int) -> None:
        self.current_row = row
        if self.on_row is not None:
            self.on_row(row)

    def _builtin(self, data_source: str, response: str, ground_truth: Any, row: int) -> float:
        fn = get_scorer(data_source)
        names = _accepted_kwargs(fn)
        kwargs = (
            self.reward_kwargs
            if names is None
            else {k: v for k, v in self.reward_kwargs.items() if k in names}
        )
        where = f"the scorer for data_source {data_source!r} ({getattr(fn, '__qualname__', fn)}), row {row},"
        return _as_float(_called(where, fn, response, ground_truth, **kwargs), where)

    def score(
        self,
        responses: list[str],
        data_sources: list[str],
        ground_truths: list,
        extra_infos: list,
        response_lengths: list[int] | None = None,
        *,
        first_row: int = 0,
    ) -> list[float]:
        """One float per response (lists aligned by row); ``response_lengths`` (tokens) for ``dapo``;
        ``first_row``: the batch row of the first response (errors name the batch's row)."""
        if not (len(responses) == len(data_sources) == len(ground_truths) == len(extra_infos)):
            raise ValueError(
                f"score(): lists differ in length: responses {len(responses)}, data_sources "
                f"{len(data_sources)}, ground_truths {len(ground_truths)}, extra_infos {len(extra_infos)}"
            )
        if self.reward_manager == "batch":
            self._at(first_row)
            values = _called(
                f"{self._custom_name} (batched, rows {first_row}–{first_row + len(responses) - 1})",
                self.custom_fn,
                data_sources=data_sources,
                solution_strs=responses,
                ground_truths=ground_truths,
                extra_infos=extra_infos,
                **self.reward_kwargs,
            )
            if not hasattr(values, "__len__") or len(values) != len(responses):
                got = f"{len(values)} scores" if hasattr(values, "__len__") else f"{type(values).__name__}"
                raise RewardFunctionError(
                    f"{self._custom_name} (batched) returned {got} for {len(responses)} responses: one score "
                    "each"
                )
            return [
                _as_float(v, f"{self._custom_name} (batched), row {i},")
                for i, v in enumerate(values, first_row)
            ]
        out = []
        rows = zip(responses, data_sources, ground_truths, extra_infos)
        for i, (response, source, truth, extra) in enumerate(rows, first_row):
            self._at(i)
            if self.custom_fn is not None:
                where = f"{self._custom_name}, row {i},"
                value = _called(where, self.custom_fn, source, response, truth, extra, **self.reward_kwargs)
                out.append(_as_float(value, where))
            else:
                out.append(self._builtin(source, response, truth, i))
        if self.overlong is not None:
            if response_lengths is None:
                raise ValueError("reward_manager=dapo with an overlong buffer needs the response lengths")
            max_len, buffer_len, factor = self.overlong
            expected = max_len - buffer_len
            out = [r + min(-(n - expected) / buffer_len * factor, 0.0) for r, n in zip(out, response_lengths)]
        return out


def place_scores(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """token_level_scores [B, R] float32: ``scores[b]`` on the last position where ``response_mask[b]`` is
    set, zero elsewhere; a row with no response token is all zero."""
    if scores.dim() != 1 or response_mask.dim() != 2 or scores.shape[0] != response_mask.shape[0]:
        raise ValueError(
            f"place_scores: scores {tuple(scores.shape)} vs response_mask {tuple(response_mask.shape)}"
        )
    mask = response_mask.bool()
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, torch.full_like(positions, -1)).amax(dim=1)
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    rows = torch.nonzero(last >= 0).squeeze(1)
    out[rows, last[rows]] = scores.to(device=mask.device, dtype=torch.float32)[rows]
    return out
