"""Registry by data_source, custom reward functions, and score placement on tokens."""

from __future__ import annotations

import pytest
import torch

from klppo.rewards import RewardManager, get_scorer, load_custom_reward_fn, place_scores
from klppo.rewards import gsm8k as gsm8k_scorer
from klppo.rewards import math as math_scorer
from klppo.rewards.registry import RewardFunctionError


def test_routing_by_data_source():
    for source in ("openai/gsm8k", "gsm8k"):
        assert get_scorer(source) is gsm8k_scorer.compute_score
    for source in ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "math"):
        assert get_scorer(source) is math_scorer.compute_score
    with pytest.raises(ValueError, match=r"'my/set'.*openai/gsm8k.*custom_reward_function"):
        get_scorer("my/set")


def test_the_arithmetic_set_is_named_for_its_task_and_scored_as_gsm8k():
    """The built-in arithmetic rows carry data_source `arithmetic` (its metrics say `arithmetic/...`), scored
    by GSM8K's rule: they are written in GSM8K's `#### <answer>` format."""
    from klppo.data.arithmetic import arithmetic_rows

    rows = arithmetic_rows(3, split="test", seed=0)
    assert {r["data_source"] for r in rows} == {"arithmetic"}
    assert get_scorer("arithmetic") is gsm8k_scorer.compute_score
    truth = rows[0]["reward_model"]["ground_truth"]
    assert RewardManager().score([f"#### {truth}", "#### x"], ["arithmetic"] * 2, [truth] * 2, [{}] * 2) == [
        1.0,
        0.0,
    ]


def test_manager_builtin_scores_and_kwargs():
    mgr = RewardManager()
    out = mgr.score(
        ["#### 72", "72", r"\boxed{3}", r"\boxed{4}"],
        ["openai/gsm8k", "gsm8k", "math", "lighteval/MATH"],
        ["72", "72", "3", "3"],
        [{}, {}, {}, {}],
    )
    assert out == [1.0, 0.0, 1.0, 0.0]
    assert all(isinstance(x, float) for x in out)
    # GSM8K kwargs reach the GSM8K scorer and are not passed to the boxed scorer.
    flex = RewardManager(reward_kwargs={"method": "flexible", "score": 2.0})
    assert flex.score(["72", r"\boxed{3}"], ["gsm8k", "math"], ["72", "3"], [None, None]) == [2.0, 1.0]
    with pytest.raises(ValueError, match=r"\['methd'\].*accepted"):
        RewardManager(reward_kwargs={"methd": "flexible"})
    with pytest.raises(ValueError, match="differ in length"):
        mgr.score(["a"], ["gsm8k"], [], [{}])
    with pytest.raises(ValueError, match="registered"):
        mgr.score(["a"], ["unknown"], ["1"], [{}])


def test_custom_function_verl_style(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):\n"
        "    return {'score': float(solution_str == ground_truth) + bonus + extra_info['w'], 'acc': 1}\n"
        "def plain(data_source, solution_str, ground_truth, extra_info=None):\n    return len(data_source)\n"
        "VALUE = 3\n"
    )
    mgr = RewardManager(custom_fn_path=str(path), reward_kwargs={"bonus": 0.5})
    assert mgr.score(["a", "b"], ["x", "y"], ["a", "a"], [{"w": 0.0}, {"w": 1.0}]) == [1.5, 1.5]
    plain = RewardManager(custom_fn_path=str(path), custom_fn_name="plain")
    assert plain.score(["r"], ["abcd"], [None], [None]) == [4.0]
    with pytest.raises(FileNotFoundError, match="not found"):
        load_custom_reward_fn(str(tmp_path / "missing.py"), "compute_score")
    with pytest.raises(ValueError, match=r"no 'score_fn'.*compute_score.*plain"):
        load_custom_reward_fn(str(path), "score_fn")
    with pytest.raises(ValueError, match="not callable"):
        load_custom_reward_fn(str(path), "VALUE")
    bad = tmp_path / "broken.py"
    bad.write_text("import does_not_exist_xyz\n")
    with pytest.raises(RewardFunctionError, match="importing"):  # a ValueError: one line at start-up
        load_custom_reward_fn(str(bad), "compute_score")


