"""The typed batch that flows through one PPO step.

A `Batch` holds `B` rows (samples = prompts × rollout.n). Tensor fields are indexed along dim 0;
list fields hold one Python object per row. Each stage of the step fills its own fields; a field that a
stage has not produced yet is ``None``. No string-keyed dictionaries of tensors.

Shapes (P = prompt length, left-padded; R = response length, right-padded):

- ``prompts`` [B, P] int64, ``prompt_mask`` [B, P] (1 = real prompt token)
- ``responses`` [B, R] int64, ``response_mask`` [B, R] (1 = generated token, EOS included): the tokens that
  losses, KL and advantages count (rollout rejection sampling sets the rejected ones to 0)
- ``response_attention_mask`` [B, R]: 1 on every real response token — with the tool / user tokens a
  multi-turn rollout appended and the tokens rollout rejection left out (``response_mask`` 0 on them) — or
  ``None`` (equals ``response_mask``)
- ``rollout_log_probs`` [B, R] float32: log-prob of each sampled token under the distribution the rollout
  drew it from (the behaviour policy; with top-k / top-p, the truncated, renormalised one)
- ``rollout_log_kept_mass`` [B, R] float32: with top-k / top-p, the log of the kept set's mass under the
  engine's full tempered softmax at each token (≤ 0; :mod:`klppo.algorithms.sampling`), so that
  ``rollout_log_probs`` + it is the engine's full-softmax log-prob, the counterpart of the trainer's forward
  (:func:`rollout_softmax_log_probs`); ``None``: 0 (untruncated, or logged samples, whose logs hold the
  sampled law's log-probs only)
- ``old_log_probs`` / ``ref_log_probs`` / ``values`` [B, R] float32
- ``token_level_scores`` / ``token_level_rewards`` / ``advantages`` / ``returns`` [B, R] float32
- ``reward_baselines`` [B] float32: the score of the greedy response to the sample's prompt (estimators
  that subtract it, e.g. ReMax); ``None`` otherwise
- ``rollout_is_weights`` [B, R] float32: rollout correction's importance weights π_old / π_rollout (truncated
  or masked, 0 at padding; ``algorithm.rollout_correction.rollout_is`` in decoupled mode), else ``None``
- ``from_logs`` [B] bool: True on a sample read from logged responses (``data.logged_files``), False on one
  generated in the step; ``None`` when every sample was generated
- ``host_mask``: a host (numpy) copy of ``attention_mask`` [B, P+R] bool, or ``None``. The roles' passes set
  it once per pass (:meth:`Batch.with_host_mask`: one device→host copy) so that micro-batching, trimming
  and packing read lengths and token positions on the host instead of syncing with the device once per
  micro-batch. ``select`` indexes it; ``replace`` of a mask or token field drops it; ``concat`` keeps it
  only when every part has one.
- ``host_response_mask``: a host copy of ``response_mask`` [B, R] bool, set with ``host_mask`` where the
  two differ on the response (``response_attention_mask`` set: appended tool tokens, rejected tokens),
  else ``None``; :attr:`Batch.host_loss_mask` reads the tokens a loss counts from either.
- ``data_source`` / ``ground_truth`` / ``uid`` / ``extra_info`` / ``raw_prompt``: lists of length B
  (``uid`` identifies the prompt a sample came from: the group for GRPO/RLOO)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

TENSOR_FIELDS = (
    "prompts",
    "prompt_mask",
    "responses",
    "response_mask",
    "response_attention_mask",
    "rollout_log_probs",
    "rollout_log_kept_mass",
    "old_log_probs",
    "ref_log_probs",
    "values",
    "token_level_scores",
    "token_level_rewards",
    "advantages",
    "returns",
    "reward_baselines",
    "rollout_is_weights",
    "from_logs",
)
LIST_FIELDS = ("data_source", "ground_truth", "uid", "extra_info", "raw_prompt")
ZERO_WHEN_UNSET = ("rollout_log_kept_mass",)
"""Tensor fields whose ``None`` means zeros: :meth:`Batch.concat` joins a part without one to parts with."""
HOST_FIELDS = ("host_mask", "host_response_mask")


@dataclasses.dataclass
class Batch:
    prompts: torch.Tensor
    prompt_mask: torch.Tensor
    responses: torch.Tensor | None = None
    response_mask: torch.Tensor | None = None
    response_attention_mask: torch.Tensor | None = None
    rollout_log_probs: torch.Tensor | None = None
    rollout_log_kept_mass: torch.Tensor | None = None
    old_log_probs: torch.Tensor | None = None
    ref_log_probs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    token_level_scores: torch.Tensor | None = None
    token_level_rewards: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    reward_baselines: torch.Tensor | None = None
    rollout_is_weights: torch.Tensor | None = None
    from_logs: torch.Tensor | None = None
    data_source: list[str] = dataclasses.field(default_factory=list)
    ground_truth: list[Any] = dataclasses.field(default_factory=list)
    uid: list[Any] = dataclasses.field(default_factory=list)
    extra_info: list[Any] = dataclasses.field(default_factory=list)
    raw_prompt: list[Any] = dataclasses.field(default_factory=list)
    host_mask: np.ndarray | None = dataclasses.field(default=None, repr=False, compare=False)
    host_response_mask: np.ndarray | None = dataclasses.field(default=None, repr=False, compare=False)

    def __len__(self) -> int:
        return int(self.prompts.shape[0])

    # ---- derived views -------------------------------------------------------------------------
    @property
    def input_ids(self) -> torch.Tensor:
        """[B, P+R] prompt followed by response."""
        assert self.responses is not None, "no responses yet"
        return torch.cat([self.prompts, self.responses], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        """[B, P+R] 1 on real prompt tokens and response tokens (appended tool / user tokens included)."""
        return torch.cat([self.prompt_mask, self.response_tokens_mask.to(self.prompt_mask.dtype)], dim=1)

    @property
    def response_tokens_mask(self) -> torch.Tensor:
        """[B, R] 1 on every real response token: ``response_attention_mask``, else ``response_mask``."""
        assert self.response_mask is not None, "no responses yet"
        return self.response_mask if self.response_attention_mask is None else self.response_attention_mask

    @property
    def position_ids(self) -> torch.Tensor:
        """[B, P+R] positions counting from the first real token (0 on left padding)."""
        return (self.attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)

    @property
    def host_loss_mask(self) -> np.ndarray | None:
        """[B, R] bool on the host: the tokens the losses count (``response_mask``), from the copies
        :meth:`with_host_mask` made; ``None`` without them."""
        if self.host_response_mask is not None:
            return self.host_response_mask
        if self.host_mask is None:
            return None
        return self.host_mask[:, self.host_mask.shape[1] - self.response_length :]

    @property
    def response_length(self) -> int:
        assert self.responses is not None
        return int(self.responses.shape[1])

    # ---- row operations ------------------------------------------------------------------------
    def select(self, index: torch.Tensor | Sequence[int]) -> Batch:
        """Rows ``index`` (in that order) as a new batch; tensors are indexed, not copied where possible."""
        idx = torch.as_tensor(index, dtype=torch.long)
        out: dict[str, Any] = {}
        on_device: dict[torch.device, torch.Tensor] = {}  # asynchronous copies: a blocking one syncs
        for name in TENSOR_FIELDS:
            t = getattr(self, name)
            if t is not None and t.device not in on_device:
                on_device[t.device] = idx.to(t.device, non_blocking=idx.device.type == "cpu")
            out[name] = None if t is None else t[on_device[t.device]]
        idx_list = idx.tolist() if isinstance(index, torch.Tensor) else [int(i) for i in index]
        for name in LIST_FIELDS:
            values = getattr(self, name)
            out[name] = [values[i] for i in idx_list] if values else []
        for name in HOST_FIELDS:
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)[idx_list]
        return Batch(**out)

    def split(self, size: int) -> list[Batch]:
        """Consecutive chunks of ``size`` rows (the last may be shorter)."""
        if size <= 0:
            raise ValueError(f"split size must be positive, got {size}")
        n = len(self)
        return [self.select(range(i, min(i + size, n))) for i in range(0, n, size)]

    def chunk(self, num_chunks: int) -> list[Batch]:
        """``num_chunks`` consecutive chunks of equal size; ``len(self)`` must be divisible."""
        n = len(self)
        if n % num_chunks:
            raise ValueError(f"cannot chunk {n} rows into {num_chunks} equal parts")
        return self.split(n // num_chunks)

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        if not batches:
            raise ValueError("concat of no batches")
        out: dict[str, Any] = {}
        for name in TENSOR_FIELDS:
            ts = [getattr(b, name) for b in batches]
            if all(t is None for t in ts):
                out[name] = None
            elif name in ZERO_WHEN_UNSET:  # 0 is the field's meaning where a part has none
                out[name] = torch.cat([_zeros_where_unset(t, b) for t, b in zip(ts, batches)], dim=0)
            elif any(t is None for t in ts):
                raise ValueError(f"field {name} is set in some batches only")
            else:
                out[name] = torch.cat(ts, dim=0)
        for name in LIST_FIELDS:
            out[name] = [v for b in batches for v in getattr(b, name)]
        for name in HOST_FIELDS:
            if all(getattr(b, name) is not None for b in batches):
                out[name] = np.concatenate([getattr(b, name) for b in batches], axis=0)
        return Batch(**out)

    def repeat_interleave(self, n: int) -> Batch:
        """Each row repeated ``n`` times consecutively (prompts → samples)."""
        return self.select(torch.arange(len(self)).repeat_interleave(n))

    def to(self, device: torch.device | str) -> Batch:
        changes = {
            name: getattr(self, name).to(device) for name in TENSOR_FIELDS if getattr(self, name) is not None
        }
        return dataclasses.replace(self, **changes)

    def replace(self, **changes: Any) -> Batch:
        if "host_mask" not in changes and _MASK_SOURCES.intersection(changes):
            changes.update(dict.fromkeys(HOST_FIELDS))  # they would no longer match the new masks
        return dataclasses.replace(self, **changes)

    def with_host_mask(self) -> Batch:
        """This batch with ``host_mask`` (and ``host_response_mask`` where the response mask is not the
        response's attention) set: one device→host copy unless they are set already."""
        if self.host_mask is not None or self.response_mask is None:
            return self
        attention = self.attention_mask.bool()
        if self.response_attention_mask is None:
            return dataclasses.replace(self, host_mask=attention.cpu().numpy())
        both = torch.cat([attention, self.response_mask.bool()], dim=1).cpu().numpy()
        width = attention.shape[1]
        return dataclasses.replace(self, host_mask=both[:, :width], host_response_mask=both[:, width:])


def rollout_softmax_log_probs(rows: Batch | Any) -> torch.Tensor | None:
    """[B, R] the rollout's log-probs under the full tempered softmax, ``rollout_log_probs`` +
    ``rollout_log_kept_mass`` (the counterpart of the trainer's forward), of a batch or of anything with
    those two fields (an update's micro-batch fields); None without rollout log-probs."""
    if rows.rollout_log_probs is None or rows.rollout_log_kept_mass is None:
        return rows.rollout_log_probs
    return rows.rollout_log_probs + rows.rollout_log_kept_mass


def _zeros_where_unset(t: torch.Tensor | None, part: Batch) -> torch.Tensor:
    """``t``, or float32 zeros shaped like ``part``'s responses."""
    if t is not None:
        return t
    return torch.zeros(part.responses.shape, dtype=torch.float32, device=part.responses.device)


_MASK_SOURCES = frozenset({"prompts", "prompt_mask", "responses", "response_mask", "response_attention_mask"})
