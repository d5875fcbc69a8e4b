"""klppo.rollout: generation engines (``klppo``, our own; ``hf``, the reference) behind one contract.

See :mod:`klppo.rollout.base` for shapes and row order.
"""

from klppo.rollout.base import (
    RolloutEngine,
    RolloutOutput,
    SamplingParams,
    make_rollout,
    response_mask_from_tokens,
)

__all__ = ["RolloutEngine", "RolloutOutput", "SamplingParams", "make_rollout", "response_mask_from_tokens"]
