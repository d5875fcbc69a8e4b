"""Mixed steps (``data.logged_share`` strictly between 0 and 1): each step's prompts to generate for and its
logged samples, from a :class:`PromptLoader` and a :class:`LoggedLoader` that keep their own order, epochs
and positions.

A step is :class:`MixedBatch`: the prompt loader's batch (``train_batch_size`` minus the logged groups,
``rollout.n`` samples to be generated for each) and the logged loader's (whole groups of ``rollout.n``
samples, so that no GRPO/RLOO group mixes the two sources). An epoch is a pass over the prompts; the logs
wrap around on their own. Resume restores both positions. Knows nothing of models or the training loop.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from klppo.batch import Batch
from klppo.data.dataset import PromptLoader
from klppo.data.logged import LoggedLoader


@dataclasses.dataclass(frozen=True)
class MixedBatch:
    """One mixed step's data: ``prompts`` to generate for (no responses) and ``logged`` samples (whole
    groups, responses and ``from_logs`` set)."""

    prompts: Batch
    logged: Batch

    def to(self, device: torch.device | str) -> MixedBatch:
        return MixedBatch(self.prompts.to(device), self.logged.to(device))


class MixedLoader:
    """Batches of prompts and of logged groups together, one :class:`MixedBatch` per step."""

    def __init__(self, prompts: PromptLoader, logged: LoggedLoader) -> None:
        self.prompts, self.logged = prompts, logged

    @property
    def source(self) -> Any:
        """The prompt files (a generated sample's ``uid`` names its row there)."""
        return self.prompts.source

    def __len__(self) -> int:
        """Steps per epoch: an epoch is a pass over the prompts."""
        return len(self.prompts)

    def next_batch(self) -> MixedBatch:
        return MixedBatch(self.prompts.next_batch(), self.logged.next_batch())

    def summary(self) -> str:
        """One line: the step's split, then each loader's own summary."""
        p, g = self.prompts.batch_size, self.logged.settings.groups_per_batch
        return (
            f"{p} prompts generated for and {g} logged groups per step; prompts: {self.prompts.summary()}; "
            f"logs: {self.logged.summary()}"
        )

    def state_dict(self) -> dict[str, dict[str, int]]:
        return {"prompts": self.prompts.state_dict(), "logged": self.logged.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if set(state) != {"prompts", "logged"}:
            raise ValueError(
                "the checkpoint's loader state is not a mixed run's (data.logged_share strictly between 0 "
                "and 1): it holds one loader's position, this run reads prompts and logs"
            )
        self.prompts.load_state_dict(state["prompts"])
        self.logged.load_state_dict(state["logged"])
