"""The per-step metrics computed from the global batch and the phase timings (verl's names)."""

from __future__ import annotations

import sys
from typing import Any

import torch

from klppo.algorithms.kl import kl_penalty
from klppo.algorithms.losses import explained_variance, masked_mean
from klppo.algorithms.outcome import equal_groups, group_index
from klppo.batch import Batch, rollout_softmax_log_probs
from klppo.models.flops import device_peak_flops, model_flops_per_token
from klppo.parallel.collectives import all_reduce_max_values, world_size


def batch_metrics(batch: Batch) -> dict[str, float]:
    """Scores, rewards, advantages, returns, values and lengths of the step's (global) batch. Lengths count
    every response token (``response_tokens_mask``: a multi-turn rollout's appended tokens and rejected
    tokens included, as verl's attention-mask lengths); advantages, returns, values and the KL count the
    tokens the losses count (``response_mask``)."""
    m = batch.response_mask
    resp_len = batch.response_tokens_mask.sum(dim=1)
    prompt_len = batch.prompt_mask.sum(dim=1).float()
    scores = batch.token_level_scores.sum(dim=1)
    out = {
        "critic/score/mean": scores.mean(),
        "critic/score/max": scores.max(),
        "critic/score/min": scores.min(),
        "response_length/mean": resp_len.mean(),
        "response_length/max": resp_len.max(),
        "response_length/min": resp_len.min(),
        "response_length/clip_ratio": (resp_len >= batch.response_length).float().mean(),
        "prompt_length/mean": prompt_len.mean(),
        "prompt_length/max": prompt_len.max(),
    }
    equal = equal_score_groups(scores, batch.uid)
    if equal is not None:
        out["batch/equal_score_groups"], group_score = equal
        if group_score is not None:
            out["batch/equal_score_groups_score"] = group_score
    if batch.advantages is not None:  # absent when a non-finite input skipped the step before them
        rewards = batch.token_level_rewards.sum(dim=1)
        valid_adv = batch.advantages[m.bool()] if m.any() else torch.zeros(1)
        out.update(
            {
                "critic/rewards/mean": rewards.mean(),
                "critic/rewards/max": rewards.max(),
                "critic/rewards/min": rewards.min(),
                "critic/advantages/mean": masked_mean(batch.advantages, m),
                "critic/advantages/max": valid_adv.max(),
                "critic/advantages/min": valid_adv.min(),
                "critic/advantages/std": valid_adv.std(correction=0),
                "critic/returns/mean": masked_mean(batch.returns, m),
            }
        )
    if batch.values is not None:
        out["critic/values/mean"] = masked_mean(batch.values, m)
    if batch.values is not None and batch.returns is not None:
        out["critic/vf_explained_var"] = explained_variance(batch.values, batch.returns, m)
    if batch.ref_log_probs is not None and batch.old_log_probs is not None:  # else the actor reports them
        out.update(ref_kl_metrics(batch.old_log_probs, batch.ref_log_probs, m))
    out.update(source_metrics(batch))
    return {k: float(v) for k, v in out.items()}


def source_metrics(batch: Batch) -> dict[str, torch.Tensor]:
    """A mixed step's figures per source (``from_logs``): ``mixed/logged_share`` (of the samples) and, for
    ``fresh`` (generated) and ``logged`` samples, ``mixed/<source>/score_mean``, ``reward_mean`` (the KL
    penalty in), ``response_length_mean`` and ``log_prob_diff`` (mean |log π_old − log π_behaviour| over the
    response tokens, full softmaxes as ``rollout/log_prob_diff``: a generated sample's truncated log-probs
    plus its log kept mass). Empty unless the step holds both sources."""
    if batch.from_logs is None or bool(batch.from_logs.all()):
        return {}
    out = {"mixed/logged_share": batch.from_logs.float().mean()}
    for name, rows in (("fresh", ~batch.from_logs), ("logged", batch.from_logs)):
        part = batch.select(torch.nonzero(rows).flatten())
        out[f"mixed/{name}/score_mean"] = part.token_level_scores.sum(dim=1).mean()
        out[f"mixed/{name}/response_length_mean"] = part.response_tokens_mask.sum(dim=1).float().mean()
        if part.token_level_rewards is not None:
            out[f"mixed/{name}/reward_mean"] = part.token_level_rewards.sum(dim=1).mean()
        if part.old_log_probs is not None and part.rollout_log_probs is not None:
            diff = (part.old_log_probs - rollout_softmax_log_probs(part)).abs()
            out[f"mixed/{name}/log_prob_diff"] = masked_mean(diff, part.response_mask)
    return out


