"""examples/rewards/retry_progress.py through the reward manager, as a run loads it: the last answer's
score plus the progress bonus over the interaction's verdict on the first answer (hand-computed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from klppo.rewards.registry import RewardManager

PATH = Path(__file__).resolve().parents[2] / "examples" / "rewards" / "retry_progress.py"
RETRY = "user\nYour response is incorrect! You need to reflect on your answer and try again.\nassistant\n"


@pytest.mark.parametrize("bonus", [0.0, 1.0, 0.5])
def test_progress_bonus_pays_for_a_corrected_answer(bonus):
    manager = RewardManager(
        custom_fn_path=str(PATH), reward_kwargs={"method": "flexible", "progress_bonus": bonus}
    )
    responses = [
        "The answer is 12",  # right at once: one verdict, 1
        "The answer is 11" + RETRY + "Sorry, it is 12",  # corrected
        "The answer is 11" + RETRY + "It is 11",  # wrong twice
        "The answer is 12",  # a one-turn sample: no verdicts
    ]
    infos = [{"turn_scores": [1.0]}, {"turn_scores": [0.0]}, {"turn_scores": [0.0]}, {}]
    scores = manager.score(responses, ["arithmetic"] * 4, ["12"] * 4, infos)
    assert scores == [1.0, 1.0 + bonus, 0.0, 1.0]
