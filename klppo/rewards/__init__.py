"""klppo.rewards: rule scorers (GSM8K, boxed math), a registry by ``data_source``, user reward functions.

Knows nothing of the training loop: takes decoded strings, returns floats, and places them on tokens.
"""

from klppo.rewards.registry import (
    SCORERS,
    RewardManager,
    get_scorer,
    load_custom_reward_fn,
    place_scores,
    register_scorer,
)

__all__ = [
    "SCORERS",
    "RewardManager",
    "get_scorer",
    "load_custom_reward_fn",
    "place_scores",
    "register_scorer",
]