def ref_kl_metrics(old_log_probs: torch.Tensor, ref_log_probs: torch.Tensor, mask: torch.Tensor) -> dict:
    """KL(π_old‖π_ref) per response token (π_old = the policy that generated the batch), two estimators:
    ``actor/ref_kl_k1`` and ``actor/ref_kl_k3`` (tensors)."""
    return {
        "actor/ref_kl_k1": masked_mean(old_log_probs - ref_log_probs, mask),
        "actor/ref_kl_k3": masked_mean(kl_penalty(old_log_probs, ref_log_probs, "k3"), mask),
    }


def equal_score_groups(scores: torch.Tensor, uids: list[Any]) -> tuple[float, float | None] | None:
    """Share of the step's prompt groups (the samples of one ``uid``, at least two of them) whose scores are
    all equal — GRPO and RLOO give such a group zero advantage, so it brings the update no task gradient
    (only its KL and entropy terms) — and the mean score of those groups' samples (None when there is no
    such group). None without groups (``rollout.n`` = 1)."""
    if len(uids) != scores.shape[0]:
        return None
    index = group_index(uids, len(uids), scores.device)
    sized = torch.bincount(index) >= 2
    if not sized.any():
        return None
    # the same predicate the group estimators zero their advantages on (algorithms.outcome.equal_groups)
    equal = torch.zeros_like(sized).index_put_((index,), equal_groups(scores, index)) & sized
    rows = equal[index]
    score = float(scores[rows].double().mean()) if bool(rows.any()) else None
    return int(equal.sum()) / int(sized.sum()), score


