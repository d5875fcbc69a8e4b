"""The phases of a step on logged samples (``data.logged_files``): the loader's batch is the step's samples
(nothing is generated), scores are computed only where the log has none, and the reference's log-probs
stand in for missing behaviour log-probs where a decoupled correction needs them (docs/data.md)."""

from __future__ import annotations

import torch

from klppo.assembly.setup import Run
from klppo.batch import Batch
from klppo.data.logged import LoggedLoader
from klppo.roles.reward import Reward


def is_logged(samples: Batch) -> bool:
    """The batch holds logged samples (the loader filled its responses), not prompts to generate for."""
    return samples.responses is not None


def with_missing_scores(reward: Reward, samples: Batch) -> Batch:
    """``token_level_scores`` where the log had no score (NaN on the sample's last response token): those
    samples scored by the run's reward, the logged scores kept."""
    scores = samples.token_level_scores
    missing = torch.isnan(scores).any(dim=1)
    if not bool(missing.any()):
        return samples
    rows = torch.nonzero(missing).flatten()
    fresh = reward.score(samples.select(rows)).token_level.to(scores.device, scores.dtype)
    filled = scores.clone()
    filled[rows.to(scores.device)] = fresh
    return samples.replace(token_level_scores=filled)


def with_behaviour_stand_in(run: Run, samples: Batch) -> Batch:
    """Logged samples without behaviour log-probs under a decoupled correction: the reference's (the initial
    model's) log-probs as ``rollout_log_probs`` (the loader's :meth:`LoggedLoader.behaviour` says so)."""
    loader = run.loaders.train
    if isinstance(loader, LoggedLoader) and loader.behaviour() == "reference":
        assert samples.ref_log_probs is not None, (
            "the reference stands in: build_logged_loader checks it is loaded"
        )
        return samples.replace(rollout_log_probs=samples.ref_log_probs)
    return samples
