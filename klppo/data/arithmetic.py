"""A small built-in arithmetic prompt set in GSM8K format, for the quickstart and offline demos.

Questions are two-digit sums and differences ("What is 23 + 45?"; differences are never negative unless
``negative=True``, the distribution of ``bench/learning.py``), the prompt
carries GSM8K's instruction, the ground truth is the result as a string, and ``data_source`` is
``arithmetic`` (``DATA_SOURCE``), which names the task in the metrics (``val-core/arithmetic/reward/mean@1``);
the reward registry scores it with GSM8K's rule (the same ``#### <answer>`` format). Deterministic given
``seed``; train and test questions are disjoint.

With ``interaction=NAME`` each row also carries ``extra_info.interaction_kwargs`` = ``{name: NAME,
ground_truth: <result>}``, what a multi-turn run's interaction reads (verl's field; e.g. the retry of
``examples/arithmetic_grpo_retry.yaml``: docs/training.md, "Multi-turn and tools").
"""

from __future__ import annotations

import os
import random

from klppo.data.gsm8k import make_row, write_rows

DATA_SOURCE = "arithmetic"


def arithmetic_rows(
    num_rows: int,
    *,
    split: str,
    seed: int,
    exclude: set[str] | None = None,
    negative: bool = False,
    interaction: str | None = None,
) -> list[dict]:
    """``num_rows`` distinct questions (none in ``exclude``) as verl-format rows; with ``negative`` the
    operands of a difference keep their drawn order, so about half the differences are negative; with
    ``interaction`` the rows name it in ``extra_info.interaction_kwargs`` (module docstring)."""
    rng = random.Random(f"klppo-arithmetic-{seed}-{split}")
    seen = set(exclude or ())
    rows: list[dict] = []
    if num_rows > 2 * 90 * 90 - len(seen):
        raise ValueError(
            f"at most {2 * 90 * 90 - len(seen)} distinct two-digit questions remain, asked {num_rows}"
        )
    while len(rows) < num_rows:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        if rng.random() < 0.5:
            question, result, op = f"What is {a} + {b}?", a + b, "+"
        else:
            if not negative:
                a, b = max(a, b), min(a, b)
            question, result, op = f"What is {a} - {b}?", a - b, "-"
        if question in seen:
            continue
        seen.add(question)
        answer = f"{a} {op} {b} = {result}\n#### {result}"
        row = make_row(question, answer, split=split, index=len(rows), data_source=DATA_SOURCE)
        if interaction is not None:
            row["extra_info"]["interaction_kwargs"] = {"name": interaction, "ground_truth": str(result)}
        rows.append(row)
    return rows


def write_arithmetic_parquet(
    output_dir: str | os.PathLike,
    num_train: int = 256,
    num_test: int = 64,
    seed: int = 0,
    *,
    negative: bool = False,
    interaction: str | None = None,
) -> tuple[str, str]:
    """Write ``train.parquet`` and ``test.parquet`` (disjoint questions) into ``output_dir``; returns their
    paths. ``negative``, ``interaction``: as :func:`arithmetic_rows`'s."""
    output_dir = os.path.expanduser(os.fspath(output_dir))
    os.makedirs(output_dir, exist_ok=True)
    train = arithmetic_rows(num_train, split="train", seed=seed, negative=negative, interaction=interaction)
    test = arithmetic_rows(
        num_test,
        split="test",
        seed=seed,
        exclude={r["extra_info"]["question"] for r in train},
        negative=negative,
        interaction=interaction,
    )
    paths = os.path.join(output_dir, "train.parquet"), os.path.join(output_dir, "test.parquet")
    write_rows(train, paths[0])
    write_rows(test, paths[1])
    return paths