def perf_metrics(
    batch: Batch,
    timings: dict[str, float],
    *,
    device: torch.device,
    model_config: Any,
    ppo_epochs: int,
    update_batch: Batch | None = None,
) -> dict[str, float]:
    """Throughput (tokens/s per device), MFU of the actor update (over ``update_batch``, the rows it ran on,
    default the whole batch), and the peak memory of the fullest rank: GPU (the allocator's peak is reset
    after reading, so each step reports its own) and host (the process's peak resident memory so far,
    ``perf/max_rss_gb``)."""
    step_s = timings["timing_s/step"]
    total_tokens = float(batch.attention_mask.sum())
    out = {
        "perf/total_num_tokens": total_tokens,
        "perf/time_per_step": step_s,
        "perf/throughput": total_tokens / max(step_s, 1e-9) / world_size(),
        "perf/world_size": float(world_size()),
    }
    update_rows = batch if update_batch is None else update_batch
    mfu = actor_mfu(update_rows, timings.get("timing_s/update_actor"), device, model_config, ppo_epochs)
    if mfu is not None:
        out["perf/mfu/actor"] = mfu
    peaks: dict[str, float] = {}
    if device.type == "cuda":
        peaks["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
        peaks["perf/max_memory_reserved_gb"] = torch.cuda.max_memory_reserved(device) / 2**30
        torch.cuda.reset_peak_memory_stats(device)
    rss = peak_rss_gib()
    if rss is not None:
        peaks["perf/max_rss_gb"] = rss
    out.update(zip(peaks, all_reduce_max_values(list(peaks.values()))))
    return out


def peak_rss_gib() -> float | None:
    """Peak resident host memory of this process since it started, GiB (None where the OS does not say)."""
    try:
        import resource  # noqa: PLC0415  POSIX only (absent on Windows)
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**30 if sys.platform == "darwin" else peak / 2**20  # bytes on macOS, KiB on Linux


def actor_mfu(
    batch: Batch, seconds: float | None, device: torch.device, model_config: Any, ppo_epochs: int
) -> float | None:
    """Model FLOPs utilization of the actor update: Σ_seq flops_per_token(len)·len × ppo_epochs per second,
    over the device's dense bf16 peak (verl's ``perf/mfu/actor``); None on CPU or unknown GPUs."""

    if device.type != "cuda" or not seconds:
        return None
    peak = device_peak_flops(torch.cuda.get_device_name(device))
    if peak is None:
        return None
    lengths = [int(n) for n in batch.attention_mask.sum(dim=1).tolist()]
    flops = sum(model_flops_per_token(model_config, seq_len=n) * n for n in lengths) * ppo_epochs
    return flops / (seconds * peak * world_size())


def validation_metrics(records: list[dict[str, Any]], n: int) -> dict[str, float]:
    """Per data source: ``val-core/<ds>/reward/mean@n`` over all samples and, with n > 1 samples per prompt,
    ``best@n`` / ``worst@n`` (mean over prompts of the best / worst of its n scores), verl's names; for a
    multi-turn run (records with ``turn_scores``) the attempts' figures of :func:`attempt_metrics`."""
    out: dict[str, float] = {}
    for src in sorted({r["data_source"] for r in records}):
        rows = [r for r in records if r["data_source"] == src]
        out[f"val-core/{src}/reward/mean@{n}"] = sum(r["score"] for r in rows) / len(rows)
        if any("turn_scores" in r for r in rows):
            out.update({f"val-aux/{src}/{k}": v for k, v in attempt_metrics(rows, n).items()})
        if n > 1:
            groups: dict[Any, list[float]] = {}
            for r in rows:
                groups.setdefault(r["uid"], []).append(r["score"])
            out[f"val-core/{src}/reward/best@{n}/mean"] = sum(max(g) for g in groups.values()) / len(groups)
            out[f"val-core/{src}/reward/worst@{n}/mean"] = sum(min(g) for g in groups.values()) / len(groups)
    return out


def first_attempt_score(record: dict[str, Any]) -> float:
    """The score of a conversation's first answer: the interaction's score of the first turn it judged
    (``turn_scores[0]``), or, where it judged none, the response's reward — the response then holds one
    answer (its turn was the last allowed, cut by the budget, or a ``single_turn_agent`` row's)."""
    turns = record.get("turn_scores") or []
    return float(turns[0]) if turns else float(record["score"])


def attempt_metrics(records: list[dict[str, Any]], n: int) -> dict[str, float]:
    """Of multi-turn samples (``score``: the reward, read on the last answer; ``turn_scores``,
    ``num_turns``: the conversation's), where the interaction asks again after a wrong answer (scores
    below 1):

    - ``first_turn_score/mean@n``: the mean score of the first answer (:func:`first_attempt_score`), the
      accuracy a one-turn run would have; ``reward/mean@n`` beside it is the accuracy after every attempt;
    - ``failed_first/share``: the share of samples whose first answer scored below 1;
    - ``reward_after_failed_first/mean@n``: their mean reward — how often a later attempt succeeds where the
      first failed (absent when none failed);
    - ``num_turns/mean``: assistant plus user turns per conversation.
    """
    first = [first_attempt_score(r) for r in records]
    after_failed = [float(r["score"]) for r, f in zip(records, first) if f < 1.0]
    out = {
        f"first_turn_score/mean@{n}": sum(first) / len(first),
        "failed_first/share": len(after_failed) / len(records),
        "num_turns/mean": sum(float(r.get("num_turns") or 1) for r in records) / len(records),
    }
    if after_failed:
        out[f"reward_after_failed_first/mean@{n}"] = sum(after_failed) / len(after_failed)
    return out
