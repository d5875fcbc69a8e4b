"""klppo.rollout: generation engines (``klppo``, our own; ``hf``, the reference) behind one contract.

See :mod:`klppo.rollout.base` for shapes and row order, :mod:`klppo.rollout.backends` for the klppo
engine's backends.
"""

from klppo.rollout.base import RolloutEngine, RolloutOutput, SamplingParams, response_mask_from_tokens
from klppo.rollout.factory import make_rollout
from klppo.rollout.settings import EngineSettings

__all__ = [
    "EngineSettings",
    "RolloutEngine",
    "RolloutOutput",
    "SamplingParams",
    "make_rollout",
    "response_mask_from_tokens",
]