def test_place_scores_matches_loop_reference():
    gen = torch.Generator().manual_seed(0)
    lengths = [0, 1, 5, 7, 3]
    mask = torch.zeros(5, 7, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
    scores = torch.randn(5, generator=gen)
    out = place_scores(scores, mask)
    expected = torch.zeros(5, 7, dtype=torch.float64)
    for b, n in enumerate(lengths):
        if n:
            expected[b, n - 1] = float(scores[b])
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected)
    assert out[0].abs().sum() == 0  # empty response → all-zero row
    with pytest.raises(ValueError):
        place_scores(scores[:3], mask)


def test_batch_and_dapo_reward_managers(tmp_path):
    from klppo.rewards import RewardManager

    fn = tmp_path / "batched.py"
    fn.write_text(
        "def compute_score(data_sources, solution_strs, ground_truths, extra_infos, bonus=0.0):\n"
        "    return [{'score': float(len(s)) + bonus} for s in solution_strs]\n"
    )
    batch = RewardManager(custom_fn_path=str(fn), reward_kwargs={"bonus": 0.5}, reward_manager="batch")
    assert batch.score(["ab", "abcd"], ["x", "x"], [None, None], [{}, {}]) == [2.5, 4.5]
    with pytest.raises(ValueError, match="needs custom_reward_function.path"):
        RewardManager(reward_manager="batch")

    # DAPO soft overlong penalty: max 20 tokens, buffer 8 → expected 12; L=16 → −(4/8)·1.0 = −0.5
    kwargs = {"overlong_buffer_cfg": {"enable": True, "len": 8, "penalty_factor": 1.0}, "max_resp_len": 20}
    dapo = RewardManager(reward_kwargs=kwargs, reward_manager="dapo")
    answers = ["#### 7", "#### 7", "#### 3"]
    got = dapo.score(answers, ["openai/gsm8k"] * 3, ["7", "7", "7"], [{}] * 3, [10, 16, 20])
    assert got == pytest.approx([1.0, 0.5, -1.0])
    with pytest.raises(ValueError, match="response lengths"):
        dapo.score(answers, ["openai/gsm8k"] * 3, ["7"] * 3, [{}] * 3)
    with pytest.raises(ValueError, match="built are"):
        RewardManager(reward_manager="prime")


def test_a_score_that_is_not_a_number_names_the_function_and_row(tmp_path, monkeypatch):
    from klppo.rewards import registry

    fn = tmp_path / "bad.py"
    fn.write_text(
        "def compute_score(ds, s, gt, extra=None, **kw):\n    return {'ok': 1.0, 'x': None}.get(s, '1')\n"
    )
    mgr = RewardManager(custom_fn_path=str(fn))
    with pytest.raises(ValueError, match=rf"custom_reward_function {fn}:compute_score, row 1, returned None"):
        mgr.score(["ok", "x"], ["d", "d"], ["1", "1"], [{}, {}])
    with pytest.raises(ValueError, match=r"row 0, returned '1' \(str\)"):  # a string is a bug, not a score
        mgr.score(["str"], ["d"], ["1"], [{}])
    monkeypatch.setitem(registry.SCORERS, "mine", lambda s, g: {"score": [1]})
    with pytest.raises(ValueError, match=r"the scorer for data_source 'mine' .*row 0, returned \[1\]"):
        RewardManager().score(["a"], ["mine"], ["1"], [{}])
    monkeypatch.setitem(registry.SCORERS, "ok", lambda s, g: {"score": True})
    assert RewardManager().score(["a"], ["ok"], ["1"], [{}]) == [1.0]


