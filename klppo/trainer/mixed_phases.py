"""The phases of a mixed step (``data.logged_share`` between 0 and 1): the samples generated for the step's
prompts and the logged groups are joined into one batch (docs/data.md, "Mixed runs").

Each rank joins its share of the generated samples (first) and its share of the logged groups; the global
batch is those joins in rank order, as :func:`klppo.parallel.shares.gather_samples` lays out one source.
Every row keeps its own behaviour log-probs — the engine's for a generated sample, the log's for a logged one
(where the logs lack them, the reference's stand in after its pass, or, when no correction needs them, the
step carries none) — its own score (a logged score is kept) and ``from_logs``, which splits the metrics.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from klppo.assembly.setup import Run
from klppo.batch import Batch
from klppo.data.mixed import MixedBatch, MixedLoader
from klppo.parallel.collectives import world_size
from klppo.parallel.shares import gather_samples, shard_prompts
from klppo.roles.reward import PendingScores, Reward
from klppo.trainer.logged_phases import is_logged, logged_loader, with_missing_scores
from klppo.trainer.phases import GATHERED, with_scores

RESPONSE_FIELDS = (
    "response_mask",
    "response_attention_mask",
    "rollout_log_probs",
    "rollout_log_kept_mass",
    "token_level_scores",
)
"""The float [B, R] fields a join pads on the right with 0 (``responses`` with the pad token)."""


def shard_step(data: Batch | MixedBatch) -> Batch | MixedBatch:
    """This rank's share of the step's data: of the prompts, and of the logged groups in a mixed step."""
    if isinstance(data, MixedBatch):
        return MixedBatch(shard_prompts(data.prompts), shard_prompts(data.logged))
    return shard_prompts(data)


def join_sources(fresh: Batch, logged: Batch, *, behaviour: str, pad_id: int) -> Batch:
    """``fresh`` (samples generated in the step) then ``logged`` as one batch: prompts left-padded and
    responses right-padded to common widths, ``from_logs`` set, the generated samples' scores NaN (the reward
    scores them, :func:`with_source_scores`). Where the logs lack behaviour log-probs (``behaviour`` is
    :meth:`LoggedLoader.behaviour`), the logged rows hold zeros that the reference's replace
    (``reference``, :func:`klppo.trainer.logged_phases.with_behaviour_stand_in`), or the step keeps none
    (``none``: no correction reads them)."""
    width = max(fresh.response_length, logged.response_length)
    fresh = fresh.replace(
        token_level_scores=torch.full_like(fresh.response_mask, float("nan")),
        from_logs=torch.zeros(len(fresh), dtype=torch.bool, device=fresh.prompts.device),
    )
    if behaviour == "none":
        fresh = fresh.replace(rollout_log_probs=None, rollout_log_kept_mass=None)
    elif logged.rollout_log_probs is None:
        logged = logged.replace(rollout_log_probs=torch.zeros_like(logged.response_mask))
    if (fresh.response_attention_mask is None) != (logged.response_attention_mask is None):
        fresh, logged = (b.replace(response_attention_mask=b.response_tokens_mask) for b in (fresh, logged))
    return join_prompts([_pad_responses(b, width, pad_id) for b in (fresh, logged)], pad_id=pad_id)


def _pad_responses(batch: Batch, width: int, pad_id: int) -> Batch:
    extra = width - batch.response_length
    if extra == 0:
        return batch
    changes = {
        name: F.pad(getattr(batch, name), (0, extra))
        for name in RESPONSE_FIELDS
        if getattr(batch, name) is not None
    }
    return batch.replace(responses=F.pad(batch.responses, (0, extra), value=pad_id), **changes)


def join_prompts(parts: list[Batch], *, pad_id: int) -> Batch:
    """``parts`` concatenated, their prompts left-padded to the widest."""
    width = max(p.prompts.shape[1] for p in parts)
    padded = [
        p.replace(
            prompts=F.pad(p.prompts, (width - p.prompts.shape[1], 0), value=pad_id),
            prompt_mask=F.pad(p.prompt_mask, (width - p.prompts.shape[1], 0)),
        )
        for p in parts
    ]
    return Batch.concat(padded)


def gather_mixed(data: MixedBatch, local: Batch, *, n: int, fields: tuple[str, ...], pad_id: int) -> Batch:
    """The global batch of a mixed step: every rank's ``local`` (its :func:`join_sources`) in rank order, on
    the prompt-level fields and ``from_logs`` of the step's ``data`` (``n`` samples per generated prompt)."""
    parts = []
    for prompts, logged in zip(data.prompts.chunk(world_size()), data.logged.chunk(world_size())):
        parts += [_prompt_rows(prompts.repeat_interleave(n), False), _prompt_rows(logged, True)]
    return gather_samples(join_prompts(parts, pad_id=pad_id), local, n=1, fields=fields)


