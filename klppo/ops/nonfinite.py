"""Non-finite values in a step: found, named, skipped and counted, in one path.

Before any update, the step's global batch is checked (:func:`find_nonfinite`): the scores (a reward
function or reward model returning NaN/inf), the actor's and reference's log-probs, the critic's values,
then — after the KL penalty and the advantage estimator — the KL, rewards, advantages and returns. The
first bad value is named by field, sample, data source and data row (``"file 0 row 17"``, the file path
when known). Such a step updates *no* trained model (actor and critic untouched, KL controller not
moved) and is counted as a NaN step (:func:`record_skipped_step`), as is a step whose update met a
non-finite loss or gradient norm: that optimizer step and the rest of the step's updates are skipped (a
failing critic update skips the actor's), while optimizer steps taken earlier in the same step (earlier
mini-batches, or the critic's before a failing actor update) stay. Past ``trainer.max_nan_steps`` such
steps the run stops (:class:`TrainingStopped`).

Only positions that take part are checked: per-token fields under ``response_mask``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch

from klppo.batch import Batch

log = logging.getLogger("klppo")

STEP_INPUTS = ("token_level_scores", "old_log_probs", "ref_log_probs", "values")
"""Fields filled before the KL penalty and advantages (checked first)."""
STEP_TARGETS = ("token_level_rewards", "advantages", "returns")
"""Fields computed from the inputs (checked before the updates)."""

_LABELS = {
    "token_level_scores": "the reward score",
    "old_log_probs": "the actor's log-prob",
    "ref_log_probs": "the reference log-prob",
    "values": "the critic's value",
    "token_level_rewards": "the reward after the KL penalty",
    "advantages": "the advantage",
    "returns": "the return",
}


class TrainingStopped(RuntimeError):
    """The run stopped on purpose (too many non-finite steps); the message says why and what to do."""


def _kind(value: float) -> str:
    return "NaN" if math.isnan(value) else ("+inf" if value > 0 else "-inf")


def data_row(uid: object, paths: Sequence[str] | None) -> str:
    """``"<file index>:<row>"`` (the loader's uid) as ``"<path> row <row>"`` (or ``"file i row r"``)."""
    text = str(uid)
    if ":" not in text:
        return f"uid {text}"
    f, row = text.split(":", 1)
    if paths is not None and f.isdigit() and int(f) < len(paths):
        return f"{paths[int(f)]} row {row}"
    return f"file {f} row {row}"


def find_nonfinite(batch: Batch, fields: Sequence[str], *, paths: Sequence[str] | None = None) -> str | None:
    """None if every checked value is finite, else one line naming the first bad one and how many."""
    mask = batch.response_mask
    for name in fields:
        t = getattr(batch, name, None)
        if t is None:
            continue
        t = t.detach()
        relevant = (
            mask.to(t.device) > 0
            if mask is not None and t.shape == mask.shape
            else torch.ones_like(t, dtype=torch.bool)
        )
        bad = ~torch.isfinite(t) & relevant
        if not bool(bad.any()):
            continue
        bad_rows = bad.reshape(len(t), -1).any(dim=1).nonzero().flatten().tolist()
        i = bad_rows[0]
        value = float(t[i][bad[i]].flatten()[0]) if t.dim() > 1 else float(t[i])
        source = batch.data_source[i] if batch.data_source else "?"
        where = data_row(batch.uid[i], paths) if batch.uid else f"sample {i}"
        more = f" ({len(bad_rows)} samples in all)" if len(bad_rows) > 1 else ""
        label = _LABELS.get(name, name)
        return f"{label} is {_kind(value)} for sample {i} (data source {source!r}, {where}){more}"
    return None


class NonFiniteStep(Exception):
    """Raised inside a step when a value the updates would use is not finite; the message names it."""


def check_finite(batch: Batch, fields: Sequence[str], *, paths: Sequence[str] | None = None) -> None:
    """:func:`find_nonfinite`, raising :class:`NonFiniteStep`."""
    reason = find_nonfinite(batch, fields, paths=paths)
    if reason is not None:
        raise NonFiniteStep(reason)


def check_kl(kl: float) -> None:
    """A non-finite batch KL (before the KL controller sees it) skips the step like any other value."""
    if not math.isfinite(kl):
        raise NonFiniteStep(f"the KL between the actor and the reference is {_kind(kl)}")


def record_skipped_step(step: int, reason: str, *, count: int, limit: int) -> int:
    """Count a skipped step (``reason``: what was non-finite), log one line, and stop the run past
    ``limit`` (< 0: never); returns the new count."""
    count += 1
    log.warning("step %d skipped, no model updated by it: %s (%d such steps so far)", step, reason, count)
    if 0 <= limit < count:
        raise TrainingStopped(
            f"{count} steps had non-finite values (limit trainer.max_nan_steps={limit}; the last: {reason}); "
            "those steps' updates were skipped and the last checkpoint is intact. Check the reward function "
            "and the data named above, lower actor_rollout_ref.actor.optim.lr (and critic.optim.lr), or "
            "raise the limit."
        )
    return count
