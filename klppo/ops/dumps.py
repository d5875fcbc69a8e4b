"""verl's `trainer.rollout_data_dir` / `trainer.validation_data_dir`: one JSONL file per step with each
sample's prompt, response, score and ground truth, for reading what the policy actually wrote."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from klppo.batch import Batch


def decode_prompts(batch: Batch, tokenizer: Any) -> list[str]:
    out = []
    for ids, mask in zip(batch.prompts.tolist(), batch.prompt_mask.tolist()):
        out.append(tokenizer.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=False))
    return out


def dump_samples(
    directory: str | Path,
    step: int,
    *,
    inputs: list[str],
    outputs: list[str],
    scores: list[float],
    ground_truths: list[Any],
    data_sources: list[str],
    rewards: list[float] | None = None,
    extras: list[dict[str, Any]] | None = None,
) -> Path:
    """Write ``<directory>/<step>.jsonl`` (verl's layout: keys input, output, score, step, plus ours);
    ``extras``: more keys per row (a multi-turn validation's ``turn_scores`` and ``num_turns``)."""
    directory = Path(directory).expanduser()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{step}.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for i, (inp, out, score) in enumerate(zip(inputs, outputs, scores)):
            row = {
                "input": inp,
                "output": out,
                "score": float(score),
                "step": step,
                "ground_truth": ground_truths[i],
                "data_source": data_sources[i],
            }
            if rewards is not None:
                row["reward"] = float(rewards[i])
            if extras is not None:
                row.update(extras[i])
            f.write(json.dumps(row, default=str) + "\n")
    return path


def chat_text(messages: Any) -> str:
    """Chat messages as plain ``role: content`` lines."""
    if isinstance(messages, (list, tuple)):
        return "\n".join(f"{m.get('role', '')}: {m.get('content', '')}" for m in messages)
    return str(messages)


def dump_rollouts(directory: str | Path, step: int, batch: Batch, tokenizer: Any, reward: Any) -> Path:
    """``trainer.rollout_data_dir``: every training sample of the step (the global batch)."""
    return dump_samples(
        directory,
        step,
        inputs=decode_prompts(batch, tokenizer),
        outputs=reward.decode_responses(batch),
        scores=batch.token_level_scores.sum(dim=1).tolist(),
        ground_truths=batch.ground_truth,
        data_sources=batch.data_source,
        rewards=batch.token_level_rewards.sum(dim=1).tolist(),
    )