def test_what_a_reward_function_raises_is_one_line_naming_it_and_the_row(tmp_path):
    path = tmp_path / "fn.py"
    path.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):\n"
        "    return extra_info['oops']\n"
        "def two(a, b):\n    return 1.0\n"
    )
    raising = RewardManager(custom_fn_path=str(path))
    with pytest.raises(RewardFunctionError) as err:
        raising.score(["a", "b"], ["s", "s"], [None, None], [{"oops": 1.0}, {}], first_row=4)
    assert str(err.value).startswith(
        f"custom_reward_function {path}:compute_score, row 5 raised KeyError: 'oops'"
    )
    assert isinstance(err.value.__cause__, KeyError) and "\n" not in str(err.value)
    with pytest.raises(
        RewardFunctionError, match=r"two, row 0 raised TypeError: .*takes 2 positional arguments"
    ):
        RewardManager(custom_fn_path=str(path), custom_fn_name="two").score(["a"], ["s"], [None], [None])
    with pytest.raises(
        RewardFunctionError, match=r"the scorer for data_source 'openai/gsm8k' .*row 0 raised"
    ):
        RewardManager().score(["#### 1"], ["openai/gsm8k"], [object.__new__(_Unprintable)], [None])


class _Unprintable:
    def __eq__(self, other):
        raise RuntimeError("cannot compare")

    def __str__(self):
        raise RuntimeError("cannot print")


def test_a_score_that_is_no_number_is_a_reward_function_error(tmp_path):
    """The trainer ends the run on RewardFunctionError with one line: a bad return value is one too (it
    was a plain ValueError, a traceback), and so is the scoring processes' own class."""
    from klppo.roles.reward_worker import RewardFunctionError as WorkerError

    path = tmp_path / "fn.py"
    path.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw):\n    return 'x'\n"
    )
    with pytest.raises(RewardFunctionError, match="returned 'x' \\(str\\)"):
        RewardManager(custom_fn_path=str(path)).score(["a"], ["s"], [None], [None])
    assert issubclass(WorkerError, RewardFunctionError)


def test_the_static_check_of_a_reward_file(tmp_path):
    """Refused only when the name is surely unbound on import; files that bind names the parser cannot see
    are not judged; a __main__ block binds nothing on import; a BOM or coding cookie parses."""
    from klppo.rewards.registry import check_custom_reward_file

    def check(text: str | bytes, name: str = "compute_score") -> None:
        path = tmp_path / "fn.py"
        (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)
        check_custom_reward_file(str(path), name)

    body = "def compute_score(*a, **k):\n    return 0.0\n"
    check(body + "if __name__ == '__main__':\n    print(compute_score())\n")
    with pytest.raises(RewardFunctionError, match="defines no 'compute_scores'"):
        check(body + "if __name__ == '__main__':\n    compute_scores = 1\n", "compute_scores")
    check("from os.path import *\n", "anything")  # not judged
    check("globals()['compute_score'] = len\n")  # not judged
    check("compute_score, other = len, 1\n")
    check("if True:\n    (compute_score := len)\n")
    check("try:\n    from fast import compute_score\nexcept ImportError:\n    compute_score = len\n")
    check(b"\xef\xbb\xbf" + body.encode())
    check("# -*- coding: latin-1 -*-\n# caf\xe9\n".encode("latin-1") + body.encode())


def test_a_batched_function_that_returns_the_wrong_count_is_one_line(tmp_path):
    path = tmp_path / "fn.py"
    path.write_text(
        "def compute_score(data_sources, solution_strs, ground_truths, extra_infos, **kw):\n    return None\n"
    )
    with pytest.raises(RewardFunctionError, match=r"\(batched\) returned NoneType for 2 responses"):
        RewardManager(custom_fn_path=str(path), reward_manager="batch").score(
            ["a", "b"], ["s"] * 2, [0, 0], [{}, {}]
        )


def test_only_the_exact_main_guard_hides_a_binding_and_invisible_binders_are_not_judged(tmp_path):
    from klppo.rewards.registry import check_custom_reward_file

    def check(text: str) -> None:
        path = tmp_path / "fn.py"
        path.write_text(text)
        check_custom_reward_file(str(path), "compute_score")

    check("if __name__ != '__main__':\n    def compute_score(*a):\n        return 0.0\n")
    check("if not __name__ == '__main__':\n    compute_score = len\n")
    check("if __name__ == '__main__' or True:\n    compute_score = len\n")
    check("import sys\nsys.modules[__name__].compute_score = len\n")
    check("import builtins\nbuiltins.exec('def compute_score(*a): return 0.0')\n")
    check("def __getattr__(name):\n    return len\n")
    with pytest.raises(RewardFunctionError, match="defines no 'compute_score'"):
        check("if '__main__' == __name__:\n    compute_score = len\n")
