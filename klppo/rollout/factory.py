"""The engine named by ``actor_rollout_ref.rollout.name``, built from its settings."""

from __future__ import annotations

from klppo.parallel.mesh import TensorParallel
from klppo.rollout.base import RolloutEngine
from klppo.rollout.compiled import CompiledFunctions
from klppo.rollout.engine import KLPPORollout
from klppo.rollout.hf import HFRollout
from klppo.rollout.settings import EngineSettings
from klppo.rollout.tp import TPRollout

ENGINES = ("klppo", "hf")


def make_rollout(
    name: str,
    settings: EngineSettings,
    *,
    tensor_parallel: TensorParallel | None = None,
    compiled: CompiledFunctions | None = None,
) -> RolloutEngine:
    """The engine ``name``: "klppo" (ours, :mod:`klppo.rollout.engine`) or "hf" (transformers ``generate``,
    which reads only the token ids of ``settings``).

    ``tensor_parallel``: this rank's rollout tensor-parallel group (klppo only): the engine then takes the
    FSDP2-sharded model and reshards it itself (:mod:`klppo.rollout.tp`). ``compiled``: the compiled decode
    functions the caller started pre-compiling (klppo only; None: the engine's own).
    """
    if tensor_parallel is not None and name != "klppo":
        raise ValueError(
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={tensor_parallel.size} needs "
            f"actor_rollout_ref.rollout.name=klppo, got {name!r}"
        )
    if name == "hf":
        return HFRollout(eos_token_ids=list(settings.eos_token_ids), pad_token_id=settings.pad_token_id)
    if name == "klppo":
        engine = KLPPORollout(settings, compiled=compiled)
        return engine if tensor_parallel is None else TPRollout(engine, tensor_parallel)
    raise ValueError(f"unknown rollout name {name!r}; expected one of {ENGINES}")
