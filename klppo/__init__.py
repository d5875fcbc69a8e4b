"""klppo: KL-regularized PPO for language models, verl-compatible configuration, FSDP2 sharding."""

__version__ = "0.1.0"
