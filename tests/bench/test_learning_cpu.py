"""bench/learning.py mechanically on CPU with a tiny model: two settings run as `klppo train` processes,
each stopped by SIGTERM once its summed step time reaches the budget, evaluated before/after on the
held-out set, and summarised (the real figures need the GPU and SmolLM2)."""

from __future__ import annotations

import json

import pytest

from bench import arith_reward
from bench.learning import main, source_hash

TINY = [
    "trainer.device=cpu",
    "trainer.n_gpus_per_node=1",
    "trainer.logger=[jsonl]",
    "data.train_batch_size=4",
    "data.max_response_length=8",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.rollout.name=hf",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.optim.lr=1e-3",
]


def test_answer_extraction():
    assert arith_reward.flexible_answer("so 23 - 45 = -22.") == "-22"
    assert arith_reward.flexible_answer("It is $1,000.") == "1000"
    assert arith_reward.flexible_answer("no digits") is None
    assert arith_reward.strict_answer("work 12\n#### 42.") == "42"
    assert arith_reward.strict_answer("The answer is 42") is None
    score = arith_reward.compute_score
    assert score("s", "The answer is -22.", "-22") == 1.0
    assert score("s", "The answer is -22.", "-22", method="strict") == 0.0
    assert score("s", "#### 7", "8", method="strict_shaped") == pytest.approx(0.1)
    assert score("s", "it is 8", "8", method="strict_shaped") == pytest.approx(0.2)
    assert score("s", "#### 8", "8", method="strict_shaped") == 1.0


@pytest.mark.slow
def test_learning_bench_runs_and_stops_on_budget(tmp_path, capsys):
    from klppo.models.tiny import save_tiny_model_dir

    model = save_tiny_model_dir(tmp_path / "model", num_layers=2, hidden_size=64)
    out = tmp_path / "learning.json"
    # every group of the tiny model scores 0: the learning-signal rule warns at step 1 with a patience of 1
    argv = [
        "--settings",
        "pi=grpo_pi,actor_rollout_ref.actor.kl_loss_ctrl.target_kl=0.01,"
        "monitor.learning_signal.patience_steps=1",
        "--train-seconds",
        "1",
        "--model",
        str(model),
        "--num-train",
        "64",
        "--num-test",
        "6",
        "--eval-every",
        "1",
        "--workdir",
        str(tmp_path / "work"),
        "--out",
        str(out),
        "--extra",
        *TINY,
    ]
    assert main(argv) == 0
    results = {r["name"]: r for r in json.loads(out.read_text())["results"]}
    r = results["pi"]
    steps = r["series"]["step_s"]
    assert r["exit_code"] == 0 and r["steps"] == len(steps) >= 1
    # stopped by the budget: the signal goes once the finished steps plus one more reach it (≤ 1 step over)
    assert sum(steps[:-2]) < 1.0 and r["steps"] < 100000
    assert r["train_seconds"] == pytest.approx(sum(steps))
    assert r["accuracy_before"]["n"] == r["accuracy_after"]["n"] == 6
    assert len(r["series"]["kl_k3"]) == r["steps"] and r["series"]["kl_k3"][0] == pytest.approx(0, abs=1e-6)
    for phase in ("gen_s", "ref_s", "update_actor_s"):  # the phases of each step, inside its time
        assert all(0 < t <= s for t, s in zip(r["series"][phase], steps, strict=True))
    assert r["target_kl"] == 0.01
    report = json.loads(out.read_text())
    assert report["source_sha256"] == source_hash() and len(report["source_sha256"]) == 16
    # --eval-every 1: a held-out reading after every step, each beside the KL of the steps before it
    traj = r["trajectory"]
    assert r["steps"] >= 2  # else this checks little
    assert [p["step"] for p in traj] == list(range(1, r["steps"] + 1))
    assert traj[-1]["flexible"] == r["accuracy_after"]["flexible"]
    assert all(p["n"] == 6 and p["kl_k3_20"] is not None for p in traj)
    # the share of equal-score groups each step, and the run means printed under the table
    assert len(r["series"]["equal_groups"]) == r["steps"]
    assert all(0 <= x <= 1 for x in r["series"]["equal_groups"])
    printed = capsys.readouterr().out
    assert "pi means over the run: step_s " in printed
    # the operating rules' events reach the results (the trainer's console is not kept)
    assert r["series"]["equal_groups"][0] == 1.0  # else the rule has no reason to fire
    assert {"step": 1, "rule": "learning_signal", "action": "warn"}.items() <= r["monitor_events"][0].items()
    assert "pi monitor: learning_signal/warn at step 1" in printed


def test_response_kl_is_the_mean_of_per_step_products_over_the_last_20_steps():
    from bench.learning import response_kl

    kl = [9.0] * 5 + [0.1 * (i % 3) for i in range(20)]  # the first 5 steps are outside the window
    length = [1.0] * 5 + [10.0 + i for i in range(20)]
    by_hand = sum(0.1 * (i % 3) * (10.0 + i) for i in range(20)) / 20
    assert response_kl({"kl_k1": kl, "length": length}) == pytest.approx(by_hand, rel=1e-12)
    assert response_kl({"kl_k1": [None, 0.2], "length": [5.0, 30.0]}) == pytest.approx(6.0)
    assert response_kl({"kl_k1": [], "length": []}) is None


