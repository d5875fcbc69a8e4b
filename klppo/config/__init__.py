"""klppo.config: verl-compatible configuration as one typed, frozen tree.

    from klppo.config import load_config, derive_sizes
    cfg = load_config(["my.yaml", "data.train_batch_size=512", "actor_rollout_ref.rollout.n=4"])
    sizes = derive_sizes(cfg, world_size=8)

`load_config(argv)` takes `[file.yaml] key=value ...` exactly as given on a command line and returns a
resolved `KLPPOConfig` (frozen dataclasses, verl's key names); it raises `ConfigError` (a ValueError)
with the key, value and expected type/range for anything wrong. `derive_sizes` is the one place per-rank
batch sizes are computed. `check_trainable` (values train cannot honour) and `warn_unimplemented`
(accepted keys with no effect yet) are called by the trainer at start. Knows nothing of models or the loop.
"""

from klppo.config.dump import config_to_yaml
from klppo.config.errors import ConfigError
from klppo.config.loader import load_config
from klppo.config.schema import KLPPOConfig
from klppo.config.sizes import (
    Sizes,
    config_world_size,
    derive_sizes,
    logged_prompts_per_step,
    total_training_steps,
    uses_critic,
    uses_lora,
)
from klppo.config.unimplemented import check_trainable, warn_unimplemented

__all__ = [
    "ConfigError",
    "KLPPOConfig",
    "Sizes",
    "check_trainable",
    "config_to_yaml",
    "config_world_size",
    "derive_sizes",
    "load_config",
    "logged_prompts_per_step",
    "total_training_steps",
    "uses_critic",
    "uses_lora",
    "warn_unimplemented",
]
