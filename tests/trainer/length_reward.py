"""A reward every batch of random responses varies in (their length in characters): for tests whose subject
needs a policy gradient (GRPO's advantage is zero in a group of equal scores). The arithmetic scorer gives a
random tiny model a nonzero score only by luck, which a new library version's sampling stream can take away
(all scores 0: no gradient)."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **reward_kwargs) -> float:
    return len(solution_str) / 32.0
