"""The phases of a step on logged samples (``data.logged_files``): the loader's batch is the step's samples
(nothing is generated; a mixed step's generated ones join them, ``mixed_phases.py``), scores are computed
only where the log has none, and the reference's log-probs stand in for missing behaviour log-probs where a
decoupled correction needs them (docs/data.md)."""

from __future__ import annotations

import torch

from klppo.assembly.setup import Run
from klppo.batch import Batch
from klppo.data.logged import LoggedLoader
from klppo.data.mixed import MixedBatch, MixedLoader
from klppo.roles.reward import Reward


def is_logged(data: Batch | MixedBatch) -> bool:
    """The step's data are logged samples only (the loader filled their responses): nothing to generate."""
    return isinstance(data, Batch) and data.responses is not None


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


def logged_loader(run: Run) -> LoggedLoader | None:
    """The run's loader of logged samples: the training loader, or a mixed run's part; None without logs."""
    loader = run.loaders.train
    if isinstance(loader, MixedLoader):
        return loader.logged
    return loader if isinstance(loader, LoggedLoader) else None


def with_behaviour_stand_in(run: Run, samples: Batch) -> Batch:
    """Logged samples without behaviour log-probs under a decoupled correction: the reference's (the initial
    model's) log-probs as their ``rollout_log_probs`` (the loader's :meth:`LoggedLoader.behaviour` says so);
    a generated sample of a mixed step keeps the engine's."""
    logs = logged_loader(run)
    if logs is None or logs.behaviour() != "reference":
        return samples
    assert samples.ref_log_probs is not None, (
        "the reference stands in: build_logged_loader checks it is loaded"
    )
    if samples.rollout_log_probs is None:
        return samples.replace(rollout_log_probs=samples.ref_log_probs)
    rows = samples.from_logs[:, None]
    return samples.replace(
        rollout_log_probs=torch.where(rows, samples.ref_log_probs, samples.rollout_log_probs)
    )
