"""`config_to_yaml(cfg)`: a resolved configuration as plain YAML (loadable again by `load_config`)."""

from __future__ import annotations

import dataclasses

from omegaconf import OmegaConf

from klppo.config.schema import KLPPOConfig


def config_to_yaml(cfg: KLPPOConfig) -> str:
    """Plain YAML of every key in schema order; interpolations are already resolved by `load_config`."""
    return OmegaConf.to_yaml(OmegaConf.create(dataclasses.asdict(cfg)))
