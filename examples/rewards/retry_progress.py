"""Reward for retry conversations that pays for a corrected answer: the last answer's score plus a progress
bonus, the shaping of SCoRe (Kumar et al. 2024, *Training Language Models to Self-Correct via Reinforcement
Learning*, arXiv:2409.12917):

    r = r_last + progress_bonus · (r_last − r_first)

``r_last`` is the rule's score of the response (verl's GSM8K rule reads the last number of its last 300
characters: the last answer's), ``r_first`` the interaction's verdict on the first answer
(``extra_info["turn_scores"][0]``, which klppo's multi-turn rollout passes to the reward). A conversation the
first answer ended (``r_first = r_last``) and a one-turn sample (no ``turn_scores``) get ``r_last``; a wrong
first answer corrected gets ``1 + progress_bonus``; a right one spoiled would lose as much. Under the plain
reward (``progress_bonus = 0``) every model token of a conversation gets its advantage, the wrong first
answer of a corrected conversation too, and a small model learns to repeat its first answer on the retry
(docs/multi_turn.md, "Teaching the retry").

    custom_reward_function.path=examples/rewards/retry_progress.py
    reward_model.reward_kwargs={method: flexible, progress_bonus: 1.0}
"""

from __future__ import annotations

from klppo.rewards.gsm8k import compute_score as rule_score


def compute_score(
    data_source, solution_str, ground_truth, extra_info=None, method="flexible", progress_bonus=1.0, **kwargs
):
    last = float(rule_score(solution_str, ground_truth, method=method))
    turns = (extra_info or {}).get("turn_scores") or []
    first = float(turns[0]) if len(turns) else last
    return last + progress_bonus * (last - first)