def _prompt_rows(batch: Batch, from_logs: bool) -> Batch:
    """The prompt-level fields of ``batch`` (what the gather does not fill in), with ``from_logs``."""
    return Batch(
        prompts=batch.prompts,
        prompt_mask=batch.prompt_mask,
        from_logs=torch.full((len(batch),), from_logs, dtype=torch.bool, device=batch.prompts.device),
        data_source=batch.data_source,
        ground_truth=batch.ground_truth,
        uid=batch.uid,
        extra_info=batch.extra_info,
        raw_prompt=batch.raw_prompt,
    )


def with_source_scores(reward: Reward, samples: Batch, pending: PendingScores | None) -> Batch:
    """``token_level_scores`` of a joined batch: the generated samples' (the first rows; from ``pending``,
    their background scoring, when given), the logged scores kept and the missing ones scored by the
    reward."""
    if pending is not None:
        fresh = pending.result().token_level
        scores = samples.token_level_scores.clone()
        scores[: len(fresh)] = F.pad(fresh, (0, scores.shape[1] - fresh.shape[1])).to(scores)
        samples = samples.replace(token_level_scores=scores)
    return with_missing_scores(reward, samples)


def with_logged_groups(run: Run, fresh: Batch, data: Batch | MixedBatch) -> Batch:
    """A mixed step's generated samples (this rank's) joined with its logged groups; else ``fresh``."""
    if not isinstance(data, MixedBatch):
        return fresh
    logs = logged_loader(run)
    return join_sources(fresh, data.logged, behaviour=logs.behaviour(), pad_id=logs.pad_token_id)


def unknown_behaviour_rows(run: Run, samples: Batch) -> torch.Tensor | None:
    """[B] bool: the rows whose behaviour log-probs are not known before the reference's pass (a mixed step's
    logged rows, where the reference stands in for them), or None when every row's are."""
    logs = logged_loader(run)
    mixed = isinstance(run.loaders.train, MixedLoader)
    return samples.from_logs if mixed and logs.behaviour() == "reference" else None


def with_step_scores(
    reward: Reward, data: Batch | MixedBatch, local: Batch, pending: PendingScores | None
) -> Batch:
    """This rank's samples with their scores: by the reward (``pending``'s, scored in the background, when
    given) for generated ones, the log's for logged ones, by the reward where the log has none."""
    if isinstance(data, MixedBatch):
        return with_source_scores(reward, local, pending)
    return with_missing_scores(reward, local) if is_logged(data) else with_scores(reward, local, pending)


def gather_step(run: Run, data: Batch | MixedBatch, local: Batch) -> Batch:
    """The step's global batch from every rank's samples (``local``), in rank order."""
    n = run.sampling.train.n
    if isinstance(data, MixedBatch):
        return gather_mixed(data, local, n=n, fields=GATHERED, pad_id=logged_loader(run).pad_token_id)
    return gather_samples(data, local, n=1 if is_logged(data) else n, fields=GATHERED)
