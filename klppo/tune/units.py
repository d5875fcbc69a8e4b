"""Per-unit parameter counts of a model under a wrap threshold (from a weight-free ``meta`` model).

:func:`klppo.parallel.fsdp.choose_units` decides the units; here each unit gets the parameters it
*owns* (the innermost unit holding a parameter owns it; the root owns the rest, tied embeddings
included), in forward order, and the part of them that takes part in a matmul (``nn.Linear`` weights
and biases, a tied LM head included) for the compute-time estimate of :mod:`klppo.tune.comm`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from klppo.parallel.fsdp import choose_units
from klppo.tune.shapes import ModelShape, meta_model, shape_of

WHOLE_MODEL = 10**12
"""``min_num_params`` above any model's size: the root is the only unit."""


@dataclass(frozen=True)
class UnitSizes:
    """Own parameters of each unit in forward order; the root (last) is ``sizes[-1]``."""

    min_num_params: int
    sizes: list[int]
    matmul: list[int]
    """Parameters of each unit used in a matmul (a tied LM head counted in the unit owning it)."""

    @property
    def total(self) -> int:
        return sum(self.sizes)

    @property
    def root(self) -> int:
        return self.sizes[-1]

    @property
    def count(self) -> int:
        return len(self.sizes)

    def largest_window(self, width: int) -> int:
        """Largest sum of ``width`` consecutive non-root units (the unit computing + prefetched ones)."""
        inner = self.sizes[:-1]
        if not inner:
            return 0
        width = max(1, min(width, len(inner)))
        return max(sum(inner[i : i + width]) for i in range(len(inner) - width + 1))


def unit_sizes(model: nn.Module, min_num_params: int, layer_cls_names: list[str] | None = None) -> UnitSizes:
    """Own and matmul parameter counts of the units ``choose_units(model, min_num_params)`` returns."""
    units = choose_units(model, min_num_params, layer_cls_names)
    owner: dict[int, int] = {}
    for i in [*reversed(range(len(units) - 1)), len(units) - 1]:  # innermost unit claims first
        for module in units[i]:
            for p in module.parameters():
                owner.setdefault(id(p), i)
    params = {id(p): p for p in model.parameters()}
    linear_ids = {
        id(p) for m in model.modules() if isinstance(m, nn.Linear) for p in m.parameters(recurse=False)
    }
    sizes = [0] * len(units)
    matmul = [0] * len(units)
    for pid, i in owner.items():
        sizes[i] += params[pid].numel()
        if pid in linear_ids:
            matmul[i] += params[pid].numel()
    return UnitSizes(min_num_params, sizes, matmul)


@dataclass
class ModelFacts:
    """A model's shape and its unit sizes per threshold (computed once per threshold on a meta model)."""

    config: object
    shape: ModelShape
    num_params: int
    _model: nn.Module | None = None
    _cache: dict[int, UnitSizes] = field(default_factory=dict)

    @classmethod
    def from_config(cls, config) -> ModelFacts:
        """The facts of ``config``'s model, built once per configuration (a model's checks each ask)."""
        key = (type(config).__name__, config.to_json_string()) if hasattr(config, "to_json_string") else None
        if key is not None and key in _FACTS:
            return _FACTS[key]
        model = meta_model(config)
        total = sum(p.numel() for p in model.parameters())
        facts = cls(config=config, shape=shape_of(config), num_params=total, _model=model)
        if key is not None:
            _FACTS[key] = facts
        return facts

    def units(self, min_num_params: int) -> UnitSizes:
        if min_num_params not in self._cache:
            assert self._model is not None
            self._cache[min_num_params] = unit_sizes(self._model, min_num_params)
        return self._cache[min_num_params]


_FACTS: dict[tuple[str, str], ModelFacts] = {}
""":meth:`ModelFacts.from_config`'s, by configuration."""