def test_a_setting_refused_at_load_shows_the_trainers_message(tmp_path, capsys):
    """A setting whose configuration the trainer refuses (here the PI controller's floor above its start)
    ends before its first step: the table names the trainer's one-line reason, not a missing file."""
    from klppo.models.tiny import save_tiny_model_dir

    model = save_tiny_model_dir(tmp_path / "model", num_layers=1, hidden_size=32)
    out = tmp_path / "learning.json"
    argv = [
        "--settings",
        "bad=grpo_pi,actor_rollout_ref.actor.kl_loss_ctrl.min_coef=0.06",
        "--train-seconds",
        "1",
        "--model",
        str(model),
        "--num-train",
        "16",
        "--num-test",
        "4",
        "--workdir",
        str(tmp_path / "work"),
        "--out",
        str(out),
        "--extra",
        *TINY,
    ]
    main(argv)
    (r,) = json.loads(out.read_text())["results"]
    assert r["exit_code"] != 0
    assert "kl_loss_ctrl.min_coef=0.06" in r["error"] and r["error"].startswith(f"exit {r['exit_code']}:")
    assert f"| bad | failed: exit {r['exit_code']}:" in capsys.readouterr().out


def test_gsm8k_task_takes_the_first_rows_of_each_split(tmp_path):
    """``--task gsm8k``: the held-out items are GSM8K's own test rows (never its train rows), the first
    ``num_test`` of them, in verl's prompt with the instruction; ground truths are the ``#### N`` numbers."""
    import pyarrow.parquet as pq

    from bench.learning import TASK_OVERRIDES, make_data

    src = tmp_path / "gsm8k"
    src.mkdir()
    for split, n in (("train", 5), ("test", 4)):
        rows = [{"question": f"{split} q{i}?", "answer": f"work\n#### {1000 * i + 7:,}"} for i in range(n)]
        (src / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    train, test = make_data(tmp_path / "data", 3, 2, task="gsm8k", gsm8k_dir=str(src))
    t, e = pq.read_table(train).to_pylist(), pq.read_table(test).to_pylist()
    assert [r["extra_info"]["question"] for r in t] == ["train q0?", "train q1?", "train q2?"]
    assert [r["extra_info"]["question"] for r in e] == ["test q0?", "test q1?"]
    assert [r["reward_model"]["ground_truth"] for r in e] == ["7", "1007"]  # commas removed
    assert "####" in e[0]["prompt"][0]["content"]  # the instruction asks for the strict format
    assert "data.max_response_length=256" in TASK_OVERRIDES["gsm8k"]
    with pytest.raises(SystemExit, match="--gsm8k-dir"):
        make_data(tmp_path / "x", 3, 2, task="gsm8k")


def test_the_table_names_out_of_memory_retries(capsys):
    from bench.learning import SERIES, print_table

    assert SERIES["oom_retries"] == "monitor/oom_recovery/retries"
    base = {
        "name": "x",
        "steps": 3,
        "train_seconds": 3.0,
        "accuracy_before": None,
        "accuracy_after": None,
        "kl_k3_last20_mean": 0.1,
        "kl_k3_max": 0.2,
        "entropy_min_after_step10": 1.0,
    }
    print_table([{**base, "series": {"oom_retries": [None, 2.0, None], "step_s": [1.0, 1.0, 1.0]}}])
    out = capsys.readouterr().out
    assert "x: out-of-memory retries at steps 2 (2)" in out
    print_table([{**base, "series": {"oom_retries": [None, None, None], "step_s": [1.0, 1.0, 1.0]}}])
    assert "out-of-memory" not in capsys.readouterr().out


def test_the_run_means_add_the_critic_phases_and_its_explained_variance_only_with_a_critic(capsys):
    from bench.learning import SERIES, print_table
    from klppo.trainer.timer import _OOM_ADVICE

    assert {"values", "update_critic"} <= set(_OOM_ADVICE)  # the trainer's phase names, as timing_s/<phase>
    assert SERIES["values_s"] == "timing_s/values" and SERIES["update_critic_s"] == "timing_s/update_critic"
    assert SERIES["vf_explained_var"] == "critic/vf_explained_var"
    base = {
        "name": "x",
        "steps": 2,
        "train_seconds": 2.0,
        "accuracy_before": None,
        "accuracy_after": None,
        "kl_k3_last20_mean": 0.1,
        "kl_k3_max": 0.2,
        "entropy_min_after_step10": 1.0,
    }
    critic = {
        "step_s": [1.0, 3.0],
        "values_s": [0.1, 0.3],
        "update_critic_s": [0.2, 0.4],
        "vf_explained_var": [-0.5, 0.25],
    }
    print_table([{**base, "series": critic}])
    out = capsys.readouterr().out
    assert "step_s 2.000, values_s 0.200, update_critic_s 0.300, vf_explained_var -0.125" in out
    print_table([{**base, "series": {"step_s": [1.0, 3.0], "values_s": [None, None]}}])  # GRPO: no critic
    assert "values_s" not in capsys.readouterr().out


def test_the_recorded_commit_says_when_the_code_differs_from_it(tmp_path):
    import subprocess

    from bench.learning import code_commit

    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    assert code_commit(tmp_path) == ""  # no repository
    git("init", "-q")
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "x.py").write_text("a = 1\n")
    (tmp_path / "notes.txt").write_text("not code\n")
    git("add", "bench/x.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    head = code_commit(tmp_path)
    assert len(head) >= 7 and "+" not in head  # an untracked file outside klppo/ and bench/ is not code
    (tmp_path / "bench" / "x.py").write_text("a = 2\n")
    assert code_commit(tmp_path) == head + "+modified"
